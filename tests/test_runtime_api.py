"""Runtime behaviour beyond parity: layer-wise driving, streaming and prefetch, hooks,
quantized sources, input validation, and the ``forward`` command's library function."""

from __future__ import annotations

import json
import threading
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3convert.checkpoint import open_checkpoint
from k3convert.errors import CheckpointError, ConfigError, K3Error, OutputError
from k3convert.runtime import Runtime, WeightSource
from k3convert.runtime import source as source_mod
from k3convert.runtime.forward_cmd import run_forward
from tests import encode
from tests.models import VOCAB
from tests.test_runtime import IMG, assert_fp32_parity, batch, image_inputs, oracle


class DictSource:
    """The smallest weight source: a config dict and tensors in memory."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor]):
        self.config = config
        self.tensors = tensors
        self.threads: list[str] = []

    def names(self):
        return list(self.tensors)

    def get(self, name, dtype=None):
        self.threads.append(threading.current_thread().name)
        t = self.tensors[name]
        return t if dtype is None else t.to(dtype)


def dict_source(path) -> DictSource:
    ck = open_checkpoint(path)
    return DictSource(dict(ck.config), {n: ck.get(n) for n in ck.names()})


def test_protocol_is_minimal(tiny_models):
    assert isinstance(open_checkpoint(tiny_models["llama"]), WeightSource)
    assert isinstance(dict_source(tiny_models["llama"]), WeightSource)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_layerwise_equals_forward(family, tiny_models):
    ids, mask = batch()
    with Runtime(open_checkpoint(tiny_models[family])) as rt:
        full = rt.forward(ids, attention_mask=mask)
        pos = torch.arange(ids.shape[1])[None].expand(2, -1)
        h = rt.embed(ids)
        for i in range(rt.num_layers):
            h = rt.run_layer(i, h, pos, mask)
        assert torch.equal(rt.head(h), full)


def test_streams_one_unit_at_a_time_with_prefetch(tiny_models, monkeypatch):
    src = dict_source(tiny_models["deepseek_v3"])
    alive = [0]
    peak = [0]
    orig = source_mod.UnitLoader._load

    def gone():
        alive[0] -= 1

    def load(self, unit, *args):
        w = orig(self, unit, *args)
        alive[0] += 1
        weakref.finalize(w, gone)
        peak[0] = max(peak[0], alive[0])
        return w

    monkeypatch.setattr(source_mod.UnitLoader, "_load", load)
    ids, mask = batch()

    def watch(name, x, y):
        peak[0] = max(peak[0], alive[0])

    with Runtime(src) as rt:
        rt.add_hook(watch)
        rt.forward(ids, attention_mask=mask)
        n_units = len(rt.plan.order)
        assert rt.loader.loads == n_units  # each unit loaded exactly once
        assert peak[0] <= 2, f"{peak[0]} units of weights alive at once"
        assert any(t.startswith("k3-prefetch") for t in src.threads), "nothing prefetched"
        rt.forward(ids, attention_mask=mask)
        assert rt.loader.loads == 2 * n_units  # streamed again: nothing kept
    assert alive[0] == 0


def test_resident_keeps_units(tiny_models):
    ids, _ = batch()
    with Runtime(open_checkpoint(tiny_models["llama"]), resident=True) as rt:
        a = rt.forward(ids)
        loads = rt.loader.loads
        b = rt.forward(ids)
        assert rt.loader.loads == loads and torch.equal(a, b)


def test_no_prefetch_gives_same_logits(tiny_models):
    ids, mask = batch()
    with Runtime(open_checkpoint(tiny_models["qwen3_moe"]), prefetch=False) as rt:
        a = rt.forward(ids, attention_mask=mask)
    with Runtime(open_checkpoint(tiny_models["qwen3_moe"])) as rt:
        b = rt.forward(ids, attention_mask=mask)
    assert torch.equal(a, b)


def test_hooks_see_every_linear_by_source_name(tiny_models):
    path = tiny_models["kimi_k25"]
    ck = open_checkpoint(path)
    seen: dict[str, tuple] = {}

    def record(name, x, y):
        seen[name] = (tuple(x.shape), tuple(y.shape))

    pv, grid = image_inputs([[1, 2, 4]])
    ids = torch.tensor([[3, IMG, IMG, 7, 9]])
    with Runtime(ck) as rt:
        rt.add_hook(record)
        rt.forward(ids, pixel_values=pv, image_grid_thw=grid)
    names = set(ck.names())
    assert set(seen) <= names  # source spellings (language_model.model.blocks.N...)
    expected = {
        n
        for n in names
        if n.endswith(".weight")
        and len(ck.meta(n).shape) == 2
        and "embed_tokens" not in n
        and "pos_emb" not in n
        and ".experts." not in n  # routed experts: only those the router picked
    }
    assert expected - set(seen) == set()
    assert any(".experts." in n for n in seen)
    assert "language_model.model.embed_tokens.weight" in seen  # tied head
    assert seen["vision_tower.encoder.blocks.0.wqkv.weight"][1][-1] == 3 * 32
    # a router sees float32 inputs
    router = next(n for n in seen if n.endswith("mlp.gate.weight"))
    assert seen[router][1][-1] == 8


def test_hook_replaces_output_and_can_be_removed(tiny_models):
    ids, _ = batch()
    with Runtime(open_checkpoint(tiny_models["llama"])) as rt:
        base = rt.forward(ids)
        h = rt.add_hook(lambda n, x, y: torch.zeros_like(y), match=r"layers\.1\.mlp\.down_proj")
        zeroed = rt.forward(ids)
        h.remove()
        again = rt.forward(ids)
    assert not torch.allclose(base, zeroed)
    assert torch.equal(base, again)


# -- quantized sources ------------------------------------------------------------------
def _dequantized_copy(src, dst):
    """A plain fp32 copy of an encoded checkpoint (what transformers is then run on)."""
    ck = open_checkpoint(src)
    dst.mkdir()
    save_file({n: ck.get(n).contiguous() for n in ck.names()}, str(dst / "model.safetensors"))
    cfg = dict(ck.config)
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("encoding", ["fp8-block", "int4-packed"])
def test_quantized_source_dequantized_on_load(encoding, tiny_models, tmp_path):
    src = tiny_models["deepseek_v3"]
    q = tmp_path / "q"
    if encoding == "fp8-block":
        encode.encode_fp8_block(src, q, block=(32, 32))
    else:
        encode.encode_pack_quantized(src, q, scope="linear", num_bits=4, group_size=32)
    ck = open_checkpoint(q)
    assert any(ck.meta(n).encoding != "plain" for n in ck.names())
    plain = _dequantized_copy(q, tmp_path / "plain")
    ids, mask = batch()
    with torch.no_grad():
        ref = oracle(plain)(input_ids=ids, attention_mask=mask).logits
    with Runtime(ck) as rt:
        ours = rt.forward(ids, attention_mask=mask)
    assert_fp32_parity(ours, ref, mask, f"deepseek_v3 {encoding}")
    with Runtime(open_checkpoint(src)) as rt:  # and quantization did change something
        orig = rt.forward(ids, attention_mask=mask)
    assert not torch.allclose(orig, ours)


# -- validation -------------------------------------------------------------------------
def test_bad_inputs_are_k3errors(tiny_models):
    rt = Runtime(open_checkpoint(tiny_models["llama"]))
    with pytest.raises(ConfigError, match="vocabulary"):
        rt.forward(torch.tensor([[1, VOCAB + 3]]))
    with pytest.raises(ConfigError, match="integer"):
        rt.forward(torch.zeros(1, 3))
    with pytest.raises(ConfigError, match="attention_mask shape"):
        rt.forward(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 2))
    with pytest.raises(ConfigError, match="no vision tower"):
        rt.forward(torch.tensor([[1, 2]]), pixel_values=torch.zeros(4, 3, 14, 14))
    with pytest.raises(ConfigError, match="dtype"):
        Runtime(open_checkpoint(tiny_models["llama"]), dtype="int8")
    rt.close()


def test_image_token_mismatch(tiny_models):
    pv, grid = image_inputs([[1, 2, 4]])  # 2 merged tokens
    with Runtime(open_checkpoint(tiny_models["kimi_k25"])) as rt:
        with pytest.raises(ConfigError, match="1 image token"):
            rt.forward(torch.tensor([[3, IMG, 5]]), pixel_values=pv, image_grid_thw=grid)
        with pytest.raises(ConfigError, match="no pixel_values"):
            rt.forward(torch.tensor([[3, IMG, 5]]))
        with pytest.raises(ConfigError, match="describes 8 patches"):
            rt.forward(torch.tensor([[IMG, IMG]]), pixel_values=pv[:5], image_grid_thw=grid)
        with pytest.raises(ConfigError, match="merge kernel"):
            bad = torch.tensor([[1, 1, 3]])
            rt.forward(torch.tensor([[IMG]]), pixel_values=pv[:3], image_grid_thw=bad)


def test_incomplete_checkpoint_fails_at_open(tiny_models, model_factory):
    src = dict_source(tiny_models["deepseek_v3"])
    del src.tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    del src.tensors["model.layers.0.self_attn.kv_b_proj.weight"]
    want = r"lacks 2 tensor.*layers\.0\.self_attn\.kv_b_proj\.weight, model\.layers\.2\.mlp\."
    with pytest.raises(CheckpointError, match=want):
        Runtime(src)
    # transformers 5.24 saves kimi_k25 without q_lora_rank under a name no release has
    path = model_factory("kimi_k25", text_config=dict(q_lora_rank=None))
    with pytest.raises(K3Error, match="self_wqkv"):
        Runtime(open_checkpoint(path))


# -- forward command --------------------------------------------------------------------
def test_run_forward_ids_and_saved_logits(tiny_models, tmp_path):
    out = tmp_path / "logits.safetensors"
    text = run_forward(src=tiny_models["llama"], ids="1 2 3; 4 5 6", top=3, save_logits=out)
    assert text.count("sequence") == 2 and "  3. id" in text
    logits = load_file(str(out))["logits"]
    with Runtime(open_checkpoint(tiny_models["llama"])) as rt:
        ref = rt.forward(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert logits.dtype == torch.float32 and torch.equal(logits, ref)


def test_run_forward_ids_file_with_images_bf16(tiny_models, tmp_path):
    ids = torch.tensor([[0, 3, IMG, IMG, 5], [4, IMG, IMG, 6, 7]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    pv, grid = image_inputs([[1, 2, 4], [1, 4, 2]])
    save_file({"input_ids": ids, "attention_mask": mask}, str(tmp_path / "ids.safetensors"))
    save_file({"pixel_values": pv, "image_grid_thw": grid}, str(tmp_path / "pv.safetensors"))
    text = run_forward(
        src=tiny_models["kimi_k25"],
        ids_file=tmp_path / "ids.safetensors",
        pixel_values=tmp_path / "pv.safetensors",
        dtype="bf16",
        top=2,
    )
    assert "kimi_k25" in text and "bf16" in text and text.count("  2. id") == 2


def test_run_forward_errors(tiny_models, tmp_path):
    src = tiny_models["llama"]
    with pytest.raises(ConfigError, match="exactly one"):
        run_forward(src=src)
    with pytest.raises(ConfigError, match="not an integer"):
        run_forward(src=src, ids="1 two 3")
    with pytest.raises(ConfigError, match="different lengths"):
        run_forward(src=src, ids="1 2; 3")
    save_file({"ids": torch.tensor([[1, 2]])}, str(tmp_path / "f.safetensors"))
    with pytest.raises(ConfigError, match="no tensor 'input_ids'"):
        run_forward(src=src, ids_file=tmp_path / "f.safetensors")
    with pytest.raises(ConfigError, match="no such file"):
        run_forward(src=src, ids_file=tmp_path / "missing.safetensors")
    with pytest.raises(OutputError, match="does not exist"):
        run_forward(src=src, ids="1 2", save_logits=tmp_path / "no" / "x.safetensors")
    with pytest.raises(K3Error):
        run_forward(src=tmp_path / "nowhere", ids="1 2")


@pytest.mark.parametrize("device", ["banana", "musa", "cuda:0"])
def test_unusable_device_is_a_clear_error(device):
    import torch

    from k3convert.device import resolve_device
    from k3convert.errors import ConfigError

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"device|torch device"):
        resolve_device(device)
    assert resolve_device("cpu") == torch.device("cpu")

"""Calibrated FP8 KV-cache scales (``quantize --calibrate --kv-cache fp8``).

The scales are checked against what transformers itself computes: the quantized output
loaded by transformers (compressed-tensors' decompressor), run on the same calibration
tokens, with its own ``k_proj`` / ``v_proj`` outputs and its own rotary embedding
(``apply_rotary_pos_emb``) for the roped keys: ``k_scale = max|K| / 448`` and
``v_scale = max|V| / 448`` over the real tokens — the keys and values the quantized
layers really produce (each layer's own weights quantized, fed by the quantized layers
before it). MLA (deepseek_v3) and Kimi K3 (KDA + MLA layers): one scale for the latent
cache, KDA layers none; the runtime then serves the checkpoint with the cache quantized.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

from k3convert.calibrate.data import build_calibration_set
from k3convert.checkpoint.reader import open_checkpoint
from k3convert.cli import main
from k3convert.runtime.runtime import Runtime
from tests.models import QUANT_FAMILIES, save_model
from tests.test_calibrate_sequential import _ids_file

SAMPLES, SEQ = 6, 24


def _quantize(src, out, data, scheme="w4a16", *extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(["quantize", str(src), str(out), "--scheme", scheme, "--calibrate",
                     "--algorithm", "rtn", "--dataset", str(data), "--num-samples",
                     str(SAMPLES), "--seq-len", str(SEQ), "--kv-cache", "fp8", *extra])  # fmt: skip


@pytest.fixture(scope="module")
def llama_kv(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    src = save_model("llama", root / "llama", **QUANT_FAMILIES["llama"])
    data = _ids_file(root / "ids.jsonl")
    out = root / "out"
    assert _quantize(src, out, data, "w4a16") == 0
    return src, out, data


def test_llama_scales_are_transformers_keys_and_values(llama_kv):
    from transformers import CompressedTensorsConfig
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    src, out, data = llama_kv
    cfg = json.loads((out / "config.json").read_text())
    scheme = cfg["quantization_config"]["kv_cache_scheme"]
    assert scheme["num_bits"] == 8 and scheme["type"] == "float" and not scheme["dynamic"]
    calib = build_calibration_set(src, data, num_samples=SAMPLES, seq_len=SEQ, seed=0)
    m = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    seen: dict = {}
    hooks = []
    for i, layer in enumerate(m.model.layers):
        for kind in ("k_proj", "v_proj"):
            mod = getattr(layer.self_attn, kind)
            hooks.append(mod.register_forward_hook(
                lambda mod, a, y, key=(i, kind): seen.setdefault(key, []).append(y)))  # fmt: skip
    with torch.no_grad():
        m(calib.input_ids, attention_mask=calib.attention_mask)
    for h in hooks:
        h.remove()
    mask = calib.attention_mask.bool()
    pos = torch.arange(calib.input_ids.shape[1])[None].expand_as(calib.input_ids)
    q = open_checkpoint(out)
    hd = m.config.hidden_size // m.config.num_attention_heads
    for i in range(m.config.num_hidden_layers):
        k = torch.cat(seen[(i, "k_proj")])
        v = torch.cat(seen[(i, "v_proj")])
        b, s, _ = k.shape
        kh = k.view(b, s, -1, hd).transpose(1, 2)
        cos, sin = m.model.rotary_emb(kh, pos)
        kr, _ = apply_rotary_pos_emb(kh, kh, cos, sin)
        k_ref = kr.transpose(1, 2)[mask].abs().max() / 448
        v_ref = v[mask].abs().max() / 448
        p = f"model.layers.{i}.self_attn."
        ks, vs = q.get(p + "k_scale"), q.get(p + "v_scale")
        assert ks.shape == (1,) and vs.shape == (1,)
        torch.testing.assert_close(ks[0], k_ref, rtol=2e-4, atol=0)
        torch.testing.assert_close(vs[0], v_ref, rtol=2e-4, atol=0)


def test_runtime_serves_the_cache_quantized(llama_kv):
    _, out, _ = llama_kv
    ids = torch.randint(3, 150, (2, 12), generator=torch.Generator().manual_seed(2))
    seen = []
    rt = Runtime(open_checkpoint(out), dtype="fp32", prefetch=False)
    try:
        rt.add_kv_hook(lambda layer, kind, t: seen.append((layer, kind)))
        with_kv = rt.forward(ids)
    finally:
        rt.close()
    rt = Runtime(open_checkpoint(out), dtype="fp32", prefetch=False, act_quant=False)
    try:
        without = rt.forward(ids)
    finally:
        rt.close()
    assert {(0, "k"), (0, "v"), (1, "k"), (1, "v")} <= set(seen)
    d = float((with_kv - without).abs().max())
    assert 0 < d < 0.05 * float(without.abs().max()), d  # quantized, and only slightly


def test_mla_and_kda_layers(tmp_path):
    """deepseek_v3: k_scale == v_scale (the latent + rope entry); Kimi K3 (KDA + MLA):
    scales on MLA layers only, and the output opens and runs."""
    from k3convert.synth import synthesize

    data = _ids_file(tmp_path / "ids.jsonl")
    dsv3 = save_model("deepseek_v3", tmp_path / "dsv3")
    out = tmp_path / "dsv3-out"
    assert _quantize(dsv3, out, data, "w8a8") == 0
    q = open_checkpoint(out)
    for i in range(q.config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        ks, vs = q.get(p + "k_scale"), q.get(p + "v_scale")
        assert torch.equal(ks, vs) and float(ks) > 0 and torch.isfinite(ks).all()

    k3 = tmp_path / "k3"
    synthesize(config="kimi-k3", out=k3, tiny=True, encoding="plain", seed=3)
    out = tmp_path / "k3-out"
    assert _quantize(k3, out, data, "w8a8", "--algorithm", "rtn") == 0
    q = open_checkpoint(out)
    names = [n for n in q.names() if n.endswith("k_scale")]
    rt = Runtime(q, dtype="fp32", prefetch=False)
    try:
        kinds = [rt.text.attention_of(i) for i in range(rt.num_layers)]
        logits = rt.forward(torch.randint(3, 100, (1, 8)))
    finally:
        rt.close()
    assert len(names) == kinds.count("mla") >= 1 and "kda" in kinds
    assert torch.isfinite(logits).all()


def test_kv_cache_needs_calibrate_and_a_source_without_scales(llama_kv, tmp_path, capsys):
    src, out, data = llama_kv
    rc = main(["quantize", str(src), str(tmp_path / "o"), "--scheme", "w4a16",
               "--kv-cache", "fp8"])  # fmt: skip
    assert rc == 2 and "only apply with --calibrate" in capsys.readouterr().err
    # re-quantizing an output that has scales: refused with --kv-cache ...
    assert _quantize(out, tmp_path / "again", data, "w4a16") == 2
    assert "already carries KV-cache scales" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
    # ... and without it they are carried over with their scheme (the output opens)
    rc = main(["quantize", str(out), str(tmp_path / "carried"), "--scheme", "fp8-dynamic"])
    assert rc == 0
    cfg = json.loads((tmp_path / "carried" / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8
    assert "model.layers.0.self_attn.k_scale" in open_checkpoint(tmp_path / "carried").names()


def test_source_scales_survive_smoothing_unchanged(tmp_path):
    """A source with its own KV-cache scales keeps them (and its kv_cache_scheme): AWQ
    then leaves out the smoothing sites that change what enters the cache (MLA's
    kv_a_layernorm), so the copied scales stay true."""
    import shutil

    from safetensors.torch import save_file

    from k3convert.quant.kvcache import kv_cache_scheme, kv_scale_tensors

    dsv3 = save_model("deepseek_v3", tmp_path / "dsv3")
    src = tmp_path / "with-kv"
    shutil.copytree(dsv3, src)
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    scales = kv_scale_tensors({i: {"latent": 4.0, "k_rot": 2.0} for i in range(n)}, cfg)
    save_file(scales, str(src / "kv.safetensors"), metadata={"format": "pt"})
    (src / "model.safetensors").rename(src / "main.safetensors")
    names = open_checkpoint(dsv3).names()
    wm = {**dict.fromkeys(names, "main.safetensors"), **dict.fromkeys(scales, "kv.safetensors")}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    cfg["quantization_config"] = {"kv_cache_scheme": kv_cache_scheme()}
    (src / "config.json").write_text(json.dumps(cfg))
    data = _ids_file(tmp_path / "ids.jsonl")
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["quantize", str(src), str(out), "--scheme", "int8-channel", "--calibrate",
                   "--algorithm", "awq", "--dataset", str(data), "--num-samples", "4",
                   "--seq-len", "16"])  # fmt: skip
    assert rc == 0
    q, s = open_checkpoint(out), open_checkpoint(src)
    for name, t in scales.items():
        assert torch.equal(q.get(name), t)
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
        == kv_cache_scheme()
    )
    for i in range(n):  # the cached latent's norm was not smoothed
        key = f"model.layers.{i}.self_attn.kv_a_layernorm.weight"
        assert torch.equal(q.get(key), s.get(key))
    assert not torch.equal(q.get("model.layers.1.mlp.gate.weight"),
                           s.get("model.layers.1.mlp.gate.weight"))  # fmt: skip

"""Kimi K3 / Kimi-Linear day 0: the tables read the vendors' checkpoints, inspect's totals
match the published dimensions, synth rehearses the release, shard splits KDA by heads and
reassembles bit for bit, and bad inputs fail clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3convert.arch import resolve, validate_source
from k3convert.checkpoint import open_checkpoint
from k3convert.errors import ConfigError
from k3convert.inspect import inspect_path
from k3convert.shard import shard as reshard
from k3convert.stream import read_manifest_doc
from k3convert.stream.format import SplitError
from k3convert.synth import preset_config, synthesize
from tests.models import edit_tensors
from tests.test_shard_support import _bytes_equal, reassemble

K3 = dict(
    hidden=7168, layers=93, kda=69, mla=24, heads=96, hd=128, vocab=163840, experts=896,
    inter=3072, latent=3584, shared=2, dense_inter=33792, q_lora=1536, kv_lora=512,
)  # fmt: skip


def _write(tmp_path: Path, raw: dict) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    return p


# -- inspect on the config alone ------------------------------------------------------
def test_kimi_k3_published_dimensions(tmp_path):
    """2.8 T total, ~104 B active; every component against hand-computed counts."""
    r = inspect_path(path=_write(tmp_path, preset_config("kimi-k3")))
    k = K3
    H, P = k["hidden"], k["heads"] * k["hd"]
    moe_layers = k["layers"] - 1
    routed = moe_layers * k["experts"] * 3 * k["inter"] * k["latent"]
    kda_layer = 3 * P * H + 3 * P * 4 + 96 + P + k["hd"] * H + P * k["hd"] + 96 * H + P * H
    kda_layer += P * H  # o_proj
    mla_layer = (
        k["q_lora"] * H
        + k["heads"] * 192 * k["q_lora"]
        + (k["kv_lora"] + 64) * H
        + k["heads"] * 256 * k["kv_lora"]
        + H * k["heads"] * 128
        + k["heads"] * 128 * H  # output gate
    )
    comp = {c: v["params"] for c, v in r["by_component"].items()}
    assert comp["routed_experts"] == routed
    assert comp["linear_attention"] == k["kda"] * kda_layer
    assert comp["attention"] == k["mla"] * mla_layer
    assert comp["latent"] == moe_layers * (2 * k["latent"] * H + k["latent"])  # + norm
    assert comp["shared_experts"] == moe_layers * 3 * k["shared"] * k["inter"] * H
    assert comp["dense_mlp"] == 3 * k["dense_inter"] * H
    assert comp["router"] == moe_layers * (k["experts"] * H + k["experts"])
    assert comp["attn_res"] == k["layers"] * 4 * H + 2 * H
    assert comp["embeddings"] == comp["head"] == k["vocab"] * H
    assert 0.35e9 < comp["vision"] < 0.45e9 and 40e6 < comp["projector"] < 50e6
    assert 2.75e12 < r["total_params"] < 2.85e12
    assert 100e9 < r["active_params"] < 108e9
    assert r["kda"] == {"layers": 69, "mla_layers": 24, "heads": 96, "head_dim": 128,
                        "conv_kernel": 4}  # fmt: skip
    assert r["experts"] == {"routed": 896, "active": 16, "shared": 2}
    assert r["latent_moe"] == 3584 and r["attn_res_block_size"] == 12


def test_kimi_linear_48b_published_dimensions(tmp_path):
    """Kimi-Linear-48B-A3B: ~48 B total, ~3 B active, 20 KDA + 7 MLA layers."""
    r = inspect_path(path=_write(tmp_path, preset_config("kimi-linear-48b")))
    assert 47e9 < r["total_params"] < 50e9
    assert 2.8e9 < r["active_params"] < 3.8e9
    assert r["kda"]["layers"] == 20 and r["kda"]["mla_layers"] == 7


def test_kda_layer_lists_must_match_num_hidden_layers(tmp_path):
    raw = preset_config("kimi-k3")
    raw["text_config"]["linear_attn_config"]["kda_layers"].append(94)
    with pytest.raises(ConfigError, match=r"layer\(s\) \[94\].*num_hidden_layers is 93"):
        resolve(raw)
    raw = preset_config("kimi-k3")
    raw["text_config"]["linear_attn_config"]["full_attn_layers"].remove(93)
    with pytest.raises(ConfigError, match=r"partition the 93 layers.*\[93\] are in neither"):
        resolve(raw)
    r = subprocess.run(
        [sys.executable, "-m", "k3convert", "inspect", str(_write(tmp_path, raw))],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "neither list" in r.stderr


# -- the vendors' own checkpoints read with our tables ---------------------------------
def test_tables_read_the_vendors_checkpoints(tmp_path, model_factory):
    """Names and shapes written by transformers' KimiLinearForCausalLM and by Moonshot's
    KimiK3ForConditionalGeneration are exactly what the tables expect."""
    from tests.moonshot_oracle import build_kimi_k3

    for d in (model_factory("kimi_linear"), build_kimi_k3(tmp_path / "k3", vision=True)):
        ck = open_checkpoint(d)
        arch, cfg = resolve(ck.config)
        matched = validate_source(arch, cfg, ck, str(d))
        assert len(matched) == len(ck.names())
        kinds = {m.role.component for m in matched.values()}
        assert {"linear_attention", "attention", "routed_experts", "router"} <= kinds


# -- synth, shard, reassemble -----------------------------------------------------------
@pytest.fixture(scope="module")
def k3_synth(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("k3") / "synth"
    synthesize(config="kimi-k3", out=out, tiny=True, encoding="plain", seed=3)
    return out


def test_synth_k3_is_the_release_scaled_down(k3_synth):
    cfg = json.loads((k3_synth / "config.json").read_text())
    t = cfg["text_config"]
    lac = t["linear_attn_config"]
    assert cfg["model_type"] == "kimi_k3" and t["model_type"] == "kimi_linear"
    assert lac["full_attn_layers"] == [4, 5] and lac["kda_layers"] == [1, 2, 3]
    assert t["attn_res_block_size"] == 2 and t["routed_expert_hidden_size"] == 128
    with safe_open(k3_synth / "model.safetensors", "pt") as f:
        a_log = f.get_slice("language_model.model.layers.0.self_attn.A_log").get_shape()
        conv = f.get_slice("language_model.model.layers.0.self_attn.q_conv1d.weight")
        assert a_log == [128]  # padded past its 4 heads, as the release pads 96 to 128
        assert conv.get_shape() == [512, 1, 4]  # 4 KDA heads x 128


def _source_tensors(d: Path) -> dict[str, torch.Tensor]:
    with safe_open(d / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 2)])
def test_k3_shards_reassemble_bit_exact(k3_synth, tmp_path, tp, ep):
    out = tmp_path / f"tp{tp}ep{ep}"
    reshard(src=k3_synth, out=out, tp=tp, ep=ep, progress=False)
    glob, _ = reassemble(out)
    src = _source_tensors(k3_synth)
    assert sorted(glob) == sorted(src)
    heads = 4
    for name, t in src.items():
        want = t[:heads] if name.endswith("A_log") else t  # the unused padding is dropped
        assert _bytes_equal(glob[name], want), name
    man = read_manifest_doc(out)
    entries = [e for r in man["ranks"] for u in r["units"] for e in u["tensors"]]
    q = [e for e in entries if e["name"].endswith("layers.0.self_attn.q_proj.weight")]
    assert len(q) == tp and {e["shape"][0] for e in q} == {512 // tp}
    down = [e for e in entries if "routed_expert_down_proj" in e["name"]]
    assert all(e["split_dim"] is None for e in down)  # latent projections replicated


def test_tp_must_divide_kda_heads(k3_synth, tmp_path):
    with pytest.raises(SplitError, match=r"4 KDA heads do not divide into 3.*\[1, 2, 4\]"):
        reshard(src=k3_synth, out=tmp_path / "tp3", tp=3, progress=False)
    r = subprocess.run(
        [sys.executable, "-m", "k3convert", "shard", str(k3_synth), str(tmp_path / "o"),
         "--tp", "3"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "[1, 2, 4]" in r.stderr and not (tmp_path / "o" / "manifest.json").exists()


def test_ep_placement_of_896_experts():
    """K3's 896 experts over ep=8: 112 contiguous experts per rank; with measured loads
    and 8 redundant copies, 113 slots per rank, every expert placed, the hottest copied."""
    from k3convert.layout import place_experts

    ranks = place_experts(896, 8)
    assert [len(r) for r in ranks] == [112] * 8 and ranks[1][0] == 112
    load = [1.0] * 896
    for hot in (5, 300, 301, 777):
        load[hot] = 50.0
    ranks = place_experts(896, 8, load=load, redundant=8)
    assert [len(r) for r in ranks] == [113] * 8
    held = [e for r in ranks for e in r]
    assert set(held) == set(range(896))
    assert all(held.count(h) >= 2 for h in (5, 300, 301, 777))
    assert all(len(set(r)) == len(r) for r in ranks)  # no rank holds a copy twice


# -- the whole pipeline on a scaled-down K3 -----------------------------------------------
def _logits(rt, ids) -> torch.Tensor:
    with rt:
        return rt.forward(ids)


@pytest.mark.parametrize("encoding", ["plain", "mxfp4"])
def test_k3_synth_quantize_shard_forward(tmp_path, encoding):
    """synth -> inspect -> quantize -> shard: a one-rank stream's logits equal the
    quantized checkpoint's bit for bit; tp2 x ep2 streams agree to float32 rounding
    (weight-only FP8: with activation quantization a row-parallel rank takes its scales
    over its own slice, as serving kernels do, so tp > 1 legitimately differs)."""
    from k3convert.pipeline import quantize
    from k3convert.runtime import Runtime
    from k3convert.runtime.parallel import ParallelRuntime
    from k3convert.runtime.ranks import stream_ranks
    from k3convert.stream import open_stream

    src = tmp_path / "synth"
    synthesize(config="kimi-k3", out=src, tiny=True, encoding=encoding, seed=5)
    rep = inspect_path(path=src)
    if encoding == "mxfp4":  # every routed expert as released, nothing else
        n_experts = 4 * 8 * 3
        assert rep["by_encoding"]["mxfp4-pack-quantized"]["tensors"] == n_experts
        # the release's ignore list misses bf16 Linears: read as stored, with a note
        claimed = {c["tensor"] for c in rep["claimed_but_plain"]}
        assert "language_model.model.layers.0.self_attention_res_proj.weight" in claimed
        latent = "language_model.model.layers.1.block_sparse_moe.routed_expert_down_proj"
        assert f"{latent}.weight" in claimed
        assert not any(".experts." in n for n in claimed)
    q = tmp_path / "q"
    quantize(src=src, out=q, scheme="fp8-channel", progress=False)
    one, two = tmp_path / "tp1", tmp_path / "tp2ep2"
    reshard(src=q, out=one, progress=False)
    reshard(src=q, out=two, tp=2, ep=2, progress=False)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = _logits(Runtime(open_checkpoint(q)), ids)
    assert torch.isfinite(ref).all() and ref.std() > 0
    got = _logits(Runtime(open_stream(one)), ids)
    assert torch.equal(got, ref)
    par = _logits(ParallelRuntime(stream_ranks(open_stream(two))), ids)
    assert (par - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(par.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    "preset,encoding",
    [("kimi-k3", "mxfp4-pack-quantized"), ("kimi-k2-thinking", "pack-quantized")],
)
def test_kept_experts_stay_as_released(tmp_path, preset, encoding):
    """--keep on experts a release stores in a compressed-tensors format copies their parts
    byte for byte and describes them by that format's config group; the rest is requantized
    and the model still runs."""
    from k3convert.pipeline import quantize
    from k3convert.runtime import Runtime

    src, out = tmp_path / "src", tmp_path / "out"
    synthesize(config=preset, out=src, tiny=True, seed=2)
    experts = r"re:.*\.experts\.\d+\..*"
    res = quantize(src=src, out=out, scheme="fp8-channel", keep=[experts], progress=False)
    stored = [r for r in res.plan.rows if r.as_stored]
    assert stored and all(r.role.expert is not None for r in stored)
    s_ck, o_ck = open_checkpoint(src), open_checkpoint(out)
    for r in stored:
        assert o_ck.meta(r.name).encoding == encoding
        a, b = s_ck.get_parts(r.name), o_ck.get_parts(r.name)
        assert sorted(a) == sorted(b)
        assert all(_bytes_equal(a[k], b[k]) for k in a), r.name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fmts = {g["format"] for g in qc["config_groups"].values()}
    assert qc["format"] == "mixed-precision" and fmts == {"naive-quantized", encoding}
    attn = [r for r in res.plan.rows if r.role.component == "attention" and not r.kept]
    assert attn and all(r.scheme.name == "fp8-channel" and not r.as_stored for r in attn)
    ids = torch.arange(1, 9)[None]
    with Runtime(o_ck) as rt:
        assert torch.isfinite(rt.forward(ids)).all()
    # opt-out: the same kept experts written dequantized, equal to the source's values
    deq = tmp_path / "deq"
    quantize(src=src, out=deq, scheme="fp8-channel", keep=[experts], kept_as_stored=False,
             progress=False)  # fmt: skip
    d_ck = open_checkpoint(deq)
    n = stored[0].name
    assert d_ck.meta(n).encoding == "plain"
    assert torch.equal(d_ck.get(n), s_ck.get(n, dtype=d_ck.meta(n).dtype).float())


def test_kept_expert_with_a_nan_exponent_is_refused(tmp_path):
    from k3convert.errors import CheckpointError
    from k3convert.pipeline import quantize

    src = tmp_path / "src"
    synthesize(config="kimi-k3", out=src, tiny=True, seed=2)
    bad = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"

    def nan_exponent(sd) -> bool:
        if bad not in sd:
            return False
        sd[bad][0, 0] = 255
        return True

    edit_tensors(src, nan_exponent)
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight_scale.*255"):
        quantize(src=src, out=tmp_path / "o", scheme="fp8-channel",
                 keep=[r"re:.*\.experts\..*"], progress=False)  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_kimi_linear_stream_from_transformers_checkpoint(model_factory, tmp_path):
    """transformers' own kimi_linear checkpoint: tp2 x ep2 shards reassemble bit for bit
    (A_log [1, 1, H, 1] split along its head dim) and the stream runs like the source."""
    from k3convert.runtime import Runtime
    from k3convert.runtime.parallel import ParallelRuntime
    from k3convert.runtime.ranks import stream_ranks
    from k3convert.stream import open_stream

    src = model_factory("kimi_linear")
    out = tmp_path / "s"
    reshard(src=src, out=out, tp=2, ep=2, progress=False)
    glob, _ = reassemble(out)
    source = _source_tensors(src)
    assert sorted(glob) == sorted(source)
    assert all(_bytes_equal(glob[n], t) for n, t in source.items())
    man = read_manifest_doc(out)
    a_log = [e for r in man["ranks"] for u in r["units"] for e in u["tensors"]
             if e["name"].endswith("layers.0.self_attn.A_log")]  # fmt: skip
    assert [e["split_dim"] for e in a_log] == [2, 2] and a_log[1]["offset"] > 0
    ids = torch.arange(3, 14)[None]
    ref = _logits(Runtime(open_checkpoint(src)), ids)
    got = _logits(ParallelRuntime(stream_ranks(open_stream(out))), ids)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_attention_rules_cover_kda_layers(k3_synth, tmp_path):
    """A recipe's ``attention`` rule (as the Kimi-K2 recipes write it) quantizes the KDA
    layers' projections too, not just the MLA layers'; their small gates stay kept."""
    from k3convert.pipeline.quantize import plan_quantization

    r = tmp_path / "r.yaml"
    r.write_text(
        "quantize:\n  rules:\n    - roles: [experts]\n      scheme: mxfp4\n"
        "    - roles: [attention]\n      scheme: fp8-channel\n"
    )
    _, plan = plan_quantization(src=k3_synth, recipe=r)
    by = {d.name: d for d in plan.rows}
    p = "language_model.model.layers."
    for layer, kind in ((0, "q_proj"), (0, "o_proj"), (0, "g_proj"), (3, "q_b_proj")):
        d = by[f"{p}{layer}.self_attn.{kind}.weight"]
        assert d.scheme is not None and d.scheme.name == "fp8-channel", (layer, kind)
    for kind in ("b_proj", "f_a_proj", "f_b_proj", "q_conv1d", "A_log", "dt_bias"):
        name = f"{p}0.self_attn.{kind}" + ("" if kind in ("A_log", "dt_bias") else ".weight")
        assert by[name].kept, kind
    assert by[f"{p}1.block_sparse_moe.experts.0.w1.weight"].scheme.name == "mxfp4"

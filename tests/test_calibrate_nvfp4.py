"""NVFP4 (W4A4) activations calibrated: every quantized Linear's ``input_global_scale`` is
compressed-tensors' ``generate_gparam`` of the largest |input| the Linear saw in
calibration (``448 * 6 / amax`` in float32), routed experts from the tokens routed to
them, an expert that saw none its siblings' (the smallest, never 1.0, inf or NaN)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from k3convert.calibrate.data import build_calibration_set
from k3convert.calibrate.sequential import SequentialOptions, calibrate_sequential
from k3convert.pipeline.quantize import UncalibratedInputWarning, plan_quantization
from tests.models import save_model
from tests.test_calibrate_moe import _cli
from tests.test_calibrate_sequential import _ids_file

SAMPLES, SEQ, BATCH = 8, 24, 4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("calnv")
    return root, _ids_file(root / "ids.jsonl"), save_model("deepseek_v3", root / "dsv3")


def _gparam(amax: float) -> float:
    """compressed-tensors' global scale of a tensor range (FP8 e4m3 max x FP4 max / amax)."""
    from compressed_tensors.quantization.utils import generate_gparam

    a = torch.tensor([amax])
    return float(generate_gparam(-a, a))


@pytest.mark.parametrize("algorithm", ["rtn", "static"])
def test_every_nvfp4_linear_gets_its_input_global_scale(work, algorithm):
    root, data, src = work
    calib = build_calibration_set(src, data, num_samples=SAMPLES, seq_len=SEQ, seed=0,
                                  packing=False, min_len=8)  # fmt: skip
    ckpt, plan = plan_quantization(src=src, scheme="nvfp4")
    seen: dict = {}

    def obs(i, name, x, m):
        seen.setdefault(name, []).append(x.reshape(-1, x.shape[-1])[m.reshape(-1).bool()])

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        res = calibrate_sequential(ckpt, plan, calib, algorithm=algorithm,
                                   options=SequentialOptions(batch_size=BATCH),
                                   journal=root / f"j-{algorithm}", observer=obs)  # fmt: skip
    layer_rows = [r for r in plan.quantized if r.role.layer is not None]
    assert layer_rows and {r.module for r in layer_rows} <= set(res.input_scales)
    checked = 0
    for r in layer_rows:
        g = res.input_scales[r.module]
        assert torch.isfinite(torch.tensor(g)) and g > 0 and g != 1.0, r.module
        xs = [x for x in seen.get(r.name, []) if x.numel()]
        if not xs or float(torch.cat(xs).abs().max()) == 0:
            assert r.name in res.fallbacks
            continue
        assert g == _gparam(float(torch.cat(xs).float().abs().max())), r.module
        checked += 1
    assert checked > len(layer_rows) // 2
    experts = [r for r in layer_rows if r.role.expert is not None]
    by_expert: dict = {}
    for r in experts:  # gate and up see the same tokens: one scale, as vLLM's w13 takes
        if r.module.endswith(("gate_proj", "up_proj")):
            by_expert.setdefault(r.module.rsplit(".", 1)[0], set()).add(res.input_scales[r.module])
    assert by_expert and all(len(v) == 1 for v in by_expert.values())


def test_expert_without_tokens_takes_its_siblings_smallest(work):
    """An expert the router never picks: its input global scale is the smallest of its
    siblings' same projection (the widest range), listed among the fallbacks."""
    root, data, src = work
    calib = build_calibration_set(src, data, num_samples=2, seq_len=8, seed=0,
                                  packing=False, min_len=8)  # fmt: skip
    ckpt, plan = plan_quantization(src=src, scheme="nvfp4")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        res = calibrate_sequential(ckpt, plan, calib, algorithm="rtn",
                                   options=SequentialOptions(batch_size=BATCH),
                                   journal=root / "j-few")  # fmt: skip
    starved = [n for n in res.fallbacks if ".experts." in n]
    assert starved, "the tiny calibration set should leave some expert without tokens"
    for n in starved:
        mod = n.removesuffix(".weight")
        layer, leaf = mod.split(".experts.")[0], mod.rsplit(".", 1)[1]
        sib = [v for m, v in res.input_scales.items() if m.startswith(layer + ".experts.")
               and m.endswith("." + leaf) and m + ".weight" not in res.fallbacks]  # fmt: skip
        assert sib and res.input_scales[mod] == min(sib)


def test_cli_nvfp4_calibrated_and_uncalibrated(work, capsys):
    root, data, src = work
    out = root / "nv-cal"
    rc, text = _cli(["quantize", src, out, "--scheme", "nvfp4", "--calibrate", "--dataset",
                     data, "--num-samples", 4, "--seq-len", 16])  # fmt: skip
    assert rc == 0, text
    st = load_file(out / "model.safetensors")
    scales = {k: float(v) for k, v in st.items() if k.endswith("input_global_scale")}
    layers = {k: v for k, v in scales.items() if ".layers." in k}
    assert layers and all(v != 1.0 and v > 0 and v < float("inf") for v in layers.values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]
    # without calibration: a warning naming the way to calibrate, the 1.0 default
    with pytest.warns(UncalibratedInputWarning, match="--calibrate"):
        from k3convert.pipeline import quantize

        quantize(src=src, out=root / "nv-raw", scheme="nvfp4", progress=False)


def _fused_sets(st: dict) -> list[list[str]]:
    """Module prefixes of ``st``'s sets of fused siblings (q/k/v, gate/up, q_a/kv_a, an
    expert's w1/w3) with more than one member stored."""
    from k3convert.engines.vllm_layers import FUSED_SETS

    out = []
    mods = {k.removesuffix(".weight_global_scale") for k in st if k.endswith("weight_global_scale")}
    parents = {m.rpartition(".")[0] for m in mods}
    for p in parents:
        for names in FUSED_SETS:
            got = [f"{p}.{n}" for n in names if f"{p}.{n}" in mods]
            if len(got) > 1:
                out.append(got)
    return out


def test_gptq_solves_nvfp4_with_the_fused_sets_global_scales(work):
    """--calibrate with an FP4 scheme runs GPTQ by default (the input global scales as
    before): every Linear's values are GPTQ's (not round to nearest's), and each fused
    set (q_a / kv_a, gate / up, an expert's w1 / w3) keeps one global scale, the set's
    largest |value|'s, as the uncalibrated writer gives it and a serving engine needs."""
    root, data, src = work
    out, raw = root / "nv-gptq", root / "nv-rtn"
    rc, text = _cli(["quantize", src, out, "--scheme", "nvfp4", "--calibrate", "--dataset",
                     data, "--num-samples", 4, "--seq-len", 16])  # fmt: skip
    assert rc == 0, text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["k3convert"]["calibration"]["algorithm"] == "gptq"
    rc, text = _cli(["quantize", src, raw, "--scheme", "nvfp4"])
    assert rc == 0, text
    st, rt = load_file(out / "model.safetensors"), load_file(raw / "model.safetensors")
    packed = [k for k in st if k.endswith("weight_packed") and ".layers." in k]
    assert packed and all(st[k].shape == rt[k].shape for k in packed)
    moved = {k for k in packed if not torch.equal(st[k], rt[k])}
    dense = [k for k in packed if ".experts." not in k]  # (an expert may see no token)
    assert dense and set(dense) <= moved, sorted(set(dense) - moved)
    assert any(".experts." in k for k in moved)
    sets = _fused_sets(st)
    assert any(".experts." in s[0] for s in sets) and any("gate_proj" in s[0] for s in sets)
    for members in sets:
        g = [st[f"{m}.weight_global_scale"] for m in members]
        assert all(torch.equal(g[0], x) for x in g), members
        assert torch.equal(g[0], rt[f"{members[0]}.weight_global_scale"]), members


def test_smoothed_fused_sets_keep_one_global_scale(work, monkeypatch):
    """SmoothQuant (and AWQ) with NVFP4: smoothing changes a fused set's weights (q_a /
    kv_a, gate / up, an expert's w1 / w3: one norm's readers, and up_proj's rows where
    up -> down is smoothed), so the set's one global scale is compressed-tensors'
    ``generate_gparam`` of the largest |value| of the weights actually quantized (the
    smoothed ones, every member in float32 alike), not of the source's; sets smoothing
    left alone keep the uncalibrated writer's."""
    import k3convert.calibrate.layer as layer_mod

    root, data, src = work
    seen: dict = {}
    real = layer_mod.round_to_nearest

    def spy(ckpt, name, scheme, w, smoothed, share=None):
        seen[name] = (float(w.float().abs().max()), None if share is None else float(share.amax),
                      smoothed, w.dtype)  # fmt: skip
        return real(ckpt, name, scheme, w, smoothed, share)

    monkeypatch.setattr(layer_mod, "round_to_nearest", spy)
    out, raw = root / "nv-sq", root / "nv-sq-rtn"
    rc, text = _cli(["quantize", src, out, "--scheme", "nvfp4", "--calibrate", "--algorithm",
                     "smoothquant", "--alpha-search", "--sq-min-gain", 0, "--dataset", data,
                     "--num-samples", 4, "--seq-len", 16])  # fmt: skip
    assert rc == 0, text
    rc, text = _cli(["quantize", src, raw, "--scheme", "nvfp4"])
    assert rc == 0, text
    st, rt = load_file(out / "model.safetensors"), load_file(raw / "model.safetensors")
    sets = _fused_sets(st)
    assert any(".experts." in s[0] for s in sets) and any("q_a_proj" in s[0] for s in sets)
    changed = 0
    for members in sets:
        g = [st[f"{m}.weight_global_scale"] for m in members]
        assert all(torch.equal(g[0], x) for x in g), members
        got = [seen[f"{m}.weight"] for m in members]
        if not any(s[2] for s in got):  # not smoothed: as the plain writer has it
            assert torch.equal(g[0], rt[f"{members[0]}.weight_global_scale"]), members
            continue
        changed += 1
        top = max(s[0] for s in got)
        assert all(s[1] == top and s[2] and s[3] == torch.float32 for s in got), (members, got)
        assert float(g[0]) == _gparam(top), members
        assert not torch.equal(g[0], rt[f"{members[0]}.weight_global_scale"]), members
    assert changed >= 2, changed


def test_smoothing_leaves_released_mxfp4_experts_exact(work):
    """A MoE whose routed experts are released in MXFP4 (here the fixture's, written by
    ``quantize --scheme mxfp4``): AWQ to nvfp4a16 leaves alone the mappings that would
    change them (the post-attention norm's, whose readers include every routed expert,
    and each expert's up -> down), smooths the others, and every routed expert holds the
    release's values."""
    from k3convert.checkpoint import open_checkpoint
    from k3convert.quant.schemes import get_scheme

    root, data, src = work
    rel, out = root / "dsv3-mxfp4", root / "awq-from-mxfp4"
    rc, text = _cli(["quantize", src, rel, "--scheme", "mxfp4", "--keep",
                     r"re:^(?!.*\.experts\.\d+\.).*"])  # fmt: skip
    assert rc == 0, text
    ck = open_checkpoint(rel)
    routed = [n for n in ck.names() if ".experts." in n and n.endswith(".weight")]
    assert routed and all(ck.meta(n).encoding == "mxfp4-pack-quantized" for n in routed)
    rc, text = _cli(["quantize", rel, out, "--scheme", "nvfp4a16", "--calibrate", "--algorithm",
                     "awq", "--dataset", data, "--num-samples", 4, "--seq-len", 16])  # fmt: skip
    assert rc == 0, text
    cal = json.loads((out / "config.json").read_text())["k3convert"]["calibration"]
    assert cal["smoothed_mappings"] > 0, cal
    oc, scheme = open_checkpoint(out), get_scheme("nvfp4a16")
    moved = [n for n in routed
             if not torch.equal(scheme.dequantize(oc.get_parts(n)), ck.get(n).float())]  # fmt: skip
    assert moved == []


def test_released_mxfp4_stays_exact_unless_solved(tmp_path):
    """Kimi K3's routed experts are released in MXFP4, which NVFP4 holds exactly: GPTQ
    leaves them to the exact transcode (every value the release's) and solves the rest;
    ``--gptq-solve-released`` solves them too (then they move). AWQ leaves alone every
    mapping that would change them (smoothing the others)."""
    from k3convert.checkpoint import open_checkpoint
    from k3convert.quant.schemes import get_scheme
    from k3convert.synth import synthesize
    from tests.test_calibrate_sequential import _ids_file

    src = tmp_path / "k3"
    # 2 layers (a dense one, then MoE), 4 experts: the smallest K3 with routed experts
    synthesize(config="kimi-k3", out=src, tiny=True, overrides={"layers": 2, "experts": 4})
    data = _ids_file(tmp_path / "ids.jsonl")
    ck = open_checkpoint(src)
    routed = [n for n in ck.names() if ".experts." in n and n.endswith(".weight")]
    assert routed and all(ck.meta(n).encoding == "mxfp4-pack-quantized" for n in routed)
    scheme = get_scheme("nvfp4a16")
    moved = {}
    for flag in ([], ["--gptq-solve-released"], ["--algorithm", "awq"]):
        out = tmp_path / ("-".join(flag) or "exact")
        rc, text = _cli(["quantize", src, out, "--scheme", "nvfp4a16", "--calibrate",
                         "--dataset", data, "--num-samples", 2, "--seq-len", 8,
                         "--no-progress", *flag])  # fmt: skip
        assert rc == 0, text
        oc = open_checkpoint(out)
        if "awq" in flag:
            cal = json.loads((out / "config.json").read_text())["k3convert"]["calibration"]
            assert cal["smoothed_mappings"] > 0, cal
        moved[" ".join(flag)] = [n for n in routed if not torch.equal(
            scheme.dequantize(oc.get_parts(n)), ck.get(n).float())]  # fmt: skip
        dense = [n for n in oc.names() if ".experts." not in n and "self_attn.q_proj" in n]
        assert dense and not torch.equal(oc.get(dense[0]).float(), ck.get(dense[0]).float())
    assert moved[""] == []  # every routed expert holds the release's values
    assert moved["--algorithm awq"] == []
    assert len(moved["--gptq-solve-released"]) >= len(routed) // 4  # solved (those with tokens)

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
from k3convert.cli import main
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
    # GPTQ cannot do NVFP4, and says so with advice that works (rtn / static do)
    capsys.readouterr()
    argv = ["quantize", src, root / "nv-gptq", "--scheme", "nvfp4", "--calibrate",
            "--algorithm", "gptq", "--dataset", data]  # fmt: skip
    rc = main([str(a) for a in argv])
    assert rc == 2 and "--algorithm rtn (or static)" in capsys.readouterr().err

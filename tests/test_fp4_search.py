"""The FP4 ``mse`` weight observer (k3convert.quant.fp4_search) against compressed-tensors.

Oracle: for every candidate scale code of the window (round to nearest's code plus
``NV_OFFSETS`` / ``MX_OFFSETS``), compressed-tensors' own ``fake_quantize`` (its FP4
rounding and dequantization, NVFP4's ``tensor_group`` under the global scale) gives each
group's values, so each group's error per candidate, and the first smallest is the code
the search must pick; the stored bytes must be what ``NVFP4PackedCompressor`` /
``MXFP4PackedCompressor.compress`` write for the chosen scales. Then: never above round
to nearest's error in any group, the parts the scheme's, the output-error form (``gram``)
scored as ``d^T G d``, and the observer reachable from a recipe and the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from k3convert import formats as fmt
from k3convert.cli import main
from k3convert.errors import ConfigError
from k3convert.quant import fp4_search
from k3convert.quant.schemes import get_scheme
from tests.models import save_model
from tests.test_formats_fp4 import PRESET, _compressor, _ct_scheme


def _weight(out=48, inp=256, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    w[::7, ::13] *= 9  # outliers: groups whose amax is far from the rest
    w[5, 32:64] = 0  # a zero group (kept as round to nearest stores it)
    return w.to(dtype)


def _scale_values(codes: torch.Tensor, nv: bool) -> torch.Tensor:
    if nv:
        return codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    return fmt.e8m0_to_float(codes.to(torch.uint8))


def _ct_errors(w, codes, nv, gscale, group):
    """compressed-tensors' fake-quantized ``w`` under scale ``codes``: per-group squared
    error [out, ng] (float32 weights, float32 arithmetic)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    args = _ct_scheme("NVFP4A16" if nv else "MXFP4A16").weights
    scale = _scale_values(codes, nv)
    dq = fake_quantize(w, scale, torch.zeros_like(scale), args,
                       global_scale=gscale if nv else None)  # fmt: skip
    return (dq.float() - w).view(w.shape[0], -1, group).square().sum(-1)


@pytest.mark.parametrize("name", ["nvfp4a16", "mxfp4"])
def test_search_picks_compressed_tensors_smallest_error(name):
    scheme = dataclasses.replace(get_scheme(name), observer="mse")
    nv = scheme.encoding == fmt.NVFP4
    w = _weight()
    ours = scheme.quantize(w, name="t")
    rtn = scheme.quantize_rtn(w, name="t")
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {
        k: (v.dtype, v.shape) for k, v in rtn.items()
    }
    c0 = rtn["weight_scale"].view(torch.uint8).int()
    gs = rtn["weight_global_scale"] if nv else None
    offsets, lo, hi = (fp4_search.NV_OFFSETS, 1, 0x7E) if nv else (fp4_search.MX_OFFSETS, 0, 252)
    live = w.view(w.shape[0], -1, scheme.group).abs().amax(-1) > 0
    errs, cands = [], []
    for k in offsets:
        c = torch.where(live, (c0 + k).clamp(lo, hi), c0)
        cands.append(c)
        errs.append(_ct_errors(w, c, nv, gs, scheme.group))
    errs, cands = torch.stack(errs), torch.stack(cands)
    pick = errs.argmin(0)  # the first smallest: round to nearest's on a tie
    want = cands.gather(0, pick[None])[0]
    got = ours["weight_scale"].view(torch.uint8).int()
    assert torch.equal(got, want)
    assert int((got != c0).sum()) > (0.2 if nv else 0.03) * got.numel()  # scales moved
    # the bytes compressed-tensors writes for those scales
    sd = {"weight": w, "weight_scale": _scale_values(got, nv)}
    if nv:
        sd["weight_global_scale"] = gs
    ct = _compressor(PRESET[name]).compress(sd, _ct_scheme(PRESET[name]))
    assert torch.equal(ct["weight_packed"], ours["weight_packed"])
    # never above round to nearest in any group, and below it overall
    e_rtn = (scheme.dequantize(rtn) - w).view(*live.shape, -1).square().sum(-1)
    e_mse = (scheme.dequantize(ours) - w).view(*live.shape, -1).square().sum(-1)
    assert bool((e_mse <= e_rtn).all())
    assert float(e_mse.sum()) < (0.9 if nv else 0.999) * float(e_rtn.sum())


def test_bfloat16_weights_and_the_fused_global_scale():
    """bf16 weights search on their float32 values; ``global_amax`` (a fused set's) sets
    the global scale as round to nearest's does."""
    scheme = dataclasses.replace(get_scheme("nvfp4"), observer="mse")
    w = _weight(dtype=torch.bfloat16)
    amax = w.float().abs().amax() * 2
    ours = scheme.quantize(w, global_amax=amax)
    rtn = scheme.quantize_rtn(w, global_amax=amax)
    assert torch.equal(ours["weight_global_scale"], rtn["weight_global_scale"])
    assert torch.equal(ours["input_global_scale"], rtn["input_global_scale"])
    strided = w.t().contiguous().t()  # a transposed view: the same parts
    got = scheme.quantize(strided, global_amax=amax)
    assert all(torch.equal(got[k], ours[k]) for k in ours)
    wf = w.float()
    assert float((scheme.dequantize(ours) - wf).square().sum()) < float(
        (scheme.dequantize(rtn) - wf).square().sum()
    )


def test_gram_scores_the_output_error():
    """With ``gram`` (each group's block of X^T X) the pick minimises ``d^T G d``: the
    output error over the tokens, lower than the plain search's on them."""
    scheme = dataclasses.replace(get_scheme("nvfp4a16"), observer="mse")
    w = _weight()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, w.shape[1], generator=g) * torch.exp(torch.randn(w.shape[1], generator=g))
    H = x.t() @ x / x.shape[0]
    blocks = fp4_search.local_blocks(H, scheme.group)
    assert torch.equal(blocks[3], H[48:64, 48:64])
    weighted = fp4_search.quantize(scheme, w, gram=blocks)
    plain = fp4_search.quantize(scheme, w)

    def out_err(parts):
        return float((x @ (scheme.dequantize(parts) - w).t()).square().sum())

    assert out_err(weighted) < out_err(plain) < out_err(scheme.quantize_rtn(w))


def test_recipe_option_and_cli(tmp_path):
    """``observer: mse`` is an FP4 scheme option (recipe) and ``--weight-observer mse``
    applies to FP4 schemes: config.json records the observer, the scales differ from
    round to nearest's; a scheme without a search (fp8) is refused with advice."""
    src = save_model("llama", tmp_path / "src")
    assert get_scheme("nvfp4a16", observer="mse").observer == "mse"
    with pytest.raises(ConfigError, match="minmax or mse"):
        get_scheme("nvfp4a16", observer="max")
    outs = {}
    for obs in ("minmax", "mse"):
        out = tmp_path / obs
        assert main(["quantize", str(src), str(out), "--scheme", "nvfp4a16",
                     "--weight-observer", obs, "--no-progress"]) == 0  # fmt: skip
        outs[obs] = load_file(out / "model.safetensors")
        cfg = json.loads((out / "config.json").read_text())
        group = next(iter(cfg["quantization_config"]["config_groups"].values()))
        assert group["weights"]["observer"] == obs
    scales = [k for k in outs["mse"] if k.endswith("weight_scale")]
    assert scales and any(not torch.equal(outs["mse"][k].view(torch.uint8),
                                          outs["minmax"][k].view(torch.uint8))
                          for k in scales)  # fmt: skip
    rc = main(["quantize", str(src), str(tmp_path / "fp8"), "--scheme", "fp8",
               "--weight-observer", "mse"])  # fmt: skip
    assert rc == 2

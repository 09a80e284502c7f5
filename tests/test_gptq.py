"""GPTQ (k3convert.calibrate.gptq) against llm-compressor 0.14.0.1's own implementation.

Oracle: ``llmcompressor/modifiers/gptq/gptq_quantize.py::quantize_weight`` and its
``helpers.py`` (Hessian accumulation, dampening, Cholesky), installed with
``pip install --no-deps llmcompressor==0.14.0.1``. ``llmcompressor/__init__.py`` cannot
run here (it needs accelerate and pins other versions), so the two files are executed
from their installed paths under empty stand-in packages ``llmcompressor``,
``llmcompressor.modifiers`` and ``llmcompressor.modifiers.gptq`` (the only shim: the
files import nothing else of llmcompressor). Their scales and zero points are what
llm-compressor's min-max weight observer hands ``quantize_weight``: compressed-tensors'
``calculate_qparams`` on the per-group min / max of the original weight.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
import types
from functools import cache
from pathlib import Path

import pytest
import torch

from k3convert.calibrate.gptq import (
    CrossAccumulator,
    GPTQFallbackWarning,
    HessianAccumulator,
    NonFiniteHessianError,
    fp_target_weight,
    gptq_quantize,
)
from k3convert.errors import ConfigError, NonFiniteError
from k3convert.formats.intn import unpack_int32
from k3convert.quant.schemes import NonFiniteWeightError, WeightRangeError, get_scheme
from tests.moonshot_oracle import temporary_modules

OUT, IN = 128, 384


@cache
def llmc():
    """(gptq_quantize module, helpers module) of the installed llm-compressor."""
    spec = importlib.util.find_spec("llmcompressor")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the oracle needs: pip install --no-deps llmcompressor==0.14.0.1")
    root = Path(next(iter(spec.submodule_search_locations))) / "modifiers" / "gptq"
    stand_ins = {}
    for n in ("llmcompressor", "llmcompressor.modifiers", "llmcompressor.modifiers.gptq"):
        m = types.ModuleType(n)
        m.__path__ = []
        stand_ins[n] = m
    names = [f"llmcompressor.modifiers.gptq.{f}" for f in ("helpers", "gq")]
    loaded = []
    with temporary_modules(stand_ins, also=names):
        for mod, file in (("helpers", "helpers.py"), ("gq", "gptq_quantize.py")):
            full = f"llmcompressor.modifiers.gptq.{mod}"
            if mod == "gq":  # gptq_quantize imports the helpers under their real name
                sys.modules["llmcompressor.modifiers.gptq.helpers"] = loaded[0]
            s = importlib.util.spec_from_file_location(full, root / file)
            m = importlib.util.module_from_spec(s)
            sys.modules[full] = m
            s.loader.exec_module(m)
            loaded.append(m)
    return loaded[1], loaded[0]


def correlated_inputs(n: int, dim: int, seed: int, noise_seed: int | None = None):
    """[n, dim] inputs with strongly correlated, unequally scaled channels; the mixing
    comes from ``seed``, the samples from ``noise_seed`` (default: ``seed`` too)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / math.sqrt(dim)
    mix += torch.eye(dim) * 0.3
    scale = torch.exp(torch.randn(dim, generator=g) * 0.7)
    gz = torch.Generator().manual_seed(seed if noise_seed is None else noise_seed)
    z = torch.randn(n, dim, generator=gz)
    return (z @ mix) * scale


@cache
def problem(out: int = OUT, inp: int = IN, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(out, inp, generator=g) * 0.02
    acc = HessianAccumulator(inp, name="test")
    x = correlated_inputs(2048, inp, seed)
    for b in x.split(512):
        acc.add(b.view(4, 128, inp))
    return w, acc.hessian()


def ct_args(scheme, act_order: bool):
    from compressed_tensors.quantization import QuantizationArgs

    a = scheme.weight_args()
    kw = {
        "num_bits": a["num_bits"],
        "type": a["type"],
        "symmetric": a["symmetric"],
        "strategy": a["strategy"],
        "group_size": a["group_size"],
        "actorder": "weight" if act_order else None,
    }
    if a["type"] == "int":
        kw["scale_dtype"] = scheme.sdtype
    if a["strategy"] == "block":
        kw["block_structure"] = a["block_structure"]
    return QuantizationArgs(**kw)


def observer_qparams(w: torch.Tensor, scheme, args):
    """llm-compressor's min-max weight observer: calculate_qparams on group min / max."""
    from compressed_tensors.quantization.utils import calculate_qparams

    out, inp = w.shape
    a = scheme.weight_args()
    if a["strategy"] == "block":
        b0, b1 = a["block_structure"]
        v = w.view(out // b0, b0, inp // b1, b1).permute(0, 2, 1, 3).flatten(2)
    elif a["strategy"] == "tensor":
        v = w.reshape(1, 1, -1)
    else:
        ng = 1 if a["strategy"] == "channel" else inp // a["group_size"]
        v = w.view(out, ng, inp // ng)
    return calculate_qparams(v.amin(-1), v.amax(-1), args)


def scheme_zero_points(scheme, parts) -> torch.Tensor:
    """The scheme's zero points [out, groups] int8 (unpacked when packed)."""
    zp = parts["weight_zero_point"]
    if scheme.packed:
        zp = unpack_int32(zp, scheme.num_bits, tuple(parts["weight_scale"].shape), 0)
    return zp.to(torch.int8)


def oracle(w, H, scheme, act_order, block_size=128, dampening=0.01, zero_points=None):
    """llm-compressor's GPTQ result (dequantized), its scales and zero points, and whether
    it fell back to RTN. zero_points: use these instead of the observer's (see
    test_matches_llm_compressor)."""
    gq, _ = llmc()
    args = ct_args(scheme, act_order)
    scale, zp = observer_qparams(w, scheme, args)
    if zero_points is not None:
        zp = zero_points
    # calculate_qparams rounds to scale_dtype but hands the result back in the weight's
    # dtype; a model loaded in the scale dtype (bf16, the usual case) has its scales in
    # it, so that fake_quantize dequantizes in it, as every loader of the parts does
    scale = scale.to(getattr(scheme, "sdtype", torch.float32))
    deq, _, fallback = gq.quantize_weight(
        w.clone()[None], H.clone()[None], scale[None], zp[None], None, args, block_size, dampening
    )
    return deq[0], scale, zp, bool(fallback[0])


def steps(a: torch.Tensor, b: torch.Tensor, w_shape, scheme, parts) -> torch.Tensor:
    """|a - b| in quantization steps (the element's scale)."""
    out, inp = w_shape
    s = parts["weight_scale"].float()
    if s.numel() == 1:
        s = s.reshape(1, 1).expand(out, inp)
    elif s.shape == (out, 1):
        s = s.expand(out, inp)
    elif getattr(scheme, "strategy", "") == "block":
        b0, b1 = scheme.block
        s = s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]
    else:
        s = s.repeat_interleave(inp // s.shape[1], 1)
    return (a - b).abs() / s


CASES = [
    ("int4-g128", False),
    ("int4-g128", True),
    ("int4-g32", False),
    ("int4-g32", True),
    ("int4-g128-asym", False),
    ("int4-g128-asym", True),
    ("int4-g32-asym", True),
    ("int8-channel", False),
    ("w8a8", True),  # int-quantized (unpacked int8) storage
    ("int3-g64-asym", True),
    ("int2-g128", False),
    ("fp8-channel", True),
    ("fp8-tensor", False),
    ("fp8-block-w", True),
]


@pytest.mark.parametrize("scheme_name,act_order", CASES)
def test_matches_llm_compressor(scheme_name, act_order):
    # 64 x 128 blocks: whole blocks of the 128 x 384 weight, several along each dim
    opts = {"block": (64, 128)} if scheme_name == "fp8-block-w" else {}
    scheme = get_scheme(scheme_name, **opts)
    w, H = problem()
    ours = gptq_quantize(w, H, scheme, act_order=act_order, name="layer.w")
    # exactly the parts the scheme stores
    want = {n: (d, tuple(s)) for n, d, s in scheme.parts(tuple(w.shape))}
    assert {n: (t.dtype, tuple(t.shape)) for n, t in ours.items()} == want
    deq_ref, scale_ref, zp_ref, fallback = oracle(w, H, scheme, act_order)
    if not scheme.weight_args()["symmetric"]:
        # asymmetric zero points: calculate_qparams' (from the float32 scale before it is
        # rounded to the scale dtype), every one
        zp = scheme_zero_points(scheme, ours)
        assert torch.equal(zp.int(), zp_ref.int())
    assert not fallback
    # the scales GPTQ rounds against are llm-compressor's observer's
    assert torch.equal(ours["weight_scale"].float().reshape(scale_ref.shape), scale_ref.float())
    # every part but the values is the scheme's own (scales, zero points, shape)
    rtn_parts = scheme.quantize(w)
    values = "weight_packed" if "weight_packed" in rtn_parts else "weight"
    assert all(torch.equal(ours[k], rtn_parts[k]) for k in rtn_parts if k != values)
    deq = scheme.dequantize(ours)
    assert not torch.equal(deq, scheme.dequantize(rtn_parts))  # GPTQ moved values
    diff = steps(deq, deq_ref, w.shape, scheme, ours)
    n_off = int((diff > 0).sum())
    # float summation order is the same as llm-compressor's: bit for bit
    assert n_off == 0, f"{n_off} values differ, max {float(diff.max()):.3g} steps"


def test_fp8_ue8m0_blocks_match_on_the_schemes_scales():
    """Power-of-two block scales (compressed-tensors has no observer for them): the
    oracle rounds against our scheme's scales; the GPTQ sweep must agree bit for bit."""
    gq, _ = llmc()
    scheme = get_scheme("fp8-block-ue8m0", block=(64, 128))
    w, H = problem()
    ours = gptq_quantize(w, H, scheme, act_order=True)
    scale = scheme.quantize(w)["weight_scale"]
    assert torch.equal(ours["weight_scale"], scale)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    args = ct_args(scheme, True)
    zp = torch.zeros_like(scale)
    ref, _, _ = gq.quantize_weight(
        w.clone()[None], H.clone()[None], scale[None], zp[None], None, args, 128, 0.01
    )
    assert torch.equal(scheme.dequantize(ours), ref[0])


def fp4_oracle(w, H, scheme, parts, act_order):
    """llm-compressor's GPTQ of ``w`` rounded against the scales in ``parts`` (an FP4
    scheme's: NVFP4 e4m3 scales under its global scale, compressed-tensors'
    ``tensor_group``; MXFP4 powers of two, ``group`` of 32 float4 values), dequantized."""
    from compressed_tensors.quantization import QuantizationArgs

    from k3convert import formats as fmt

    gq, _ = llmc()
    nv = scheme.encoding == fmt.NVFP4
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True,
                            strategy="tensor_group" if nv else "group",
                            group_size=scheme.group,
                            actorder="weight" if act_order else None)  # fmt: skip
    if nv:
        scale, g = parts["weight_scale"].float(), parts["weight_global_scale"].float()[None]
    else:
        scale, g = fmt.e8m0_to_float(parts["weight_scale"]), None
    deq, _, fallback = gq.quantize_weight(w.clone()[None], H.clone()[None], scale[None],
                                          torch.zeros_like(scale)[None], g, args, 128,
                                          0.01)  # fmt: skip
    assert not bool(fallback[0])
    return deq[0]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("scheme_name", ["nvfp4a16", "nvfp4", "mxfp4"])
def test_fp4_matches_llm_compressor(scheme_name, act_order):
    """GPTQ for FP4 rounds each column to E2M1 against the scheme's round-to-nearest
    scales (NVFP4: per-16 e4m3 under the global scale; MXFP4: per-32 E8M0): bit for bit
    llm-compressor's ``quantize_weight`` given the same scales."""
    scheme = get_scheme(scheme_name)
    w, H = problem()
    ours = gptq_quantize(w, H, scheme, act_order=act_order, name="layer.w")
    want = {n: (d, tuple(s)) for n, d, s in scheme.parts(tuple(w.shape))}
    assert {n: (t.dtype, tuple(t.shape)) for n, t in ours.items()} == want
    rtn = scheme.quantize(w)
    assert all(torch.equal(ours[k], rtn[k]) for k in rtn if k != "weight_packed")
    deq = scheme.dequantize(ours)
    assert not torch.equal(deq, scheme.dequantize(rtn))  # GPTQ moved values
    ref = fp4_oracle(w, H, scheme, ours, act_order)
    assert torch.equal(deq, ref.float()), int((deq != ref).sum())


def test_fp4_global_scale_is_the_fused_sets():
    """NVFP4 under GPTQ takes the global scale of ``global_amax`` (the fused q / k / v or
    gate / up set's largest |value|), as round to nearest does with it; the sweep is
    still llm-compressor's against those scales."""
    scheme = get_scheme("nvfp4a16")
    w, H = problem()
    amax = w.abs().amax() * 3
    ours = gptq_quantize(w, H, scheme, act_order=True, global_amax=amax)
    rtn = scheme.quantize(w, global_amax=amax)
    assert torch.equal(ours["weight_global_scale"], rtn["weight_global_scale"])
    assert not torch.equal(ours["weight_global_scale"], scheme.quantize(w)["weight_global_scale"])
    assert torch.equal(ours["weight_scale"], rtn["weight_scale"])
    assert torch.equal(scheme.dequantize(ours), fp4_oracle(w, H, scheme, ours, True).float())


@pytest.mark.parametrize("scheme_name", ["nvfp4a16", "mxfp4"])
def test_fp4_mse_keeps_the_best_of_three_scale_choices(scheme_name):
    """With the ``mse`` observer GPTQ sweeps on three sets of scales (each group's searched
    on its block of H, round to nearest's, searched on its squared error) and keeps, row
    by row, the sweep with the smallest GPTQ loss: every row is one set's sweep of that
    row, bit for bit llm-compressor's on those scales, and the whole ends below every
    single set's error on the calibration inputs (and below plain GPTQ's)."""
    import dataclasses

    from k3convert.quant import fp4_search

    minmax = get_scheme(scheme_name)
    mse = dataclasses.replace(minmax, observer="mse")
    w, H = problem()
    ours = gptq_quantize(w, H, mse, act_order=True)
    base = minmax.quantize(w)
    scales = [fp4_search.quantize(mse, w, gram=fp4_search.local_blocks(H, mse.group))[
                  "weight_scale"],
              base["weight_scale"],
              fp4_search.quantize(mse, w)["weight_scale"]]  # fmt: skip
    refs = [fp4_oracle(w, H, mse, {**base, "weight_scale": sc}, True).float() for sc in scales]

    def h_err(dq):  # per row
        d = dq - w
        return ((d @ H) * d).sum(-1)

    deq = mse.dequantize(ours)
    used = set()
    for r in range(w.shape[0]):
        c = next(c for c, sc in enumerate(scales) if torch.equal(ours["weight_scale"][r],
                                                                 sc[r]))  # fmt: skip
        used.add(c)
        assert torch.equal(deq[r], refs[c][r]), r
    assert len(used) >= 2  # rows take different sets
    total = float(h_err(deq).sum())
    singles = [float(h_err(ref).sum()) for ref in refs]
    assert total < min(singles), (total, singles)
    assert total < float(
        h_err(minmax.dequantize(gptq_quantize(w, H, minmax, act_order=True))).sum()
    )


def test_partial_edge_blocks_and_groups():
    """Shapes that no block tiles: the parts are the scheme's, and GPTQ still wins."""
    w, H = problem()
    w, H = w[:100, :320], H[:320, :320]
    x = correlated_inputs(1024, IN, seed=0, noise_seed=7)[:, :320]
    for scheme in (get_scheme("fp8-block-w", block=(64, 128)), get_scheme("int4-g64")):
        parts = gptq_quantize(w, H, scheme, block_size=100, name="edge")
        want = {n: (d, tuple(sh)) for n, d, sh in scheme.parts(tuple(w.shape))}
        assert {n: (t.dtype, tuple(t.shape)) for n, t in parts.items()} == want
        rtn = _out_err(scheme.dequantize(scheme.quantize(w)), w, x)
        assert _out_err(scheme.dequantize(parts), w, x) / rtn < 0.9


def test_block_size_and_dead_columns_match():
    scheme = get_scheme("int4-g64-asym")
    w, H = problem()
    H = H.clone()
    dead = torch.tensor([3, 100, 101, 300, 383])
    H[dead, :] = 0
    H[:, dead] = 0
    for act_order in (False, True):
        ours = gptq_quantize(w, H, scheme, block_size=96, dampening=0.05, act_order=act_order)
        zp = scheme_zero_points(scheme, ours)  # see test_matches_llm_compressor
        ref, *_ = oracle(w, H, scheme, act_order, 96, 0.05, zero_points=zp)
        deq = scheme.dequantize(ours)
        assert torch.equal(deq, ref)
        assert not bool(deq[:, dead].any())  # dead columns quantize to zero


def test_bfloat16_weight_matches():
    scheme = get_scheme("int4-g128")
    w, H = problem()
    wb = w.to(torch.bfloat16)
    ours = gptq_quantize(wb, H, scheme, act_order=True)
    ref, *_ = oracle(wb.float(), H, scheme, True)
    assert torch.equal(scheme.dequantize(ours), ref)


def test_not_positive_definite_falls_back_to_rtn():
    scheme = get_scheme("int4-g128")
    w, _ = problem()
    H = -torch.eye(IN)
    with pytest.warns(GPTQFallbackWarning, match="layer.w"):
        ours = gptq_quantize(w, H, scheme, name="layer.w")
    ref, _, _, fallback = oracle(w, H, scheme, False)
    assert fallback
    rtn = scheme.quantize(w)
    assert all(torch.equal(ours[k], rtn[k]) for k in rtn)
    assert torch.equal(scheme.dequantize(ours), ref)


def _out_err(w_hat, w, x):
    return float(torch.linalg.norm(x @ (w_hat - w).t()))


@pytest.mark.parametrize("scheme_name", ["int4-g128", "int4-g128-asym", "int3-g128"])
def test_output_error_below_rtn(scheme_name):
    scheme = get_scheme(scheme_name)
    w, H = problem()
    held_out = correlated_inputs(1024, IN, seed=0, noise_seed=99)  # new samples
    rtn = _out_err(scheme.dequantize(scheme.quantize(w)), w, held_out)
    for act_order in (False, True):
        g = _out_err(
            scheme.dequantize(gptq_quantize(w, H, scheme, act_order=act_order)), w, held_out
        )
        assert g / rtn < 0.9, (act_order, g / rtn)


# -- the full-precision target (gptq_fp_target) ----------------------------------------
def _fp_problem(inp: int = 96, n: int = 1536):
    """A Linear's inputs X in the model being calibrated and Xf in the full-precision
    model: Xf = X plus a drift that is partly a linear function of X (what upstream
    quantization error looks like) and partly independent noise."""
    g = torch.Generator().manual_seed(7)
    x = correlated_inputs(n, inp, seed=5)
    drift = (x @ (torch.randn(inp, inp, generator=g) * 0.08 / math.sqrt(inp))
             + 0.05 * x.std() * torch.randn(n, inp, generator=g))  # fmt: skip
    w = torch.randn(64, inp, generator=g) * 0.02
    return w, x, x + drift


def test_cross_accumulator_matches_direct_and_excludes_padding():
    _, x, xf = _fp_problem(inp=32, n=60)
    x, xf = x.view(3, 20, 32), xf.view(3, 20, 32)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[0, 15:] = False
    mask[2, :4] = False
    a = CrossAccumulator(32)
    x2, xf2 = x.clone(), xf.clone()
    x2[~mask], xf2[~mask] = 1e3, -1e3  # padding content must not matter
    assert a.add(x2[:2], xf2[:2], mask[:2]) + a.add(x2[2:], xf2[2:], mask[2:]) == 51
    r, rf = x[mask].double(), xf[mask].double()
    torch.testing.assert_close(a.cross(), (2 / 51 * (rf - r).t() @ r).float(),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    with pytest.raises(ConfigError, match="same shape"):
        a.add(x, xf[:, :5])


def test_fp_target_weight_is_the_least_squares_solution():
    """Undampened, W + W D H^-1 is argmin_V ||W Xf - V X|| (numpy's lstsq on the
    normal equations' own problem, in float64); dampened it is that of the dampened H."""
    w, x, xf = _fp_problem()
    H, D = HessianAccumulator(96), CrossAccumulator(96)
    H.add(x)
    D.add(x, xf)
    wt = fp_target_weight(w, H.hessian(), D.cross(), dampening=0.0)
    ls = torch.linalg.lstsq(x.double(), (xf.double() @ w.double().t())).solution.t()
    rel = float(torch.linalg.norm(wt.double() - ls) / torch.linalg.norm(ls))
    assert rel < 2e-3, rel  # float32 H and D; a wrong sign or transpose is O(0.1)
    assert float(torch.linalg.norm(wt - w) / torch.linalg.norm(w)) > 0.05  # it moved
    half = fp_target_weight(w, H.hessian(), D.cross(), strength=0.5, dampening=0.0)
    torch.testing.assert_close(half, w + 0.5 * (wt - w), rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigError, match=r"strength must be a number in \[0, 1\]"):
        fp_target_weight(w, H.hessian(), D.cross(), strength=1.5)
    # no drift: the weight itself (the plain GPTQ problem)
    same = CrossAccumulator(96)
    same.add(x, x)
    assert torch.equal(fp_target_weight(w, H.hessian(), same.cross()), w)


@pytest.mark.parametrize("act_order", [False, True])
def test_fp_target_lowers_the_error_against_full_precision_outputs(act_order):
    """GPTQ swept on the target weight (the same H, w's scales) has a smaller
    ||W Xf - Q X|| than GPTQ on W, on held-out samples of the same drift; and a larger
    ||W X - Q X|| (it no longer approximates W's own outputs on X)."""
    scheme = get_scheme("int4-g32")
    w, x, xf = _fp_problem()
    fit, held = slice(0, 1024), slice(1024, None)
    H, D = HessianAccumulator(96), CrossAccumulator(96)
    H.add(x[fit])
    D.add(x[fit], xf[fit])
    plain = scheme.dequantize(gptq_quantize(w, H.hessian(), scheme, act_order=act_order))
    wt = fp_target_weight(w, H.hessian(), D.cross())
    parts = gptq_quantize(w, H.hessian(), scheme, act_order=act_order, target=wt)
    assert torch.equal(parts["weight_scale"], scheme.quantize(w)["weight_scale"])  # w's grid
    fpt = scheme.dequantize(parts)

    def err(q, target_x):
        return float(torch.linalg.norm(target_x[held] @ w.t() - x[held] @ q.float().t()))

    assert err(fpt, xf) < 0.8 * err(plain, xf), (err(fpt, xf), err(plain, xf))
    assert err(fpt, x) > err(plain, x)


# -- Hessian accumulator ---------------------------------------------------------------
def test_hessian_matches_llm_compressor_and_weights_tokens():
    _, helpers = llmc()
    inp = 64
    lin = torch.nn.Linear(inp, 8)
    x = correlated_inputs(3 * 2 * 16, inp, seed=3).view(3, 2, 16, inp)
    ref = torch.zeros(inp, inp)
    n = torch.zeros(())
    acc = HessianAccumulator(inp)
    for b in x:
        ref, n = helpers.accumulate_hessian(b, lin, ref, n)
        acc.add(b)
    # llm-compressor divides by the number of sequences, we by tokens (16 per sequence)
    torch.testing.assert_close(acc.hessian() * acc.tokens, ref, rtol=1e-5, atol=1e-4)
    assert acc.tokens == 96
    flat = x.reshape(-1, inp).double()
    torch.testing.assert_close(
        acc.hessian(), (2 * flat.t() @ flat / 96).float(), rtol=1e-5, atol=1e-4
    )


def test_hessian_mask_excludes_padding():
    inp = 32
    x = torch.randn(2, 10, inp)
    mask = torch.ones(2, 10, dtype=torch.int64)
    mask[0, 7:] = 0
    mask[1, :2] = 0
    a = HessianAccumulator(inp)
    assert a.add(x, mask) == 15
    x2 = x.clone()
    x2[mask == 0] = 1e3  # padding content must not matter
    b = HessianAccumulator(inp)
    b.add(x2, mask.bool())
    real = x[mask.bool()]
    c = HessianAccumulator(inp)
    c.add(real[:5])
    c.add(real[5:])  # batches of different lengths weigh per token
    assert torch.equal(a.hessian(), b.hessian())
    torch.testing.assert_close(a.hessian(), c.hessian(), rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_named():
    scheme = get_scheme("int4-g128")
    w, H = problem()
    wn = w.clone()
    wn[3, 4] = float("nan")
    with pytest.raises(NonFiniteWeightError, match=r"'blk\.0\.q'"):
        gptq_quantize(wn, H, scheme, name="blk.0.q")
    Hn = H.clone()
    Hn[0, 0] = float("inf")
    with pytest.raises(NonFiniteHessianError, match=r"'blk\.0\.q'.*Hessian"):
        gptq_quantize(w, Hn, scheme, name="blk.0.q")
    acc = HessianAccumulator(IN, name="blk.0.k")
    with pytest.raises(NonFiniteHessianError, match=r"'blk\.0\.k'"):
        acc.add(torch.full((2, IN), float("nan")))
    with pytest.raises(ConfigError, match="no calibration tokens"):
        acc.hessian()
    with pytest.raises(ConfigError, match=rf"\[{IN}, {IN}\]"):
        gptq_quantize(w, H[:10, :10], scheme)
    with pytest.raises(ConfigError, match="not supported"):
        gptq_quantize(w, H, "int4-g128")
    with pytest.raises(ConfigError, match="block_size"):
        gptq_quantize(w, H, scheme, block_size=0)
    with pytest.raises(ConfigError, match="dampening"):
        gptq_quantize(w, H, scheme, dampening=float("nan"))
    wb = w.clone()
    # int: the scheme's overflow-fallback range is refused, not rounded in a wrong range
    wb[0, :2] = torch.tensor([3.3e38, 1.7e38])
    with pytest.raises(WeightRangeError, match=r"'big'"):
        gptq_quantize(wb, H, scheme, name="big")
    fp8 = get_scheme("fp8-channel")
    assert torch.isfinite(fp8.dequantize(gptq_quantize(wb, H, fp8))).all()
    with pytest.raises(NonFiniteError, match=r"'big' overflowed"):  # errors / Hinv[i, i]
        gptq_quantize(wb, H * 1e30, fp8, name="big")
    with pytest.raises(ConfigError, match="group size"):
        gptq_quantize(w[:, :380], H[:380, :380], scheme)


@pytest.mark.skipif(not __import__("os").environ.get("K3_GPTQ_TIMING"), reason="timing")
def test_time_4096():  # K3_GPTQ_TIMING=1 pytest -q tests/test_gptq.py -k time -s
    w = torch.randn(4096, 4096) * 0.02
    x = torch.randn(4096, 4096)
    H = 2 * x.t() @ x / 4096
    for name in ("int4-g128", "int8-channel", "fp8-channel"):
        t = time.perf_counter()
        gptq_quantize(w, H, get_scheme(name), act_order=True)
        print(f"{name}: {time.perf_counter() - t:.2f} s per [4096, 4096]")

"""GPTQ (Frantar et al., https://arxiv.org/abs/2210.17323) as a library function.

"A scheme says how numbers are stored, an algorithm chooses them": :func:`gptq_quantize`
returns exactly the parts ``scheme.quantize(w)`` returns (same names, dtypes, shapes and
scales), only the stored values (``weight_packed`` / ``weight``) are chosen by GPTQ
instead of round-to-nearest. The arithmetic is llm-compressor 0.14's
(``modifiers/gptq/gptq_quantize.py::quantize_weight`` with its eager block update, and
``helpers.py``), so for the same weight and Hessian the dequantized result is bit for bit
the one llm-compressor computes (tests/test_gptq.py checks it):

- scales and zero points are the scheme's round-to-nearest ones, taken once on the
  original weight: llm-compressor 0.14's weight observer runs on the module weight
  before ``quantize_weight``, which only rounds against those fixed parameters (older
  GPTQ code re-observed each group when the sweep reached it; 0.14 does not). The
  observer is the scheme's: ``minmax`` (the full range), or ``mse``
  (:mod:`k3convert.quant.mse_observer`: each group's range searched, as llm-compressor's
  ``observer="mse"``), so GPTQ rounds against the searched scales;
- ``act_order=True`` is recorded in config.json as ``actorder: static``
  (:func:`k3convert.quant.writer.mark_actorder`);
- dampening: dead columns (``H[j, j] == 0``) get ``H[j, j] = 1`` and a zero weight
  column, then ``dampening * mean(diag H)`` is added to the diagonal; ``H^-1`` comes from
  a Cholesky factorisation and is used as its upper Cholesky factor. A Hessian that is
  still not positive definite falls back to round-to-nearest (a warning names the
  tensor), as llm-compressor does;
- each column is rounded as compressed-tensors' ``fake_quantize`` does
  (``round(clamp(w / scale + zp))``, dequantized ``(q - zp) * scale`` in the scale's
  dtype), its error divided by ``Hinv[i, i]`` is pushed onto the rest of its block, and
  each block's errors onto the remaining columns with one matrix product;
- ``act_order=True`` is compressed-tensors' ``actorder: weight`` ("static"): columns are
  swept in descending ``diag(H)`` order while every column keeps its own group's scale,
  so the stored format is unchanged. The older ``actorder: group`` layout
  (``weight_g_idx``, groups formed in activation order) is not produced: compressed-
  tensors 0.20 refuses ``actorder: group`` in a config and its decompressor has no
  g_idx, so such a checkpoint would not load.

Supported schemes: :class:`IntScheme` (2..8 bits, channel or group, symmetric or not,
packed or int8), :class:`FP8Scheme` with strategy ``tensor``, ``channel`` or
``block`` (any block shape, float32 or ue8m0 scales) and :class:`FP4Scheme` (NVFP4's
per-16 e4m3 scales under a per-tensor global scale, with or without activations;
MXFP4's per-32 E8M0 exponents): each column is rounded to E2M1 against its group's
fixed float32 scale (``e4m3 / global``, or ``2 ** (e - 127)``: what every loader
multiplies by) as the scheme rounds. Its scales are the scheme's: the largest |value|
per group (``minmax``, as llm-compressor's GPTQ for NVFP4 takes them), or with the
``mse`` observer three sets of scales swept at once (each group's scale searched for its
output error under its diagonal block of this Hessian, Model Optimizer's local-Hessian
scale search; round to nearest's; each group's scale searched for its squared error:
:mod:`k3convert.quant.fp4_search`), each row keeping the set with the smallest GPTQ
loss; a row's sweep is still llm-compressor's on its scales. NVFP4's global scale is the fused set's
(``global_amax``) so q / k / v and gate / up keep one, as a serving engine fuses them.

:class:`HessianAccumulator` builds ``H = 2 / n * sum(x x^T)`` of one Linear's inputs in
float32 over streamed batches, n counting tokens (padding excluded by a mask).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from .. import formats as fmt
from ..errors import ConfigError, NonFiniteError, short_repr
from ..formats import FP8_MAX
from ..formats.fp4 import E2M1, fp4_codes_short, pack_fp4
from ..formats.intn import pack_int32, unpack_int32
from ..quant import fp4_search
from ..quant.schemes import (
    FP4Scheme,
    FP8Scheme,
    IntScheme,
    NonFiniteWeightError,
    Scheme,
    WeightRangeError,
)

__all__ = [
    "CrossAccumulator",
    "GPTQFallbackWarning",
    "HessianAccumulator",
    "NonFiniteHessianError",
    "fp_target_weight",
    "gptq_quantize",
]


class NonFiniteHessianError(NonFiniteError):
    """A Hessian (or the calibration inputs it is built from) holds NaN / Inf."""


class GPTQFallbackWarning(UserWarning):
    """A Hessian stayed non positive definite after dampening: that tensor was rounded to
    nearest instead (the scheme's ordinary quantization)."""


def _not_finite_hessian(name: str, what: str, t: torch.Tensor) -> NonFiniteHessianError:
    bad = int((~torch.isfinite(t)).sum())
    return NonFiniteHessianError(
        f"GPTQ for '{name}': the {what} holds {bad} NaN/Inf value(s); the calibration "
        f"inputs of this Linear overflowed or are corrupt - check the calibration data and "
        f"the layers before it (run them in float32)."
    )


# -- Hessian -------------------------------------------------------------------------
def _zero_sum(acc) -> torch.Tensor:
    """An accumulator's zeroed float32 [in, in] sum (``in_features`` checked)."""
    n = acc.in_features
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ConfigError(
            f"{type(acc).__name__} for '{acc.name}': in_features must be a positive "
            f"integer, got {short_repr(n)}."
        )
    return torch.zeros(n, n, dtype=torch.float32)


def _token_rows(acc, x, mask, what: str, *, check_finite: bool = True):
    """``x [..., in]`` as float32 rows [tokens, in] of the real tokens (``mask`` 0 /
    False: padding, dropped), checked against the accumulator ``acc``'s width; None when
    no token is left."""
    who = f"{type(acc).__name__} for '{acc.name}'"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 1:
        raise ConfigError(
            f"{who}: inputs must be a float tensor [..., {acc.in_features}], got {short_repr(x)}."
        )
    if x.shape[-1] != acc.in_features:
        raise ConfigError(
            f"{who}: inputs have {x.shape[-1]} features (shape {tuple(x.shape)}), the "
            f"Linear takes {acc.in_features}."
        )
    rows = x.reshape(-1, acc.in_features)
    if mask is not None:
        if tuple(mask.shape) != tuple(x.shape[:-1]):
            raise ConfigError(
                f"{who}: mask shape {tuple(mask.shape)} does not match the inputs' token "
                f"dims {tuple(x.shape[:-1])}."
            )
        rows = rows[mask.reshape(-1).to(torch.bool)]
    if not rows.shape[0]:
        return None
    rows = rows.to(torch.float32)
    if check_finite and not bool(torch.isfinite(rows).all()):
        raise _not_finite_hessian(acc.name, what, rows)
    return rows


@dataclass
class _SumAccumulator:
    """A float32 [in, in] sum over the real tokens fed to one Linear (``tokens`` of them),
    read back as its mean (:meth:`_mean`)."""

    in_features: int
    name: str = "linear"
    tokens: int = field(default=0, init=False)
    _sum: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        self._sum = _zero_sum(self)

    def _mean(self, what: str, hint: str) -> torch.Tensor:
        """``sum / tokens`` (a new tensor), checked finite; an error before any token."""
        if not self.tokens:
            raise ConfigError(
                f"{type(self).__name__} for '{self.name}': no calibration tokens reached "
                f"this Linear (all padding, or no batch added){hint}"
            )
        m = self._sum / self.tokens
        if not bool(torch.isfinite(m).all()):
            raise _not_finite_hessian(self.name, what, m)
        return m


@dataclass
class HessianAccumulator(_SumAccumulator):
    """``H = 2 / n * sum_t x_t x_t^T`` over the n tokens fed to one Linear, float32 [in, in].

    ``add(x, mask)`` takes a batch ``x [..., in]`` (any float dtype) and optionally a mask
    of shape ``x.shape[:-1]`` (bool or 0/1 ints, e.g. an attention mask): tokens where it
    is 0 / False are padding and excluded. Every real token weighs the same whatever
    batch it came in. Memory: one [in, in] float32 sum.
    """

    def add(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> int:
        """Accumulate one batch; returns the number of tokens it added."""
        rows = _token_rows(self, x, mask, "calibration input")
        if rows is None:
            return 0
        rows = rows * math.sqrt(2.0)
        self._sum.addmm_(rows.t(), rows)
        self.tokens += rows.shape[0]
        return rows.shape[0]

    def hessian(self) -> torch.Tensor:
        """``2 / n * sum(x x^T)`` (a new tensor); an error before any token was added."""
        return self._mean("Hessian", "; GPTQ needs at least one.")


@dataclass
class CrossAccumulator(_SumAccumulator):
    """``D = 2 / n * sum_t (xf_t - x_t) x_t^T`` over the n tokens fed to one Linear,
    float32 [in, in]: ``x`` its input in the model being calibrated (the quantized layers
    before it), ``xf`` the same Linear's input on the same tokens in the full-precision
    model. With :class:`HessianAccumulator`'s ``H`` (same tokens, same mask) it gives
    :func:`fp_target_weight`. Memory: one [in, in] float32 sum.
    """

    def add(self, x: torch.Tensor, xf: torch.Tensor, mask: torch.Tensor | None = None) -> int:
        """Accumulate one batch (``xf`` the full-precision inputs, shaped as ``x``);
        returns the number of tokens it added."""
        if isinstance(x, torch.Tensor) and isinstance(xf, torch.Tensor) and x.shape != xf.shape:
            raise ConfigError(
                f"CrossAccumulator for '{self.name}': the inputs {tuple(x.shape)} and the "
                f"full-precision inputs {tuple(xf.shape)} must have the same shape, "
                f"[..., {self.in_features}]."
            )
        rows = _token_rows(self, x, mask, "calibration input", check_finite=False)
        frows = _token_rows(self, xf, mask, "full-precision calibration input")
        if rows is None:
            return 0
        self._sum.addmm_((frows - rows).t(), rows, alpha=2.0)
        self.tokens += rows.shape[0]
        return rows.shape[0]

    def cross(self) -> torch.Tensor:
        """``2 / n * sum((xf - x) x^T)`` (a new tensor); an error before any token."""
        return self._mean("full-precision cross term", ".")


def fp_target_weight(
    w: torch.Tensor, H: torch.Tensor, D: torch.Tensor, *, strength: float = 1.0,
    dampening: float = 0.01, name: str = "weight",
) -> torch.Tensor:  # fmt: skip
    """The weight GPTQ should approximate when its target moves towards the
    full-precision model's output (GPTAQ-style asymmetric calibration, Li et al. 2025):
    float32 ``W + strength * W D Hd^-1``.

    For inputs ``X`` (the model being calibrated) and ``Xf`` (the full-precision model,
    same tokens), and the target output ``Y = W (X + a (Xf - X))`` (``a = strength``; 0:
    GPTQ's own ``W X``, 1: the full-precision ``W Xf``),
    ``||Y - Q X||^2 = ||(W_t - Q) X||^2 + const`` with ``W_t H = Y X^T``,
    ``H = X X^T``, ``D = (Xf - X) X^T``: so GPTQ on ``W_t`` with the same ``H``
    minimises the error against ``Y``. H and D as :class:`HessianAccumulator` /
    :class:`CrossAccumulator` give them (the same scale); ``Hd`` is H dampened as
    :func:`gptq_quantize` dampens it (dead columns' diagonal set to 1,
    ``dampening * mean(diag)`` added). A dampened H that is not positive definite
    returns ``w`` unchanged (GPTQ then rounds to nearest and warns).
    """
    _check_args(w, H, None, 128, dampening, False, name)
    ok = isinstance(strength, (int, float)) and not isinstance(strength, bool)
    if not ok or not math.isfinite(strength) or not 0 <= strength <= 1:
        raise ConfigError(
            f"GPTQ for '{name}': the full-precision target strength must be a number in "
            f"[0, 1] (0: GPTQ's own target, 1: the full-precision outputs), got "
            f"{short_repr(strength)}."
        )
    inp = w.shape[-1]
    if not isinstance(D, torch.Tensor) or tuple(D.shape) != (inp, inp):
        got = tuple(D.shape) if isinstance(D, torch.Tensor) else short_repr(D)
        raise ConfigError(
            f"GPTQ for '{name}': the cross term must be [{inp}, {inp}] (the weight is "
            f"{tuple(w.shape)}), got {got}."
        )
    W = w.to(torch.float32)
    Hd = H.to(torch.float32, copy=True)
    _dampen_(Hd, dampening)
    L, info = torch.linalg.cholesky_ex(Hd, check_errors=False)
    if int(info) != 0:
        return W.clone()
    R = (W * float(strength)) @ D.to(torch.float32)  # [out, in]
    out = W + torch.cholesky_solve(R.t().contiguous(), L).t()
    if not bool(torch.isfinite(out).all()):
        raise NonFiniteError(
            f"GPTQ for '{name}': the full-precision target weight overflowed float32 (an "
            f"ill-conditioned Hessian); raise dampening or calibrate without "
            f"gptq_fp_target."
        )
    return out


# -- the per-column quantizers ---------------------------------------------------------
_MAGIC = 1.5 * 2**23  # adding it leaves no fraction bits in a float32 of magnitude < 2**22


def _round_half_even(x: torch.Tensor) -> torch.Tensor:
    """``torch.round`` (half to even) of float32 values with |x| < 2**22, in place: the
    add rounds to an integer in the current (nearest-even) mode, the subtract is exact.
    Same values as torch.round (a zero may lose its sign), several times faster on CPU,
    where torch.round of a column is not vectorized."""
    return x.add_(_MAGIC).sub_(_MAGIC)


class _IntColumns:
    """Rounds one column of an IntScheme weight against the scheme's fixed parameters."""

    def __init__(self, scheme: IntScheme, parts: dict, shape: tuple[int, int], name: str):
        out, inp = shape
        self.scheme, self.shape = scheme, shape
        scale = parts["weight_scale"]  # [out, ng] in the scale dtype
        ng = scale.shape[1]
        self.gs = inp // ng
        if scheme.packed:
            zp = parts.get("weight_zero_point")
            zp = None if zp is None else unpack_int32(zp, scheme.num_bits, (out, ng), 0)
        else:
            zp = parts.get("weight_zero_point")
        sd = scale.dtype
        # the extreme codes (q_min - zp, q_max - zp) times the scale must stay finite in
        # the scale dtype: only |w| near the float max breaks this, where the scheme
        # takes an overflow fallback whose narrower range this sweep does not reproduce
        z = torch.zeros_like(scale, dtype=torch.float32) if zp is None else zp.float()
        ends = torch.stack([float(scheme.qmin) - z, float(scheme.qmax) - z])
        if not bool(torch.isfinite(ends.to(sd) * scale).all()):
            raise WeightRangeError(
                f"GPTQ for '{name}' (scheme '{scheme.name}'): a group of this weight is "
                f"so large that its extreme codes times its scale overflow {sd}; quantize "
                f"it without calibration (round to nearest), or use scale_dtype float32."
            )
        self.scale_t = scale.t().contiguous()  # [ng, out], scale dtype
        self.scale32_t = self.scale_t.float()
        self.zp_t = None if zp is None else zp.t().float().contiguous()  # [ng, out]
        self.zp_sd_t = None if zp is None else zp.t().to(sd).contiguous()
        self.codes = torch.empty(inp, out, dtype=torch.int8)  # column-major while sweeping
        self.qmin, self.qmax = float(scheme.qmin), float(scheme.qmax)

    def __call__(self, w: torch.Tensor, col: int) -> torch.Tensor:
        g = col // self.gs
        x = w / self.scale32_t[g]
        if self.zp_t is not None:
            x += self.zp_t[g]
        q = _round_half_even(x.clamp_(self.qmin, self.qmax))
        self.codes[col] = q.to(torch.int8)
        dq = q.to(self.scale_t.dtype)
        if self.zp_sd_t is not None:
            dq = dq - self.zp_sd_t[g]
        return (dq * self.scale_t[g]).float()

    def values(self) -> dict[str, torch.Tensor]:
        q = self.codes.t().contiguous()
        if self.scheme.packed:
            return {"weight_packed": pack_int32(q, self.scheme.num_bits)}
        return {"weight": q}


class _FP8Columns:
    """Rounds one column of an FP8Scheme weight (tensor / channel / block scales)."""

    def __init__(self, scheme: FP8Scheme, parts: dict, shape: tuple[int, int], name: str):
        out, inp = shape
        scale = parts["weight_scale"].float()
        if not bool(torch.isfinite(scale * FP8_MAX).all()):
            raise WeightRangeError(
                f"GPTQ for '{name}' (scheme '{scheme.name}'): a scale of this weight "
                f"overflows 448 * scale in float32 (|w| near the float32 max); quantize it "
                f"without calibration (round to nearest)."
            )
        if scheme.strategy == "tensor":
            self.per_col, self.div = scale.reshape(1, 1).expand(1, out), inp
        elif scheme.strategy == "channel":
            self.per_col, self.div = scale.reshape(1, out), inp
        else:
            b0, b1 = scheme.block
            rows = scale.repeat_interleave(b0, 0)[:out]  # [out, ceil(in / b1)]
            self.per_col, self.div = rows.t().contiguous(), b1
        self.codes = torch.empty(inp, out, dtype=torch.float8_e4m3fn)

    def __call__(self, w: torch.Tensor, col: int) -> torch.Tensor:
        s = self.per_col[col // self.div]
        q = (w / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        self.codes[col] = q
        return q.float() * s

    def values(self) -> dict[str, torch.Tensor]:
        return {"weight": self.codes.t().contiguous()}


class _FP4Columns:
    """Rounds one column of an FP4Scheme weight (NVFP4 / MXFP4) to E2M1 against its
    group's fixed float32 scale."""

    def __init__(self, scheme: FP4Scheme, parts: dict, shape: tuple[int, int], name: str):
        out, inp = shape
        self.group = scheme.group
        eff = fp4_search.effective_scales(parts)
        if not bool(torch.isfinite(eff * fmt.FP4_MAX).all()):
            raise WeightRangeError(
                f"GPTQ for '{name}' (scheme '{scheme.name}'): a scale of this weight times 6 "
                f"overflows float32; quantize it without calibration (round to nearest)."
            )
        self.eff_t = eff.t().contiguous()  # [ng, out]
        self.codes = torch.empty(inp, out, dtype=torch.uint8)  # column-major while sweeping

    def __call__(self, w: torch.Tensor, col: int) -> torch.Tensor:
        s = self.eff_t[col // self.group]
        q = fp4_codes_short(w / s, out=self.codes[col])  # (beyond 6: the top code)
        return E2M1.index_select(0, q.long()).mul_(s)

    def values(self) -> dict[str, torch.Tensor]:
        return {"weight_packed": pack_fp4(self.codes.t().contiguous())}


#: the column rounder of each ``Scheme.support.gptq`` kind
_COLUMNS = {"int": _IntColumns, "fp8": _FP8Columns, "fp4": _FP4Columns}


def _rtn_parts(scheme: Scheme, w: torch.Tensor, name: str, global_amax):
    """The scheme's parts of ``w``: its own quantize; an FP4 scheme's round to nearest
    (the fused set's global scale; its ``mse`` candidates: :func:`_scale_candidates`)."""
    if scheme.support.gptq != "fp4":
        return scheme.quantize(w, name=name)
    return scheme.quantize_rtn(w, name=name, global_amax=global_amax)


# -- GPTQ ------------------------------------------------------------------------------
def _check_args(w, H, scheme, block_size, dampening, act_order, name):
    """(scheme None: not checked, for :func:`fp_target_weight`)"""
    known = isinstance(scheme, Scheme) and scheme.support.gptq in _COLUMNS
    if scheme is not None and not known:
        kind = type(scheme).__name__ if isinstance(scheme, Scheme) else short_repr(scheme)
        raise ConfigError(
            f"GPTQ for '{name}': scheme {getattr(scheme, 'name', kind)!r} ({kind}) is not "
            f"supported; GPTQ handles int schemes (int2..int8, channel or group), FP8 "
            f"schemes (tensor, channel, block) and FP4 schemes (nvfp4, mxfp4). Quantize it "
            f"without calibration."
        )
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or not w.is_floating_point():
        raise ConfigError(
            f"GPTQ for '{name}': the weight must be a 2-D float tensor [out, in], got "
            f"{short_repr(w)}."
        )
    inp = w.shape[1]
    if not isinstance(H, torch.Tensor) or tuple(H.shape) != (inp, inp):
        got = tuple(H.shape) if isinstance(H, torch.Tensor) else short_repr(H)
        raise ConfigError(
            f"GPTQ for '{name}': the Hessian must be [{inp}, {inp}] (the weight is "
            f"{tuple(w.shape)}), got {got}."
        )
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ConfigError(
            f"GPTQ for '{name}': block_size must be a positive integer, got "
            f"{short_repr(block_size)}."
        )
    ok = isinstance(dampening, (int, float)) and not isinstance(dampening, bool)
    if not ok or not math.isfinite(dampening) or dampening < 0:
        raise ConfigError(
            f"GPTQ for '{name}': dampening must be a finite number >= 0 (a fraction of the "
            f"mean Hessian diagonal, e.g. 0.01), got {short_repr(dampening)}."
        )
    if not isinstance(act_order, bool):
        raise ConfigError(f"GPTQ for '{name}': act_order must be true or false.")
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise NonFiniteWeightError(
            f"GPTQ for '{name}': the weight holds {bad} NaN/Inf value(s); the source is "
            f"corrupt - fix or re-download it."
        )
    if not bool(torch.isfinite(H).all()):
        raise _not_finite_hessian(name, "Hessian", H)


def _dampen_(H: torch.Tensor, dampening: float) -> torch.Tensor:
    """GPTQ's dampening, in place: dead columns' (zero) diagonal set to 1, then
    ``dampening * mean(diag)`` added to the diagonal. Returns the dead-column mask."""
    diag = torch.diagonal(H)
    dead = diag == 0
    if bool(dead.any()):
        diag.masked_fill_(dead, 1.0)
    diag.add_(dampening * torch.mean(torch.diag(H)))
    return dead


def _inverse_factor(W: torch.Tensor, H: torch.Tensor, dampening: float, name: str):
    """Upper Cholesky factor of the dampened ``H^-1`` (H is overwritten); dead columns of
    W are zeroed. Identity (round to nearest) when H is not positive definite."""
    dead = _dampen_(H, dampening)
    if bool(dead.any()):
        W.masked_fill_(dead.unsqueeze(0), 0)
    L, info = torch.linalg.cholesky_ex(H, check_errors=False)
    if int(info) != 0:
        warnings.warn(
            f"GPTQ for '{name}': the dampened Hessian is not positive definite; this tensor "
            f"is rounded to nearest instead. Raise dampening or use more calibration data.",
            GPTQFallbackWarning,
            stacklevel=3,
        )
        return torch.eye(H.shape[0], dtype=H.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def gptq_quantize(
    w: torch.Tensor,
    H: torch.Tensor,
    scheme: Scheme,
    *,
    block_size: int = 128,
    dampening: float = 0.01,
    act_order: bool = False,
    name: str = "weight",
    target: torch.Tensor | None = None,
    global_amax: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The parts ``scheme.quantize(w)`` stores, with values chosen by GPTQ.

    w: [out, in] float weight; H: [in, in] Hessian of its inputs (e.g.
    :meth:`HessianAccumulator.hessian`; a positive multiple of it gives the same result
    up to float rounding);
    block_size: columns per lazy-update block; dampening: fraction of the mean diagonal
    added to it; act_order: sweep columns by descending ``diag(H)`` (compressed-tensors'
    ``actorder: weight``; the stored format is unchanged); name: the tensor, for errors;
    target: the weight the sweep approximates instead of w (same shape, e.g.
    :func:`fp_target_weight`'s), rounded against w's scales and zero points (the
    scheme's, observed on w: w's range, not the shifted target's, sets the grid);
    global_amax: an NVFP4 scheme's global scale from this largest |value| (the fused
    set's, e.g. q / k / v) instead of w's own.
    """
    _check_args(w, H, scheme, block_size, dampening, act_order, name)
    if target is not None:
        ok = isinstance(target, torch.Tensor) and target.is_floating_point()
        if not ok or tuple(target.shape) != tuple(w.shape):
            raise ConfigError(
                f"GPTQ for '{name}': the target weight must be a float tensor of the "
                f"weight's shape {tuple(w.shape)}, got {short_repr(target)}."
            )
        if not bool(torch.isfinite(target).all()):
            raise NonFiniteError(f"GPTQ for '{name}': the target weight holds NaN/Inf.")
    out, inp = w.shape
    scheme.check(name, (out, inp))
    candidates = _scale_candidates(scheme, w, H, name, global_amax)
    W = (w if target is None else target).to(torch.float32, copy=True)
    H = H.to(torch.float32, copy=True)
    order = None
    if act_order:
        order = torch.argsort(torch.diagonal(H), descending=True)
        W = W[:, order]
        H = H[order][:, order]
    ids = order.tolist() if order is not None else range(inp)
    Hinv = _inverse_factor(W, H, dampening, name).unsqueeze(0)
    del H
    if len(candidates) == 1:
        parts = candidates[0]
        cols = _COLUMNS[scheme.support.gptq](scheme, parts, (out, inp), name)
        _sweep(W, Hinv, cols, ids, block_size, name)
        return {**parts, **cols.values()}
    # several sets of scales (an FP4 scheme's mse observer): GPTQ's rows are independent,
    # so one sweep runs them all stacked [k * out, in], and each row keeps the set whose
    # sweep has the smallest error on the calibration inputs: GPTQ's own loss, the sum of
    # its columns' err^2 (err = (w - q) / [H^-1 factor]_ii; (q - wt) Hd (q - wt)^T / 2
    # with the dampened Hessian)
    k = len(candidates)
    stacked = _stacked(candidates)
    cols = _COLUMNS[scheme.support.gptq](scheme, stacked, (k * out, inp), name)
    loss = _sweep(W.repeat(k, 1), Hinv, cols, ids, block_size, name, loss=True)
    got = {**stacked, **cols.values()}
    rows = loss.view(k, out).argmin(0) * out + torch.arange(out)  # (the first on a tie)
    res = dict(candidates[0])
    for key in ("weight_packed", "weight_scale"):
        res[key] = got[key][rows].contiguous()
    return res


def _stacked(candidates: list[dict]) -> dict:
    """FP4 parts of the same weight under several sets of scales, their rows stacked (the
    global scale is the same for every set: the fused set's)."""
    first = candidates[0]
    g = first.get("weight_global_scale")
    for p in candidates[1:]:
        if g is not None and not torch.equal(p["weight_global_scale"], g):
            raise AssertionError("FP4 scale candidates with different global scales")
    out = dict(first)
    out["weight_scale"] = torch.cat([p["weight_scale"] for p in candidates])
    out["weight_packed"] = torch.cat([p["weight_packed"] for p in candidates])
    return out


def _scale_candidates(scheme: Scheme, w, H, name: str, global_amax) -> list[dict]:
    """The parts whose scales GPTQ rounds against: the scheme's own (:func:`_rtn_parts`);
    an FP4 scheme with the ``mse`` observer tries three (each group's scale searched on
    its block of H, round to nearest's, searched on the weight's squared error), and
    :func:`gptq_quantize` keeps, row by row, the sweep with the smallest error on the
    calibration inputs: measured per Linear on the trained llama, neither search wins
    everywhere (each is 2-6 % worse than round to nearest's scales on some Linear), and
    that error picks the best of the three on held-out tokens too."""
    rtn = _rtn_parts(scheme, w, name, global_amax)
    if scheme.support.gptq != "fp4" or scheme.observer != "mse":
        return [rtn]
    kw = {"name": name, "global_amax": global_amax, "base": rtn}
    out = [fp4_search.quantize(scheme, w, gram=fp4_search.local_blocks(H, scheme.group), **kw)]
    for parts in (rtn, fp4_search.quantize(scheme, w, **kw)):
        if not any(torch.equal(parts["weight_scale"].view(torch.uint8),
                               p["weight_scale"].view(torch.uint8)) for p in out):  # fmt: skip
            out.append(parts)
    return out


def _sweep(W, Hinv, cols, ids, block_size: int, name: str, loss: bool = False):
    """GPTQ's column sweep of ``W`` [out, in] (float32, in sweep order; overwritten) with
    the upper Cholesky factor ``Hinv`` [1, in, in] of the dampened inverse Hessian, each
    column rounded by ``cols`` (which keeps the codes). loss: return each row's GPTQ loss
    (the sum of its columns' squared scaled errors, float64 [out]), else None."""
    inp = W.shape[1]
    total = torch.zeros(W.shape[0], dtype=torch.float64) if loss else None
    W = W.unsqueeze(0)
    for i1 in range(0, inp, block_size):
        i2 = min(i1 + block_size, inp)
        # the block transposed ([columns, out], contiguous): every column and every
        # row-update below is a contiguous run; the values are those of llm-compressor's
        # [out, columns] block (the same element-wise products and differences)
        W1 = W[0, :, i1:i2].t().contiguous()
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[0, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = W1[i]
            q = cols(col, ids[i1 + i])
            err = (col - q) / Hinv1[i, i]
            Err1[i] = err
            W1[i:] -= Hinv1[i, i:].unsqueeze(1) * err.unsqueeze(0)
        if not bool(torch.isfinite(Err1).all()):
            raise NonFiniteError(
                f"GPTQ for '{name}' overflowed float32 in sweep columns {i1}..{i2 - 1} (weights "
                f"near the float32 max, or an ill-conditioned Hessian); quantize this tensor "
                f"without calibration, or raise dampening."
            )
        if total is not None:
            total += Err1.double().square().sum(0)
        if i2 < inp:  # the product on llm-compressor's layout, so its sums are the same
            W[:, :, i2:] -= torch.bmm(Err1.t().contiguous().unsqueeze(0), Hinv[:, i1:i2, i2:])
    return total

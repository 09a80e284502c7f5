"""The ``mse`` weight observer of FP4 schemes: each group's scale searched, not its amax's.

Round to nearest (``minmax``) gives each group the scale of its largest |value|
(``amax / 6`` rounded to e4m3 under NVFP4's global scale; MXFP4's power of two of it),
so the largest value lands on the top E2M1 code and the others on whatever grid that
leaves. The search tries, per group, the stored scale codes around that one and keeps
the one whose dequantized group is closest to the weight:

- NVFP4: the e4m3 codes ``c0 + k`` for ``k`` in :data:`NV_OFFSETS` (c0 the round-to-
  nearest code; one code is a step of 1/8 to 1/16 of the scale, so ``-6 .. +2`` spans
  about 0.55x to 1.25x of it), clamped to the finite positive codes; the global scale is
  round to nearest's (the fused set's largest |value|, as compressed-tensors sets it);
- MXFP4: the E8M0 exponents ``e0 + k`` for ``k`` in :data:`MX_OFFSETS` (halving or
  doubling the scale).

Each candidate rounds the group as the scheme does (``w / eff`` clamped to [-6, 6],
E2M1 round-to-nearest-even, ``eff`` the float32 scale every loader multiplies by:
``e4m3 / global`` or ``2 ** (e - 127)``) and is scored by the squared error
``sum (dq - w) ** 2`` or, given ``gram`` (the group's diagonal block of the Linear's
input second moment, e.g. the GPTQ Hessian's: Model Optimizer's "local Hessian" scale
search), by the output error ``d^T G_g d`` over the calibration tokens. Round to
nearest's own code is scored first and only a strictly smaller error replaces it, so
the search never ends above round to nearest's error on its own loss (the float32
rounding it scores is the nearest, at least as close as the scheme's).

The parts are the scheme's (names, dtypes, shapes, packing; NVFP4's global scale
unchanged): only scale bytes and codes differ. Memory: a band of rows (about 512 K
values) in float32 at a time. Cost: one rounding pass per candidate (9 NVFP4, 3 MXFP4).
"""

from __future__ import annotations

import torch

from .. import formats as fmt
from ..formats.fp4 import E2M1, fp4_codes, pack_fp4
from .mse_observer import RunningMin, group_quadratic

__all__ = ["MX_OFFSETS", "NV_OFFSETS", "local_blocks", "quantize"]

#: the e4m3 code offsets an NVFP4 group tries (0: round to nearest's code, first)
NV_OFFSETS = (0, 1, 2, -1, -2, -3, -4, -5, -6)
#: the E8M0 exponent offsets an MXFP4 group tries
MX_OFFSETS = (0, 1, -1)
#: the largest finite positive e4m3 code (0x7F is NaN)
_E4M3_TOP = 0x7E
#: the largest E8M0 exponent MXFP4 scales take (254 would be 2**127: the scheme refuses
#: groups that need it, :meth:`FP4Scheme._mx_scales`)
_E8M0_TOP = 252

_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def local_blocks(H: torch.Tensor, group: int) -> torch.Tensor:
    """The diagonal [group, group] blocks of ``H`` [in, in]: float32 [in / group, group,
    group] (the part of a Hessian that weighs each group's error on its own)."""
    n = H.shape[0]
    ng = n // group
    v = H.to(torch.float32).reshape(ng, group, ng, group)
    return torch.diagonal(v, dim1=0, dim2=2).permute(2, 0, 1).contiguous()


def effective_scales(parts: dict) -> torch.Tensor:
    """float32 [out, in / group] scales the loaders multiply an FP4 weight's E2M1 values
    by: NVFP4 ``e4m3 / global`` (in float32, as compressed-tensors), MXFP4 ``2**(e-127)``."""
    g = parts.get("weight_global_scale")
    codes = parts["weight_scale"].view(torch.uint8).to(torch.int32)
    return _eff(codes, g is not None, None if g is None else g.float().reshape(()))


def _eff(codes: torch.Tensor, nv: bool, gscale: torch.Tensor | None) -> torch.Tensor:
    """float32 scales the loaders multiply by, of int32 scale codes."""
    if nv:
        return _E4M3_VALUES[codes] / gscale
    return fmt.e8m0_to_float(codes.to(torch.uint8))


def _round(g: torch.Tensor, eff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 codes uint8, dequantized float32) of groups ``g`` [r, ng, gs] under ``eff``
    [r, ng]: the scheme's rounding (see the module doc)."""
    e = eff.unsqueeze(-1)
    x = (g / e).clamp_(-fmt.FP4_MAX, fmt.FP4_MAX)
    codes = fp4_codes(x)
    dq = E2M1[codes.view(-1).long()].view(g.shape).mul_(e)
    return codes, dq


def _loss(err: torch.Tensor, gram: torch.Tensor | None) -> torch.Tensor:
    """Per group: ``sum err ** 2``, or ``err^T G err`` with ``gram`` [ng, gs, gs]."""
    return err.square().sum(-1) if gram is None else group_quadratic(err, gram)


def quantize(
    scheme, w: torch.Tensor, *, name: str = "weight", global_amax=None,
    gram: torch.Tensor | None = None, base: dict | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The parts of ``w`` [out, in] under the FP4 ``scheme`` with each group's scale
    searched (see the module doc). global_amax: as :meth:`FP4Scheme.quantize` (NVFP4: the
    fused set's largest |value|); gram: [in / group, group, group] weights of each
    group's error (:func:`local_blocks` of a Hessian), None for the squared error; base:
    ``scheme.quantize_rtn(w, global_amax=global_amax)`` when the caller has it."""
    if base is None:
        base = scheme.quantize_rtn(w, name=name, global_amax=global_amax)
    out, inp = w.shape
    g = scheme.group
    ng = inp // g
    nv = scheme.encoding == fmt.NVFP4
    if gram is not None:
        if tuple(gram.shape) != (ng, g, g):
            raise ValueError(f"gram for '{name}' has shape {tuple(gram.shape)}, not {(ng, g, g)}")
        gram = gram.to(torch.float32)
    scale = base["weight_scale"]
    codes0 = scale.view(torch.uint8).to(torch.int32)
    gscale = base["weight_global_scale"].float().reshape(()) if nv else None
    offsets, lo, hi = (NV_OFFSETS, 1, _E4M3_TOP) if nv else (MX_OFFSETS, 0, _E8M0_TOP)
    packed = base["weight_packed"].clone()
    chosen = codes0.clone()
    band = max(1, (1 << 19) // max(1, inp))
    for r0 in range(0, out, band):
        r1 = min(out, r0 + band)
        wg = w[r0:r1].to(torch.float32).contiguous().view(r1 - r0, ng, g)
        c0 = codes0[r0:r1]
        live = wg.abs().amax(-1) > 0  # an all-zero group keeps its code
        pick = RunningMin()
        for k in offsets:
            c = torch.where(live, (c0 + k).clamp(lo, hi), c0)
            q, dq = _round(wg, _eff(c, nv, gscale))
            pick.offer(_loss(dq.sub_(wg), gram), c, q)
        best_c, best_codes = pick.values
        chosen[r0:r1] = best_c
        packed[r0:r1] = pack_fp4(best_codes.view(r1 - r0, inp))
    stored = chosen.to(torch.uint8)
    parts = dict(base)
    parts["weight_packed"] = packed
    parts["weight_scale"] = stored.view(scale.dtype) if nv else stored
    return parts

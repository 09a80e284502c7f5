"""The ``mse`` weight observer of integer schemes: per-group ranges by grid search.

Round to nearest under the ``minmax`` observer takes each group's scale from its full
range (``amax / 7.5`` for int4 symmetric), so one outlier decides the step of the whole
group. The ``mse`` observer runs llm-compressor's MSE weight observer search
(``observers/mse_quant.py::_grid_search_mse``): for ``p = 1 - i / grid``,
``i = 0 .. int(maxshrink * grid) - 1`` (20 ratios, 1.00 to 0.81, with the defaults grid
100, maxshrink 0.2), the scale and zero point of the shrunk range ``p * (min, max)``
(the scheme's own formulas: :meth:`IntScheme.quantize_rows`, so the scale dtype's
rounding and the zero point's formula are the stored ones), the weight rounded against
them (values beyond the range saturate at the end codes) and dequantized as every
loader does (``(q - zp) * scale`` in the scale's dtype); each group keeps the ratio with
the smallest ``sum |w - dq(w)| ** norm`` (the first on a tie, so the full range wins an
equal narrower one). The error is summed in float32 for every weight dtype (llm-compressor
sums in the weight's dtype), and the whole grid is searched (llm-compressor stops after
``patience`` steps in which no group of the tensor improved, 5 by default; a tensor of
more than a few groups rarely stops).

Activation-aware (AWQ's clip step, ``gram=``): the same grid, each group's loss the
Linear's output error over the calibration tokens, ``sum_t (x_t,g . (w_g - dq_g))^2 =
d_g^T G_g d_g`` with ``G_g`` the group's diagonal block of ``X^T X`` (the smoothed
inputs' Gram matrix, :class:`GroupGram`): cross terms between groups are left out, so
each group is still chosen alone. The original AWQ's ``auto_clip`` minimises this on a
sample of 512 tokens; here every calibration token counts.

The parts are the scheme's ordinary ones (names, dtypes, shapes, packing): only the
chosen scales, zero points and codes differ. Memory: the scheme's bands of rows (about
2 M float32 values at a time), never the whole tensor in float32. Cost: one round trip
per ratio (20 with the defaults).
"""

from __future__ import annotations

import torch

__all__ = ["GroupGram", "RunningMin", "candidates", "group_quadratic", "quantize"]


def candidates(grid: int, maxshrink: float) -> list[float]:
    """The shrink ratios tried, widest first (at least the full range)."""
    return [1.0 - i / grid for i in range(max(1, int(maxshrink * grid + 1e-9)))]


class RunningMin:
    """Per-group choice among candidates scored one after another: ``offer(loss, *values)``
    with each candidate's per-group loss and its per-group values (None: not tracked);
    the first smallest loss wins (``loss``, ``values``)."""

    def __init__(self):
        self.loss = None
        self.values: list = []

    def offer(self, loss: torch.Tensor, *values) -> None:
        if self.loss is None:
            self.loss, self.values = loss, list(values)
            return
        better = loss < self.loss
        self.loss = torch.where(better, loss, self.loss)
        self.values = [
            None
            if v is None
            else torch.where(better.view(*better.shape, *[1] * (v.ndim - better.ndim)), v, old)
            for v, old in zip(values, self.values, strict=True)
        ]


def group_quadratic(err: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Per group ``d^T G_g d`` of errors ``err`` [rows, ng, gs] under ``gram`` [ng, gs, gs]
    (one batched product over the groups): [rows, ng]."""
    gd = torch.bmm(err.transpose(0, 1), gram).transpose(0, 1)
    return gd.mul_(err).sum(-1)


def _clamp(g: torch.Tensor, lo, hi, r: float) -> torch.Tensor:
    """g clamped to its range times ``r``: a group whose range the scheme reads back
    as ``r * (lo, hi)``."""
    top = (hi * r).unsqueeze(-1)
    bot = -top if lo is None else (lo * r).unsqueeze(-1)
    return torch.maximum(torch.minimum(g, top), bot)


class GroupGram:
    """``sum_t x_t,g x_t,g^T`` per group of ``group`` input channels of one Linear, over
    streamed batches (padding excluded by a mask): float32 [in / group, group, group],
    ``in * group`` values (not the ``in x in`` Hessian GPTQ keeps)."""

    def __init__(self, in_features: int, group: int, name: str = "linear"):
        self.ng, self.gs, self.name = in_features // group, group, name
        self.sum = torch.zeros(self.ng, group, group, dtype=torch.float32)
        self.tokens = 0

    def add(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        rows = x.reshape(-1, x.shape[-1])
        if mask is not None:
            rows = rows[mask.reshape(-1).to(torch.bool)]
        if not rows.shape[0]:
            return
        g = rows.to(torch.float32).view(-1, self.ng, self.gs).transpose(0, 1)  # [ng, T, gs]
        self.sum.baddbmm_(g.transpose(1, 2), g)
        self.tokens += rows.shape[0]

    def blocks(self) -> torch.Tensor:
        """The mean over tokens (the scale does not change the choice)."""
        return self.sum / max(1, self.tokens)


def _round_and_loss(scheme, g, scale, zp, qmin, qmax, gram=None):
    """(codes float32, error per group) of groups ``g`` rounded against ``scale`` /
    ``zp`` (values beyond the range saturate), dequantized in the scale's dtype; the
    error ``sum |d| ** norm``, or with ``gram`` [ng, gs, gs] the quadratic ``d^T G d``."""
    x = g / scale.float().unsqueeze(-1)
    if zp is not None:
        x.add_(zp.unsqueeze(-1))
    q = x.round_().clamp_(qmin, qmax)
    dq = q.to(scale.dtype, copy=True)  # (a float32 scale: q itself without the copy)
    if zp is not None:
        dq.sub_(zp.to(scale.dtype).unsqueeze(-1))
    err = dq.mul_(scale.unsqueeze(-1)).float().sub_(g)
    if gram is not None:  # per group: d^T G_g d
        return q, group_quadratic(err, gram)
    err.abs_()
    norm = float(scheme.mse_norm)
    return q, (err.square_() if norm == 2.0 else err.pow_(norm)).sum(-1)


def _rows(scheme, g: torch.Tensor, name: str, gram=None, exact: bool = False):
    """(codes int8, scales, zero points float32 | None) of float32 groups [rows, ng, gs]:
    per group, those of the ratio with the smallest error (see the module doc).

    Each candidate's scale and zero point come from the shrunk range by the scheme's
    own :meth:`IntScheme.range_qparams`, without a clamped copy of the groups; the
    winners' codes are rounded once at the end. A band that holds NaN / Inf, or where
    the full range's extreme codes times its scale could overflow the scale dtype,
    takes :meth:`IntScheme.quantize_rows` of each clamped candidate instead (its
    checks and overflow fallbacks: :func:`_exact_candidate`); ``exact`` forces that."""
    lo, hi = scheme.group_range(g)
    sd = scheme.sdtype
    span = float(scheme.qmax - scheme.qmin)
    ok = (
        not exact
        and bool(torch.isfinite(hi).all())
        and (lo is None or bool(torch.isfinite(lo).all()))
    )
    if ok:  # every candidate's scale is at most the full range's
        _, raw, _ = scheme.range_qparams(lo, hi)
        ok = bool(torch.isfinite(torch.tensor(span).to(sd) * raw.to(sd)).all())

    def fast(r: float):
        _, raw, zp = scheme.range_qparams(None if lo is None else lo * r, hi * r)
        return raw.to(sd), zp

    qmin, qmax = float(scheme.qmin), float(scheme.qmax)
    pick = RunningMin()
    for r in candidates(scheme.mse_grid, scheme.mse_maxshrink):
        scale, zp = fast(r) if ok else _exact_candidate(scheme, g, lo, hi, r, name)
        _, loss = _round_and_loss(scheme, g, scale, zp, qmin, qmax, gram)
        pick.offer(loss, scale, zp)
    pick_s, pick_z = pick.values
    q, _ = _round_and_loss(scheme, g, pick_s, pick_z, qmin, qmax)
    return q.to(torch.int8), pick_s, pick_z


def _exact_candidate(scheme, g, lo, hi, r: float, name: str):
    """(scale, zp) the scheme's quantizer gives the groups clamped to ``r`` times their
    range (a clamped group reads back exactly that range), with its checks and
    overflow fallbacks."""
    _, scale, zp = scheme.quantize_rows(_clamp(g, lo, hi, r), name)
    return scale, zp


def quantize(
    scheme, w: torch.Tensor, *, name: str = "weight", gram: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The parts of ``w`` [out, in] under ``scheme`` (an :class:`~.schemes.IntScheme`)
    with each group's range searched (its ``mse_grid``, ``mse_maxshrink``; the loss
    ``mse_norm``'s, or the output error under ``gram``, :meth:`GroupGram.blocks`)."""
    scheme.check(name, tuple(w.shape))
    if gram is not None:
        ng = scheme.ngroups(int(w.shape[1]))
        want = (ng, int(w.shape[1]) // ng, int(w.shape[1]) // ng)
        if tuple(gram.shape) != want:
            raise ValueError(f"gram for '{name}' has shape {tuple(gram.shape)}, not {want}")
        gram = gram.to(torch.float32)
    return scheme.quantize_general(w, name, rows=lambda g, n: _rows(scheme, g, n, gram))

"""Observers: the clip value ``c`` of a static per-tensor activation scale
(``input_scale = c / qmax``), from the calibration tokens a Linear sees.

- ``minmax``: the largest |x| (every token fits; an outlier widens the grid for all);
- ``percentile``: the ``p``-th percentile of |x| over every observed element, exact, as
  ``numpy.percentile(|x|, p)`` (linear interpolation) computes it on all of them at once.
  Streamed as a per-batch top-k merge: the percentile only needs the
  ``ceil((1 - p/100) * (N - 1)) + 1`` largest values, and ``N`` is bounded in advance
  (``capacity``: the real tokens of the calibration set times the input width), so the
  observer keeps that many of the largest |x| seen so far (4 bytes each; p = 99.99 keeps
  1e-4 of the elements) and merges each batch into them;
- ``mse``: the clip ratio ``r`` of a grid (``1 - i / grid`` for ``i < maxshrink * grid``,
  as llm-compressor's MSE observer searches, here from 1.0 down to 0.21 by default) that
  minimises the summed squared error of fake-quantizing *all* the observed activations
  with clip ``r * absmax``. Exact over the calibration set: the first pass finds the
  absmax, a second pass (:meth:`Observer.refine`) sums every candidate's error. Unlike
  llm-compressor (which searches per batch with an L^2.4 norm, stops after ``patience``
  steps without improvement and averages batches) every candidate is scored on every
  token with the squared error.

Fake quantization for the error: FP8 E4M3 (``x / s`` clamped to +-448, cast to
``float8_e4m3fn`` and back) or symmetric int-N (round half to even, clamped to
``[-2^(N-1), 2^(N-1) - 1]``), times ``s = c / qmax``.
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ..formats import FP8_MAX

OBSERVERS = ("minmax", "percentile", "mse")


def _qmax(kind: str, bits: int) -> float:
    if kind == "float" and bits == 8:
        return FP8_MAX
    if kind == "int" and 2 <= bits <= 8:
        return float(2 ** (bits - 1) - 1)
    raise ConfigError(
        f"observers handle FP8 (float, 8 bits) and int 2-8 bit activations, not "
        f"{kind} {bits}-bit; use --observer minmax."
    )


def fake_quant(x: torch.Tensor, clip: float, kind: str = "float", bits: int = 8):
    """Symmetric per-tensor quantize-dequantize of ``x`` with clip value ``clip``."""
    qmax = _qmax(kind, bits)
    s = max(float(clip), torch.finfo(torch.float32).tiny) / qmax
    y = x.float() / s
    if kind == "float":
        y = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).float()
    else:
        y = torch.round(y).clamp(-qmax - 1, qmax)
    return y * s


class Observer:
    """Base: ``update(x)`` with the real tokens' rows [N, D] of a Linear input, once per
    batch; ``refine(x)`` on the same rows in a second pass when ``needs_refine``;
    ``clip()`` the result (0.0 when no token was observed)."""

    needs_refine = False

    def __init__(self) -> None:
        self.amax = 0.0
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        if x.numel():
            self.amax = max(self.amax, float(x.detach().abs().amax().float()))
            self.count += x.numel()

    def refine(self, x: torch.Tensor) -> None:  # pragma: no cover - overridden
        pass

    def clip(self) -> float:
        return self.amax


class MinMaxObserver(Observer):
    """The largest |x| (the scale every token fits)."""


class PercentileObserver(Observer):
    """Exact ``p``-th percentile of |x| (see the module doc); ``capacity``: an upper bound
    on the number of elements that will be observed."""

    def __init__(self, p: float = 99.99, capacity: int = 0):
        super().__init__()
        check_percentile(p)
        if capacity < 1:
            raise ConfigError(f"percentile observer: capacity must be >= 1, got {capacity}.")
        self.p, self.capacity = float(p), int(capacity)
        self.keep = min(self.capacity, _tail(self.p, self.capacity) + 1)
        self._top = torch.empty(0, dtype=torch.float32)

    def update(self, x: torch.Tensor) -> None:
        if not x.numel():
            return
        if self.count + x.numel() > self.capacity:
            raise ConfigError(
                f"percentile observer: more elements observed ({self.count + x.numel()}) "
                f"than its capacity ({self.capacity}); the percentile would not be exact."
            )
        super().update(x)
        v = torch.cat([self._top, x.detach().abs().float().reshape(-1).cpu()])
        if v.numel() > self.keep:
            v = v.topk(self.keep, sorted=False).values
        self._top = v

    def clip(self) -> float:
        n = self.count
        if not n:
            return 0.0
        top = self._top.sort(descending=True).values.double()
        pos = self.p / 100.0 * (n - 1)  # ascending position, numpy's "linear"
        lo, hi = math.floor(pos), math.ceil(pos)
        a, b = float(top[n - 1 - lo]), float(top[n - 1 - hi])
        return a + (b - a) * (pos - lo)


def _tail(p: float, n: int) -> int:
    """Top-ranked elements (from 0) the percentile of ``n`` elements can reach."""
    return min(n - 1, math.ceil((1.0 - p / 100.0) * (n - 1) + 1e-9) + 1)


class MSEObserver(Observer):
    """MSE-optimal clip ratio on a grid (see the module doc)."""

    needs_refine = True

    def __init__(self, kind: str = "float", bits: int = 8, grid: int = 100,
                 maxshrink: float = 0.8):  # fmt: skip
        super().__init__()
        _qmax(kind, bits)
        if not (isinstance(grid, int) and grid >= 1 and 0 < maxshrink < 1):
            raise ConfigError(
                f"mse observer: grid must be a positive integer and maxshrink in (0, 1), "
                f"got {grid!r}, {maxshrink!r}."
            )
        self.kind, self.bits = kind, bits
        self.ratios = [1.0 - i / grid for i in range(max(1, int(maxshrink * grid)))]
        self.errors = torch.zeros(len(self.ratios), dtype=torch.float64)

    def refine(self, x: torch.Tensor) -> None:
        if not x.numel() or self.amax <= 0:
            return
        xf = x.detach().float()
        for j, r in enumerate(self.ratios):
            d = fake_quant(xf, r * self.amax, self.kind, self.bits) - xf
            self.errors[j] += float(d.double().square().sum())

    def clip(self) -> float:
        if self.amax <= 0:
            return 0.0
        j = int(torch.argmin(self.errors))  # the first (largest ratio) among ties
        return self.ratios[j] * self.amax


def check_percentile(p) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 100:
        raise ConfigError(f"percentile must be a number in (0, 100], got {p!r}.")


def make_observer(kind: str, *, percentile: float = 99.99, capacity: int = 0,
                  act_type: str = "float", act_bits: int = 8) -> Observer:  # fmt: skip
    """An observer by name (``minmax``, ``percentile``, ``mse``)."""
    if kind == "minmax":
        return MinMaxObserver()
    if kind == "percentile":
        return PercentileObserver(percentile, capacity)
    if kind == "mse":
        return MSEObserver(act_type, act_bits)
    raise ConfigError(f"observer '{kind}' is not known; use one of {', '.join(OBSERVERS)}.")


__all__ = [
    "OBSERVERS",
    "MSEObserver",
    "MinMaxObserver",
    "Observer",
    "PercentileObserver",
    "check_percentile",
    "fake_quant",
    "make_observer",
]

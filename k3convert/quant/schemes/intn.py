"""Integer weights (int2..int8; symmetric or asymmetric; per channel or group; optional
MSE clip search)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import formats as fmt
from ...errors import (
    ConfigError,
    GroupSizeError,
    short_repr,
)
from ...formats.intn import pack_int32, packed_len, unpack_int32
from .. import mse_observer
from .base import (
    _DTYPES,
    _SIGNLESS,
    Scheme,
    Support,
    _finite_scale,
    _not_finite,
    _one_of,
    _out_of_range,
    _positive_int,
)

#: verify families of integer weights / activations, tightest first (a subset of
#: ``verify.metrics.FAMILIES``' order: a scheme takes the looser of its two)
_LOOSER = ("int8", "fp8", "int4", "int3", "int2")


def _int_family(bits: int) -> str:
    if bits >= 8:
        return "int8"
    if bits >= 4:
        return "int4"
    return "int3" if bits == 3 else "int2"


@dataclass(frozen=True)
class IntScheme(Scheme):
    """Integer weights, per output channel or per group of input channels.

    num_bits: 2..8; strategy: 'channel' (scale [out, 1]) | 'group' ([out, in/g]);
    symmetric: False adds a zero point; scale_dtype: 'float32' | 'bfloat16' | 'float16'.
    observer: how each group's range is chosen - 'minmax' (its full range, the default)
    or 'mse' (the range shrunk per group to the clip ratio with the smallest rounding
    error, :mod:`k3convert.quant.mse_observer`: ratios ``1 - i / mse_grid`` down to
    ``1 - mse_maxshrink``, error ``sum |w - dq(w)| ** mse_norm``) or 'search' (each
    group's scale with the smallest squared error among 15 candidates, for an MXFP4
    source: :mod:`k3convert.quant.mx_int4`, which the plan sets by default there; on any
    other input it is minmax); the parts are the same tensors either way.
    Weight-only schemes are stored pack-quantized (int32 words, dense bits); schemes
    with activation quantization are stored int-quantized (one int8 per value), as
    compressed-tensors infers.
    """

    num_bits: int = 4
    strategy: str = "group"
    group_size: int | None = 128
    symmetric: bool = True
    scale_dtype: str = "bfloat16"
    observer: str = "minmax"
    mse_grid: int = 100
    mse_maxshrink: float = 0.2
    mse_norm: float = 2.4

    def __post_init__(self):
        if not _one_of(self.observer, ("minmax", "mse", "search")):
            raise ConfigError(
                f"weight observer must be minmax or mse, not {short_repr(self.observer)}."
            )
        if not _positive_int(self.mse_grid):
            raise ConfigError(
                f"mse_grid must be a positive integer, got {short_repr(self.mse_grid)}."
            )
        for key, lo, hi in (("mse_maxshrink", 0.0, 1.0), ("mse_norm", 0.5, 8.0)):
            v = getattr(self, key)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v
            if not (ok and (v < hi if key == "mse_maxshrink" else v <= hi)):
                top = f"< {hi:g}" if key == "mse_maxshrink" else f"<= {hi:g}"
                raise ConfigError(
                    f"{key} must be a number >= {lo:g} and {top}, got {short_repr(v)}."
                )
        if not (_positive_int(self.num_bits) and 2 <= self.num_bits <= 8):
            raise ConfigError(
                f"num_bits must be an integer in 2..8, got {short_repr(self.num_bits)}."
            )
        if not _one_of(self.strategy, ("channel", "group")):
            raise ConfigError(
                f"int strategy must be channel or group, not {short_repr(self.strategy)}."
            )
        if self.strategy == "group" and not _positive_int(self.group_size):
            raise ConfigError(
                f"group_size must be a positive integer, got {short_repr(self.group_size)}."
            )
        if self.strategy == "channel":
            object.__setattr__(self, "group_size", None)
        if not isinstance(self.symmetric, bool):
            raise ConfigError(f"symmetric must be true or false, got {short_repr(self.symmetric)}.")
        if not _one_of(self.scale_dtype, tuple(_DTYPES)):
            raise ConfigError(
                f"scale_dtype must be one of {', '.join(_DTYPES)}, not "
                f"{short_repr(self.scale_dtype)}."
            )

    @property
    def packed(self) -> bool:
        return self.act is None

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    @property
    def sdtype(self) -> torch.dtype:
        return _DTYPES[self.scale_dtype]

    def check(self, tensor, shape):
        super().check(tensor, shape)
        if self.strategy == "group" and shape[1] % self.group_size:
            divisors = [g for g in (32, 64, 128) if shape[1] % g == 0]
            hint = (
                f"use group_size {' or '.join(map(str, divisors))}"
                if divisors
                else ("use a per-channel scheme")
            )
            raise GroupSizeError(
                f"scheme '{self.name}': group size {self.group_size} does not divide the "
                f"input dimension {shape[1]} of '{tensor}' (shape {tuple(shape)}); {hint}, "
                f"or keep it with --keep '{tensor}'.",
                tensor,
            )

    def ngroups(self, inp: int) -> int:
        return 1 if self.strategy == "channel" else inp // self.group_size

    def parts(self, shape):
        out, inp = shape
        ng = self.ngroups(inp)
        sd = self.sdtype
        if self.packed:
            p = [
                ("weight_packed", torch.int32, (out, packed_len(inp, self.num_bits))),
                ("weight_scale", sd, (out, ng)),
                ("weight_shape", torch.int64, (2,)),
            ]
            if not self.symmetric:
                p.append(("weight_zero_point", torch.int32, (packed_len(out, self.num_bits), ng)))
            return p
        p = [("weight", torch.int8, (out, inp)), ("weight_scale", sd, (out, ng))]
        if not self.symmetric:
            p.append(("weight_zero_point", torch.int8, (out, ng)))
        return p

    def quantize(self, w: torch.Tensor, *, name: str = "weight") -> dict[str, torch.Tensor]:
        """w: [out, in] -> parts (see class doc); groups along the input dim.

        Works on bands of rows so float32 temporaries stay cache-sized; symmetric
        schemes take the fused path (:meth:`_quantize_symmetric`) where it applies.
        The ``mse`` observer searches each group's clip ratio first
        (:func:`k3convert.quant.mse_observer.quantize`).
        """
        if self.observer == "mse":
            return mse_observer.quantize(self, w, name=name)
        fast = self._quantize_symmetric(w) if self.symmetric else None
        return fast if fast is not None else self.quantize_general(w, name)

    def _quantize_symmetric(self, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Bit-identical to the general path, without a float32 copy of the tensor: a
        band of rows at a time, group maxima of |w| are taken on the raw bits (sign
        cleared: exact, see :meth:`FP8Scheme._quantize_whole_blocks`), and
        ``round(clamp(w / scale))`` runs in place in one reused float32 buffer, then is
        packed band by band. None (the general path decides) for a NaN / Inf group or
        a scale whose ``q_min * scale`` overflows the scale dtype."""
        out, inp = w.shape
        ints = _SIGNLESS.get(w.dtype)
        if ints is None or not w.numel():
            return None
        itype, mask = ints
        ng = self.ngroups(inp)
        gs = inp // ng
        sd = self.sdtype
        w = w.contiguous()
        bits = w.view(itype)
        scale = torch.empty(out, ng, dtype=sd)
        if self.packed:
            words = packed_len(inp, self.num_bits)
            result = torch.empty(out, words, dtype=torch.int32)
        else:
            result = torch.empty(out, inp, dtype=torch.int8)
        band = max(1, (1 << 19) // inp)  # ~512 K elements: 2 MiB of float32
        fbuf = torch.empty(band * inp, dtype=torch.float32)
        ibuf = torch.empty(band * inp, dtype=itype)
        qbuf = torch.empty(band * inp, dtype=torch.int8) if self.packed else None
        span = torch.tensor(float(-self.qmin), dtype=sd)
        for r0 in range(0, out, band):
            r1 = min(out, r0 + band)
            n = (r1 - r0) * inp
            a = torch.bitwise_and(bits[r0:r1], mask, out=ibuf[:n].view(r1 - r0, inp))
            amax = a.view(r1 - r0, ng, gs).amax(-1).view(w.dtype).float()
            sc = self.symmetric_scale(amax)
            if not bool(torch.isfinite(span * sc).all()):
                return None  # NaN / Inf, or a range that needs the general path's fallback
            scale[r0:r1] = sc
            x = fbuf[:n].view(r1 - r0, ng, gs).copy_(w[r0:r1].view(r1 - r0, ng, gs))
            x.div_(sc.float()[..., None]).clamp_(self.qmin, self.qmax).round_()
            if qbuf is None:
                result[r0:r1].view(r1 - r0, ng, gs).copy_(x)
            else:
                q = qbuf[:n].view(r1 - r0, ng, gs).copy_(x)
                result[r0:r1] = pack_int32(q.view(r1 - r0, inp), self.num_bits)
        if not self.packed:
            return {"weight": result, "weight_scale": scale}
        shape = torch.tensor([out, inp], dtype=torch.int64)
        return {"weight_packed": result, "weight_scale": scale, "weight_shape": shape}

    def symmetric_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The stored scale (scale dtype) of float32 group maxima ``amax``, as the symmetric
        fast path computes it: amax / ((q_max - q_min) / 2), smallest normal at least."""
        half = float(self.qmax - self.qmin) / 2
        return _finite_scale(amax / half, self.sdtype).to(self.sdtype)

    def quantize_general(self, w: torch.Tensor, name: str, rows=None) -> dict[str, torch.Tensor]:
        """Band by band: ``rows(g, name)`` (default :meth:`quantize_rows`) gives each
        band's codes, scales and zero points, then the parts are packed."""
        rows = self.quantize_rows if rows is None else rows
        out, inp = w.shape
        ng = self.ngroups(inp)
        sd = self.sdtype
        q = torch.empty(out, inp, dtype=torch.int8)
        scale = torch.empty(out, ng, dtype=sd)
        zp = None if self.symmetric else torch.empty(out, ng, dtype=torch.float32)
        band = max(1, (1 << 21) // max(1, inp))
        for r0 in range(0, out, band):
            r1 = min(out, r0 + band)
            g = w[r0:r1].float().view(r1 - r0, ng, inp // ng)
            qs, ss, zs = rows(g, name)
            q[r0:r1] = qs.view(r1 - r0, inp)
            scale[r0:r1] = ss
            if zp is not None:
                zp[r0:r1] = zs
        parts: dict[str, torch.Tensor] = {}
        if self.packed:
            parts["weight_packed"] = pack_int32(q, self.num_bits)
            parts["weight_scale"] = scale
            parts["weight_shape"] = torch.tensor([out, inp], dtype=torch.int64)
            if zp is not None:
                parts["weight_zero_point"] = pack_int32(zp.to(torch.int8), self.num_bits, 0)
        else:
            parts["weight"] = q
            parts["weight_scale"] = scale
            if zp is not None:
                parts["weight_zero_point"] = zp.to(torch.int8)
        return parts

    def group_range(self, g: torch.Tensor):
        """(lo, hi) of float32 groups [rows, ng, gs] as the formulas take them: lo None
        and hi = max |x| for a symmetric scheme; else min <= 0 <= max."""
        if self.symmetric:
            return None, g.abs().amax(-1)
        return g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)

    def range_qparams(self, lo, hi):
        """(s, raw, zp) of group ranges (:meth:`group_range`): ``s`` the float32 scale
        formula, ``raw`` it clamped to the scale dtype's smallest normal (the stored scale
        is ``raw.to(sdtype)``), ``zp`` the zero point from ``raw`` as compressed-tensors'
        calculate_qparams takes it (float32; None when symmetric)."""
        bit_range = float(self.qmax - self.qmin)
        if lo is None:
            s = hi / (bit_range / 2)
        else:
            s = (hi - lo) / bit_range
            wide = torch.isinf(s)
            if bool(wide.any()):  # max - min overflows float32: the same formula in float64
                s = torch.where(wide, ((hi.double() - lo.double()) / bit_range).float(), s)
        raw = _finite_scale(s, self.sdtype)
        zp = None
        if lo is not None:
            zp = torch.round(torch.clamp(self.qmin - lo / raw, self.qmin, self.qmax))
        return s, raw, zp

    def quantize_rows(self, g: torch.Tensor, name: str = "weight"):
        """g: [rows, ng, group] fp32 -> (q int8, scale sd [rows, ng], zp fp32 | None).

        compressed-tensors' formulas in float32; a group where they overflow (see the
        module doc) takes a fallback, and what stays non-finite is refused.
        """
        sd = self.sdtype
        lo, hi = self.group_range(g)
        if not bool(torch.isfinite(hi).all()) or (
            lo is not None and not bool(torch.isfinite(lo).all())
        ):
            raise _not_finite(self, name, hi if lo is None else hi - lo)
        s, raw, zp = self.range_qparams(lo, hi)
        scale = raw.to(sd)
        if not bool(torch.isfinite(scale).all()):
            big = float(g.abs().amax())
            raise _out_of_range(self, name, big, f"scale of {float(s.max()):.4g}", sd)
        # the zero point from the scale before its rounding to the scale dtype, as
        # compressed-tensors' calculate_qparams does (then round(w / scale + zp) with the
        # stored scale)
        q = self._round(g, scale, zp)
        # (q - zp) * scale is what every loader computes, in the scale's dtype: a bound
        # per group first (cheap), then the values themselves where the bound overflows
        qmin = torch.tensor(float(-self.qmin))
        span = qmin if zp is None else torch.maximum(qmin + zp, self.qmax - zp)
        if bool(torch.isfinite(span.to(sd) * scale).all()):
            return q, scale, zp
        dq = q.float() if zp is None else q.float() - zp[..., None]
        over = ~torch.isfinite(dq.abs().amax(-1).to(sd) * scale)
        if bool(over.any()):
            # amax / q_max with a zero point of 0 (a valid asymmetric encoding too): every
            # |q| <= q_max, so |q * scale| is amax to within one rounding - rounded down
            # one ulp where q_max * scale would still overflow
            amax = g.abs().amax(-1)
            s2 = _finite_scale(amax / self.qmax, sd).to(sd)
            up = ~torch.isfinite(s2 * self.qmax)
            s2 = torch.where(up, torch.nextafter(s2, torch.zeros_like(s2)), s2)
            q2 = torch.round((g / s2.float()[..., None]).clamp_(-self.qmax, self.qmax))
            ok = torch.isfinite(q2.abs().amax(-1).to(sd) * s2)
            if not bool(ok[over].all()):
                big = float(amax[over & ~ok].max())
                raise _out_of_range(self, name, big, "dequantized value", sd)
            scale = torch.where(over, s2, scale)
            q = torch.where(over[..., None], q2.to(torch.int8), q)
            if zp is not None:
                zp = torch.where(over, torch.zeros_like(zp), zp)
        return q, scale, zp

    def _round(self, g: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None):
        """q int8 of groups g under ``scale`` and ``zp`` (compressed-tensors'
        ``round(clamp(w / scale + zp))``)."""
        x = g / scale.float()[..., None]
        if zp is not None:
            x = x + zp[..., None]
        return torch.round(x.clamp_(self.qmin, self.qmax)).to(torch.int8)

    def dequantize(self, parts):
        """(q - zp) * scale computed in the scale's dtype (as compressed-tensors) -> fp32."""
        scale = parts["weight_scale"]
        if self.packed:
            shp = parts["weight_shape"]
            out, inp = (int(v) for v in (shp.tolist() if isinstance(shp, torch.Tensor) else shp))
            q = unpack_int32(parts["weight_packed"], self.num_bits, (out, inp))
            zp = parts.get("weight_zero_point")
            if zp is not None:
                zp = unpack_int32(zp, self.num_bits, tuple(scale.shape), packed_dim=0)
        else:
            q = parts["weight"]
            out, inp = q.shape
            zp = parts.get("weight_zero_point")
        ng = scale.shape[-1]
        x = q.view(out, ng, inp // ng).to(scale.dtype)
        if zp is not None:
            x = x - zp.to(scale.dtype)[..., None]
        return (x * scale[..., None]).view(out, inp).float()

    @property
    def support(self) -> Support:
        """vLLM's integer kernels by bits and activations; the verify family is the looser
        of the weights' and the activations'; GPTQ on the fixed scales; minmax or mse
        ranges; AWQ's clip step for group scales; a symmetric packed int4 with bf16 /
        float32 scales is produced from MXFP4 bytes (its scale search or minmax)."""
        act = self.act
        if act is None:
            kernel = {4: "int4-w4a16", 8: "int8-w8a16"}.get(self.num_bits, "intN-w-a16")
        elif act.type == "float":
            kernel = "int4-w4a8-fp8"
        else:
            kernel = "int8-w8a8" if self.strategy == "channel" else "int8-group-w8a8"
        family = _int_family(self.num_bits)
        if act is not None:
            af = "fp8" if act.type == "float" and act.num_bits == 8 else _int_family(act.num_bits)
            family = max(family, af, key=_LOOSER.index)
        mx = (self.packed and self.symmetric and self.num_bits == 4
              and self.observer in ("minmax", "search")
              and self.sdtype in (torch.bfloat16, torch.float32))  # fmt: skip
        return Support(kernel=kernel, verify_family=family, gptq="int",
                       observers=("minmax", "mse"), awq_clip=self.strategy == "group",
                       transcodes=(fmt.MXFP4,) if mx else ())  # fmt: skip

    def weight_args(self):
        return {
            "num_bits": self.num_bits,
            "type": "int",
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "dynamic": False,
            "actorder": None,
            # the search minimises the squared error per group: llm-compressor's name for it
            "observer": "mse" if self.observer == "search" else self.observer,
            "observer_kwargs": {} if self.observer == "minmax" else {"norm": 2.0} if
            self.observer == "search" else {
                "grid": self.mse_grid, "maxshrink": self.mse_maxshrink, "norm": self.mse_norm,
            },
        }  # fmt: skip

    @property
    def format(self):
        return fmt.ct_format("int", self.num_bits, self.group_size, not self.packed)

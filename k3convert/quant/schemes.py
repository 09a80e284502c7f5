"""Weight quantization schemes: one frozen dataclass per family, registered by name.

A scheme turns one float weight ``w: [out, in]`` into the physical tensors a
compressed-tensors checkpoint stores for it (``quantize``), and back (``dequantize``).
Part names are compressed-tensors' storage names, and the formulas are the ones
compressed-tensors / llm-compressor use, so our files load in vLLM, SGLang and
transformers, and compressed-tensors' own decompressor gives exactly our
``dequantize`` (the tests check both):

=============  ===========================================  ============================
family         parts                                        dequantize
=============  ===========================================  ============================
FP8 e4m3       weight fp8 [out, in]; weight_scale fp32       weight.float() * scale
               [1] | [out, 1] | [ceil(out/b0), ceil(in/b1)]  (block-broadcast)
INT-N naive    weight int8 [out, in]; weight_scale           (q - zp) * scale, in the
(with act.)    [out, 1] | [out, in/g] (+ weight_zero_point)  scale's dtype
INT-N packed   weight_packed int32 [out, ceil(in*b/32)];     unpack, then as above
(weight-only)  weight_scale; weight_shape int64 [2];
               weight_zero_point int32 [ceil(out*b/32), in/g]
=============  ===========================================  ============================

The format (``float-quantized``, ``naive-quantized``, ``int-quantized``,
``pack-quantized``) follows compressed-tensors' own inference from the scheme, because
its dequantizer re-infers it and ignores what config.json says. Every scheme here is
expressible in compressed-tensors 0.20 (pack-quantized packs 1..8 bits densely, so int3
and int2 included; power-of-two "ue8m0" scales are stored as exact float32 values), so
no k3convert-specific packing is needed.

Scale formulas (compressed-tensors ``calculate_qparams``): symmetric
``scale = amax / ((q_max - q_min) / 2)`` (amax/448 for FP8, amax/7.5 for int4,
amax/127.5 for int8) and ``q = clamp(round(w / scale), q_min, q_max)``; asymmetric
``scale = (max - min) / (q_max - q_min)`` with min <= 0 <= max and
``zp = round(clamp(q_min - min / scale))``. Zero or denormal ranges get the smallest
normal scale so no division produces NaN or Inf.

Huge but finite weights (|w| near the float max) never give a non-finite scale, zero
point or dequantized value: scales are computed in float32 as above, and only where
that formula overflows does a group take a fallback - the asymmetric range in float64,
a symmetric int scale of ``amax / q_max`` (so ``q_min * scale`` cannot overflow), an
FP8 scale one ulp smaller, or a ue8m0 block clamped to the largest e4m3 value whose
product with its power-of-two scale is finite. Ordinary inputs never reach a fallback,
so their parts stay bit-identical to compressed-tensors'. What no finite scale of the
scale dtype can hold (e.g. 1e6 with float16 scales) is refused naming the tensor
(:class:`WeightRangeError`); NaN / Inf input is :class:`NonFiniteWeightError`.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import torch

from .. import formats as fmt
from ..errors import (
    ConfigError,
    GroupSizeError,
    NonFiniteWeightError,
    UnknownSchemeError,
    WeightRangeError,
    short_repr,
)
from ..formats import FP8_MAX
from ..formats.dtypes import FLOAT_DTYPES
from ..formats.fp4 import fp4_codes, pack_fp4
from ..formats.intn import pack_int32, packed_len, unpack_int32
from .activations import ActivationSpec

_F32_MAX = float(torch.finfo(torch.float32).max)
_DTYPES = FLOAT_DTYPES


def _positive_int(v) -> bool:
    """A positive int that is not a bool (True is an int to Python, not to a config)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _one_of(v, choices: tuple[str, ...]) -> bool:
    return isinstance(v, str) and v in choices


def _esize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _nbytes(parts: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) * _esize(d) for _, d, s in parts)


@dataclass(frozen=True)
class Scheme:
    """Base of every weight scheme.

    name: registry name; act: input-activation spec recorded in config.json (None for
    weight-only schemes); needs_input_scale: True when act is static (its per-tensor
    ``input_scale`` comes from calibration).
    """

    name: str = ""
    act: ActivationSpec | None = None

    # -- interface ----------------------------------------------------------------------
    def check(self, tensor: str, shape: tuple[int, ...]) -> None:
        """Raise a K3Error naming ``tensor`` if this scheme cannot quantize ``shape``."""
        if len(shape) != 2:
            raise ConfigError(
                f"scheme '{self.name}' quantizes 2-D Linear weights; '{tensor}' has shape "
                f"{tuple(shape)}. Keep it (--keep '{tensor}')."
            )
        act = self.act
        if act is not None and act.strategy == "group" and shape[1] % act.group_size:
            # compressed-tensors (and so vLLM / transformers) cannot run such a layer:
            # refuse now rather than write a checkpoint nothing can execute
            raise GroupSizeError(
                f"scheme '{self.name}' quantizes input activations in groups of "
                f"{act.group_size} channels, which does not divide the input dimension "
                f"{shape[1]} of '{tensor}' (shape {tuple(shape)}); use a per-token scheme "
                f"such as fp8-dynamic for it, or keep it with --keep '{tensor}'.",
                tensor,
            )

    def parts(self, shape: tuple[int, int]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(part suffix, dtype, shape) of what ``quantize`` returns for ``shape``."""
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, *, name: str = "weight") -> dict[str, torch.Tensor]:
        """w: [out, in] float -> parts; name: the tensor, for error messages."""
        raise NotImplementedError

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def weight_args(self) -> dict:
        """compressed-tensors QuantizationArgs dict of the weights."""
        raise NotImplementedError

    @property
    def format(self) -> str:
        raise NotImplementedError

    @property
    def needs_input_scale(self) -> bool:
        """Whether the activation parameter must come from calibration (a static spec's
        ``input_scale``); an NVFP4 input's ``input_global_scale`` has a default."""
        return self.act is not None and not self.act.dynamic

    def act_parts(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(part suffix, dtype, shape) of the activation parameters the writer adds to
        ``quantize``'s parts: a static spec's calibrated ``input_scale``. (Parameters
        with a default, NVFP4's ``input_global_scale``, are in :meth:`parts`.)"""
        return self.act.param_parts() if self.act is not None else []

    def act_values(self, value=None) -> dict[str, torch.Tensor]:
        """Every activation parameter this scheme stores, holding ``value`` (from
        calibration; required for static specs) or the spec's default; the writer
        stores these over what ``quantize`` returned."""
        return self.act.param_values(value) if self.act is not None else {}

    # -- derived ------------------------------------------------------------------------
    def nbytes(self, shape: tuple[int, int]) -> int:
        return _nbytes(self.parts(shape)) + _nbytes(self.act_parts())

    def ct_scheme(self, targets: list[str]) -> dict:
        """One config_groups entry of config.json."""
        return {
            "targets": list(targets),
            "weights": self.weight_args(),
            "input_activations": self.act.ct_args() if self.act else None,
            "output_activations": None,
            "format": self.format,
        }

    def describe(self) -> str:
        return self.name

    def options(self) -> dict:
        """Fields a recipe may override (everything but name / act)."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("name", "act")
        }


#: float dtype -> (signed int dtype of its width, mask clearing the sign bit)
_SIGNLESS = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def _finite_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp scales to the smallest normal of ``dtype`` (zero / denormal ranges)."""
    return scale.clamp(min=torch.finfo(dtype).tiny)


def _not_finite(scheme: Scheme, name: str, extreme: torch.Tensor) -> NonFiniteWeightError:
    bad = int((~torch.isfinite(extreme)).sum())
    return NonFiniteWeightError(
        f"scheme '{scheme.name}': tensor '{name}' holds NaN/Inf value(s) ({bad} group(s) "
        f"affected); the source is corrupt - fix or re-download it."
    )


def _out_of_range(scheme: Scheme, name: str, amax: float, what: str, dtype) -> WeightRangeError:
    hint = " or use scale_dtype float32" if dtype != torch.float32 else ""
    return WeightRangeError(
        f"scheme '{scheme.name}' cannot represent tensor '{name}': its largest magnitude "
        f"{amax:.4g} gives a {what} beyond the range of {str(dtype).removeprefix('torch.')} "
        f"(max {torch.finfo(dtype).max:.4g}); keep it (--keep '{name}'){hint}."
    )


# -- FP8 ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FP8Scheme(Scheme):
    """FP8 e4m3 weights with float32 scales.

    strategy: 'tensor' (scale [1]) | 'channel' ([out, 1]) | 'block' ([ceil(out/b0),
    ceil(in/b1)], any block shape, partial edge blocks allowed); scale_fmt: 'float32'
    or 'ue8m0' (power-of-two scales, rounded up so nothing clips; stored as exact
    float32 values, as DeepSeek-V3.1 does).
    """

    strategy: str = "block"
    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "float32"

    def __post_init__(self):
        if not _one_of(self.strategy, ("tensor", "channel", "block")):
            raise ConfigError(
                f"FP8 strategy must be tensor, channel or block, not {short_repr(self.strategy)}."
            )
        if not _one_of(self.scale_fmt, ("float32", "ue8m0")):
            raise ConfigError(
                f"scale_fmt must be 'float32' or 'ue8m0', not {short_repr(self.scale_fmt)}."
            )
        b = tuple(self.block) if isinstance(self.block, (list, tuple)) else ()
        if len(b) != 2 or not all(_positive_int(v) for v in b):
            raise ConfigError(
                f"block must be two positive ints [rows, cols], got {short_repr(self.block)}."
            )
        object.__setattr__(self, "block", b)

    def parts(self, shape):
        out, inp = shape
        if self.strategy == "tensor":
            s = (1,)
        elif self.strategy == "channel":
            s = (out, 1)
        else:
            s = (math.ceil(out / self.block[0]), math.ceil(inp / self.block[1]))
        return [("weight", torch.float8_e4m3fn, (out, inp)), ("weight_scale", torch.float32, s)]

    def _scale(self, amax: torch.Tensor, name: str):
        """(scale, clamp limit) of each scale's group; the limit is FP8_MAX (a float) unless
        ``FP8_MAX * scale`` overflows float32, which only amax within an ulp of the float32
        max (float32 scales) or above ~3.39e38 (ue8m0) reaches."""
        s = _finite_scale(amax / FP8_MAX, torch.float32)
        if not bool(torch.isfinite(s).all()):
            raise _not_finite(self, name, amax)
        if self.scale_fmt == "ue8m0":
            s = torch.exp2(torch.ceil(torch.log2(s)))
        over = ~torch.isfinite(s * FP8_MAX)
        if not bool(over.any()):
            return s, FP8_MAX
        if self.scale_fmt == "float32":  # one ulp smaller: |q| <= 448 keeps q * s finite
            return torch.where(over, torch.nextafter(s, torch.zeros_like(s)), s), FP8_MAX
        # power-of-two scale (2**120): the largest e4m3 value whose product stays finite
        lim = (_F32_MAX / s).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
        down = (lim.view(torch.uint8) - 1).view(torch.float8_e4m3fn).float()
        lim = torch.where(torch.isfinite(lim.float() * s), lim.float(), down)
        if not bool(torch.isfinite(lim * s).all()):  # cannot happen for e4m3 / float32
            raise _out_of_range(self, name, float(amax.max()), "dequantized value", s.dtype)
        return s, lim

    def quantize(self, w: torch.Tensor, *, name: str = "weight") -> dict[str, torch.Tensor]:
        """w: [out, in] -> weight fp8 [out, in], weight_scale fp32 (see class doc)."""
        if self.strategy == "block":
            return self._quantize_blocks(w, name)
        w = w.float()
        if self.strategy == "tensor":
            scale, lim = self._scale(w.abs().amax().reshape(1), name)
        elif self.strategy == "channel":
            scale, lim = self._scale(w.abs().amax(dim=1, keepdim=True), name)
        else:
            raise AssertionError(self.strategy)
        x = w / scale
        x = x.clamp_(-FP8_MAX, FP8_MAX) if isinstance(lim, float) else x.clamp_(-lim, lim)
        return {"weight": x.to(torch.float8_e4m3fn), "weight_scale": scale}

    def _quantize_blocks(self, w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        """Whole blocks take the fused path (:meth:`_quantize_whole_blocks`); partial edge
        blocks, scales that overflow and non-finite input take the general one."""
        fast = self._quantize_whole_blocks(w)
        return fast if fast is not None else self._quantize_blocks_general(w, name)

    def _quantize_whole_blocks(self, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Bit-identical to the general path for a weight made of whole blocks, without a
        float32 copy of the tensor: a band of block rows at a time, |w| is taken on the
        raw bits (sign cleared; the order of non-negative IEEE values is that of their
        bits, so the block maximum is exact), and ``w / scale`` is computed in float32
        into one reused cache-sized buffer, clamped in place and cast straight into the
        fp8 output. None when the weight needs the general path: edge blocks, a NaN/Inf
        block or a scale for which ``448 * scale`` overflows (ue8m0 too, whose rounding
        the general path owns)."""
        out, inp = w.shape
        b0, b1 = self.block
        ints = _SIGNLESS.get(w.dtype)
        if self.scale_fmt != "float32" or ints is None or out % b0 or inp % b1 or not w.numel():
            return None
        r, c = out // b0, inp // b1
        itype, mask = ints
        w = w.contiguous()
        v = w.view(r, b0, c, b1)
        bits = w.view(itype).view(r, b0, c, b1)
        q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
        qv = q.view(r, b0, c, b1)
        scale = torch.empty(r, c, dtype=torch.float32)
        band = max(1, (1 << 19) // (b0 * inp))  # ~512 K elements: 2 MiB of float32
        fbuf = torch.empty(band * b0 * inp, dtype=torch.float32)
        ibuf = torch.empty(band * b0 * inp, dtype=itype)
        for i0 in range(0, r, band):
            i1 = min(r, i0 + band)
            n = (i1 - i0) * b0 * inp
            a = torch.bitwise_and(bits[i0:i1], mask, out=ibuf[:n].view(i1 - i0, b0, c, b1))
            amax = a.amax(3).amax(1).view(w.dtype).float()
            s = _finite_scale(amax / FP8_MAX, torch.float32)
            if not bool(torch.isfinite(s * FP8_MAX).all()):
                return None
            scale[i0:i1] = s
            # one dtype per op keeps every op on torch's vectorized loops (a mixed-dtype
            # division runs element by element); float32 is exact for every input dtype
            x = fbuf[:n].view(i1 - i0, b0, c, b1).copy_(v[i0:i1])
            qv[i0:i1].copy_(x.div_(s[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX))
        return {"weight": q, "weight_scale": scale}

    def _quantize_blocks_general(self, w: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        """One band of b0 rows at a time: the float32 working set stays cache-sized and
        the only full-size allocation is the fp8 output."""
        out, inp = w.shape
        b0, b1 = self.block
        r, c = math.ceil(out / b0), math.ceil(inp / b1)
        cpad = c * b1 - inp
        q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
        scale = torch.empty(r, c, dtype=torch.float32)
        band = max(1, (1 << 21) // max(1, b0 * inp))  # ~2 M elements per step
        for i0 in range(0, r, band):
            i1 = min(r, i0 + band)
            rows = w[i0 * b0 : min(out, i1 * b0)].to(torch.float32, copy=True)
            n = rows.shape[0]
            if (i1 - i0) * b0 != n or cpad:
                padded = rows.new_zeros((i1 - i0) * b0, c * b1)
                padded[:n, :inp] = rows
            else:
                padded = rows
            blocks = padded.view(i1 - i0, b0, c, b1)
            s, lim = self._scale(blocks.abs().amax(dim=3).amax(dim=1), name)
            scale[i0:i1] = s
            blocks.div_(s[:, None, :, None])
            if isinstance(lim, float):
                blocks.clamp_(-FP8_MAX, FP8_MAX)
            else:
                blocks.clamp_(-lim[:, None, :, None], lim[:, None, :, None])
            q[i0 * b0 : i0 * b0 + n] = padded[:n, :inp].to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}

    def dequantize(self, parts):
        """weight fp8 [out, in] * weight_scale (broadcast per tensor/channel/block) -> fp32."""
        q, scale = parts["weight"], parts["weight_scale"]
        x = q.to(scale.dtype)
        if self.strategy in ("tensor", "channel"):
            return (x * scale).float()
        out, inp = q.shape
        b0, b1 = self.block
        s = scale.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]
        return (x * s).float()

    def weight_args(self):
        a = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "group_size": None,
            "strategy": self.strategy,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
            "observer_kwargs": {},
        }
        if self.strategy == "block":
            a["block_structure"] = list(self.block)
        return a

    @property
    def format(self):
        return fmt.ct_format("float", 8, None, self.act is not None)


# -- INT ------------------------------------------------------------------------------
@dataclass(frozen=True)
class IntScheme(Scheme):
    """Integer weights, per output channel or per group of input channels.

    num_bits: 2..8; strategy: 'channel' (scale [out, 1]) | 'group' ([out, in/g]);
    symmetric: False adds a zero point; scale_dtype: 'float32' | 'bfloat16' | 'float16'.
    observer: how each group's range is chosen - 'minmax' (its full range, the default)
    or 'mse' (the range shrunk per group to the clip ratio with the smallest rounding
    error, :mod:`.mse_observer`: ratios ``1 - i / mse_grid`` down to ``1 - mse_maxshrink``,
    error ``sum |w - dq(w)| ** mse_norm``) or 'search' (each group's scale with the
    smallest squared error among 15 candidates, for an MXFP4 source: :mod:`.mx_int4`,
    which the plan sets by default there; on any other input it is minmax); the parts are
    the same tensors either way.
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

    def _ngroups(self, inp: int) -> int:
        return 1 if self.strategy == "channel" else inp // self.group_size

    def parts(self, shape):
        out, inp = shape
        ng = self._ngroups(inp)
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
        (:func:`.mse_observer.quantize`).
        """
        if self.observer == "mse":
            from . import mse_observer

            return mse_observer.quantize(self, w, name=name)
        fast = self._quantize_symmetric(w) if self.symmetric else None
        return fast if fast is not None else self._quantize_general(w, name)

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
        ng = self._ngroups(inp)
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

    def _quantize_general(self, w: torch.Tensor, name: str, rows=None) -> dict[str, torch.Tensor]:
        """Band by band: ``rows(g, name)`` (default :meth:`_quantize_rows`) gives each
        band's codes, scales and zero points, then the parts are packed."""
        rows = self._quantize_rows if rows is None else rows
        out, inp = w.shape
        ng = self._ngroups(inp)
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

    def _group_range(self, g: torch.Tensor):
        """(lo, hi) of float32 groups [rows, ng, gs] as the formulas take them: lo None
        and hi = max |x| for a symmetric scheme; else min <= 0 <= max."""
        if self.symmetric:
            return None, g.abs().amax(-1)
        return g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)

    def _range_qparams(self, lo, hi):
        """(s, raw, zp) of group ranges (:meth:`_group_range`): ``s`` the float32 scale
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

    def _quantize_rows(self, g: torch.Tensor, name: str = "weight"):
        """g: [rows, ng, group] fp32 -> (q int8, scale sd [rows, ng], zp fp32 | None).

        compressed-tensors' formulas in float32; a group where they overflow (see the
        module doc) takes a fallback, and what stays non-finite is refused.
        """
        sd = self.sdtype
        lo, hi = self._group_range(g)
        if not bool(torch.isfinite(hi).all()) or (
            lo is not None and not bool(torch.isfinite(lo).all())
        ):
            raise _not_finite(self, name, hi if lo is None else hi - lo)
        s, raw, zp = self._range_qparams(lo, hi)
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


# -- FP4 ------------------------------------------------------------------------------
#: float dtypes whose group maxima and scale arithmetic run in that dtype, as
#: compressed-tensors does for a model loaded in it; others (float16, an encoded source
#: dequantized to float32) run in float32
_FP4_COMPUTE = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class FP4Scheme(Scheme):
    """FP4 E2M1 weights in groups along the input dim (base of MXFP4 and NVFP4).

    Parts and geometry come from the format registry (:mod:`k3convert.formats`); the
    scale arithmetic is compressed-tensors' (``calculate_qparams`` over per-group min /
    max as llm-compressor's weight observer takes them, then the compressor's
    ``quantize_and_pack_fp4``), in the weight's own dtype for bfloat16 / float32
    sources, so the stored bytes equal compressed-tensors' for the same weight.
    """

    #: the format written (a key of ``formats.FORMATS``)
    encoding: str = ""

    @property
    def spec(self) -> fmt.Encoding:
        return fmt.FORMATS[self.encoding]

    @property
    def group(self) -> int:
        return self.spec.group

    def options(self) -> dict:
        return {}

    @property
    def shares_global_scale(self) -> bool:
        """NVFP4: Linears fused at inference (q/k/v, gate/up) share one global scale."""
        return self.encoding == fmt.NVFP4

    def abs_max(self, w: torch.Tensor, *, name: str = "weight") -> torch.Tensor:
        """max |w| (exact, float32 0-dim), what the global scale is computed from."""
        w = w if w.dtype in _SIGNLESS else w.float()
        return _abs_max(w.contiguous(), name, self)

    def check(self, tensor, shape):
        super().check(tensor, shape)
        if shape[1] % self.group:
            raise GroupSizeError(
                f"scheme '{self.name}' stores {self.encoding}, whose groups of {self.group} "
                f"values must tile the input dimension {shape[1]} of '{tensor}' (shape "
                f"{tuple(shape)}); keep it with --keep '{tensor}' or use an int scheme.",
                tensor,
            )

    def parts(self, shape):
        """The weight's parts, then (NVFP4 activations) ``input_global_scale``: a
        compressed-tensors NVFP4 Linear stores it with the weight, and it has a value
        without calibration (1.0), so ``quantize`` returns it too."""
        out, inp = shape
        ps = [("weight_packed", torch.uint8, (out, inp // 2))]
        sdt = torch.uint8 if self.encoding == fmt.MXFP4 else torch.float8_e4m3fn
        ps.append(("weight_scale", sdt, (out, inp // self.group)))
        if self.encoding == fmt.NVFP4:
            ps.append(("weight_global_scale", torch.float32, (1,)))
        return ps + (self.act.param_parts() if self.act is not None else [])

    def act_parts(self):
        return []  # in parts()

    def dequantize(self, parts):
        """float32 values (compressed-tensors' decompressor gives them in bfloat16)."""
        return self.spec.dequantize(parts, fmt.QuantParams())

    def weight_args(self):
        return {**self.spec.weight_args, "actorder": None, "observer": "minmax"}

    @property
    def format(self):
        return self.spec.name

    def quantize(self, w: torch.Tensor, *, name: str = "weight", global_amax=None):
        """w: [out, in] -> parts. A band of rows at a time: group maxima of |w| on the raw
        bits (exact), scales per group, then ``w / scale`` in float32 into one reused
        buffer, clamped to [-6, 6], rounded to E2M1 codes and packed two per byte.

        global_amax (NVFP4 only): the largest |value| of the weights that share this
        one's global scale (fused q/k/v or gate/up); None: this tensor's own.
        """
        if w.ndim != 2:
            raise ConfigError(f"scheme '{self.name}': '{name}' is not 2-D ({tuple(w.shape)}).")
        out, inp = w.shape
        g = self.group
        if inp % g:
            raise GroupSizeError(
                f"scheme '{self.name}': '{name}' has {inp} columns, not a multiple of {g}.",
                name,
            )
        cdt = w.dtype if w.dtype in _FP4_COMPUTE else torch.float32
        w = w.contiguous() if w.dtype in _SIGNLESS else w.float().contiguous()
        ng = inp // g
        packed = torch.empty(out, inp // 2, dtype=torch.uint8)
        sdt = torch.uint8 if self.encoding == fmt.MXFP4 else torch.float8_e4m3fn
        scale = torch.empty(out, ng, dtype=sdt)
        gscale = None
        if self.encoding == fmt.NVFP4:
            amax = _abs_max(w, name, self) if global_amax is None else global_amax
            gscale = _nv_global_scale(torch.as_tensor(amax, dtype=torch.float32), cdt)
        band = max(1, (1 << 19) // max(1, inp))  # ~512 K elements: 2 MiB of float32
        n = min(out, band) * inp
        fbuf = torch.empty(n, dtype=torch.float32)
        cbuf = torch.empty(n, dtype=torch.uint8)
        rbuf = torch.empty(n, dtype=cdt) if cdt != torch.float32 else None
        for r0 in range(0, out, band):
            r1 = min(out, r0 + band)
            rows, k = r1 - r0, (r1 - r0) * inp
            amax = _group_amax(w[r0:r1], ng, g)
            if not bool(torch.isfinite(amax).all()):
                raise _not_finite(self, name, amax)
            if gscale is None:
                stored, eff = self._mx_scales(amax, name)
            else:
                stored, eff = _nv_scales(amax, gscale, cdt)
                if not bool(torch.isfinite(eff * fmt.FP4_MAX).all()):
                    big = float(amax.max())
                    raise WeightRangeError(
                        f"scheme '{self.name}' cannot represent tensor '{name}': its largest "
                        f"magnitude {big:.4g} dequantizes to infinity (6 x scale / global "
                        f"scale overflows float32); keep it (--keep '{name}')."
                    )
            scale[r0:r1] = stored
            x = fbuf[:k].view(rows, ng, g).copy_(w[r0:r1].view(rows, ng, g))
            x.div_(eff.unsqueeze(-1))
            if gscale is None and rbuf is not None:  # MX: compressed-tensors divides in
                x.copy_(rbuf[:k].view(rows, ng, g).copy_(x))  # the weight's dtype
            x.clamp_(-fmt.FP4_MAX, fmt.FP4_MAX)
            codes = fp4_codes(x.view(rows, inp), out=cbuf[:k].view(rows, inp))
            packed[r0:r1] = pack_fp4(codes)
        parts = {"weight_packed": packed, "weight_scale": scale}
        if gscale is not None:
            parts["weight_global_scale"] = gscale.reshape(1)
        return {**parts, **self.act_values()}

    def _mx_scales(self, amax: torch.Tensor, name: str):
        """(E8M0 exponents uint8, their float32 powers of two) of group maxima ``amax``.

        compressed-tensors' ``generate_mx_scales``: the maximum rounded to a power of two
        (up when its mantissa is >= 1.75: exponent field of ``bits + 2**21``), minus
        floor(log2(6)) = 2, biased by 127 and clamped to [0, 255]; a zero group gets 0.
        """
        e = ((amax.view(torch.int32) + (1 << 21)) >> 23) - 2
        if bool((e >= 253).any()):
            big = float(amax.max())
            raise WeightRangeError(
                f"scheme '{self.name}' cannot represent tensor '{name}': its largest group "
                f"magnitude {big:.4g} needs an E8M0 scale of 2**126 or more, which MXFP4 "
                f"stores as infinity; keep it (--keep '{name}')."
            )
        e = e.clamp_(min=0).to(torch.uint8)
        return e, fmt.e8m0_to_float(e)


def _abs_max(w: torch.Tensor, name: str, scheme: Scheme) -> torch.Tensor:
    """max |w| over the whole tensor (exact, on the raw bits), float32 0-dim."""
    if not w.numel():
        return torch.zeros(())
    itype, mask = _SIGNLESS[w.dtype]
    flat = w.view(-1)
    top = torch.zeros((), dtype=torch.float32)
    step = 1 << 22
    for i in range(0, flat.numel(), step):
        a = torch.bitwise_and(flat[i : i + step].view(itype), mask).amax()
        top = torch.maximum(top, a.view(w.dtype).float())
    if not bool(torch.isfinite(top)):
        raise _not_finite(scheme, name, top.reshape(1))
    return top


def _group_amax(rows: torch.Tensor, ng: int, g: int) -> torch.Tensor:
    """max |x| per group of ``g`` columns of ``rows`` [r, ng * g], float32 [r, ng] (exact:
    the sign bit cleared, the order of non-negative IEEE values is that of their bits)."""
    itype, mask = _SIGNLESS[rows.dtype]
    a = torch.bitwise_and(rows.view(itype), mask)
    return a.view(rows.shape[0], ng, g).amax(-1).view(rows.dtype).float()


def _nv_global_scale(amax: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """compressed-tensors ``generate_gparam``: 448 * 6 / max(amax, tiny) in the weight's
    dtype (the same torch expression, so the same two roundings), NaN / Inf -> 1.0,
    float32 [1]."""
    a = amax.to(cdt).reshape(1)
    a = torch.clamp(a, min=torch.finfo(cdt).tiny)
    g = fmt.FP8_MAX * fmt.FP4_MAX / a
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


def _nv_scales(amax: torch.Tensor, gscale: torch.Tensor, cdt: torch.dtype):
    """(e4m3 scales, float32 effective scales scale / global) of group maxima ``amax``:
    compressed-tensors' ``calculate_qparams`` for a tensor_group FP4 weight (amax / 6 in
    the weight's dtype, times the global scale in float32, rounded to e4m3, zero -> the
    e4m3 eps 0.125)."""
    six = (torch.tensor(2 * fmt.FP4_MAX, dtype=torch.float32).to(cdt) / 2).to(cdt)
    local = amax.to(cdt) / six
    s = gscale * local
    s = torch.clamp(s, -fmt.FP8_MAX, fmt.FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    s = torch.where(s == 0, torch.tensor(0.125, dtype=torch.float32), s)
    return s.to(torch.float8_e4m3fn), s / gscale


def quantize_mxfp4(w: torch.Tensor, *, name: str = "weight") -> dict[str, torch.Tensor]:
    """One weight [out, in] (in a multiple of 32) in the Kimi K3 release's expert
    format: ``{"weight_packed": uint8 [out, in/2], "weight_scale": uint8 [out, in/32]}``,
    byte for byte what compressed-tensors writes for preset scheme MXFP4."""
    return get_scheme("mxfp4").quantize(w, name=name)


# -- registry -------------------------------------------------------------------------
_REGISTRY: dict[str, Scheme] = {}


def register(scheme: Scheme) -> Scheme:
    if scheme.name in _REGISTRY:
        raise ValueError(f"scheme '{scheme.name}' registered twice")
    _REGISTRY[scheme.name] = scheme
    return scheme


def known_schemes() -> list[str]:
    return list(_REGISTRY)


def _known_summary() -> str:
    """The registered names, the int{bits}-g{group}[-asym] grid written as one pattern
    (when it is complete) so the message stays one readable line."""
    grid = {n: re.fullmatch(r"int(\d)-g(\d+)(-asym)?", n) for n in _REGISTRY}
    cells = [m for m in grid.values() if m]
    bits = sorted({m[1] for m in cells}, key=int, reverse=True)
    groups = sorted({m[2] for m in cells}, key=int)
    full = {f"int{b}-g{g}{a}" for b in bits for g in groups for a in ("", "-asym")}
    if not cells or full != {m[0] for m in cells}:
        return ", ".join(_REGISTRY)
    rest = [n for n, m in grid.items() if not m]
    return ", ".join([*rest, f"int{{{','.join(bits)}}}-g{{{','.join(groups)}}}[-asym]"])


def get_scheme(name: str, **options) -> Scheme:
    """The registered scheme ``name``, with ``options`` (e.g. group_size=32) applied."""
    if not isinstance(name, str) or name not in _REGISTRY:
        short = isinstance(name, str) and len(name) <= 60
        shown = f"'{name}'" if short else short_repr(name)
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3) if short else []
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownSchemeError(
            f"unknown quantization scheme {shown}.{hint} Known schemes: {_known_summary()}."
        )
    s = _REGISTRY[name]
    if not options:
        return s
    allowed = s.options()
    bad = [k for k in options if k not in allowed]
    if bad:
        shown = f"'{bad[0]}'" if len(bad[0]) <= 60 else short_repr(bad[0])
        raise ConfigError(
            f"scheme '{name}' has no option {shown}; its options are "
            f"{', '.join(allowed) or 'none'}."
        )
    if isinstance(options.get("block"), list):
        options = {**options, "block": tuple(options["block"])}
    return replace(s, **options)


def _dyn(type_: str, strategy: str = "token", group_size: int | None = None) -> ActivationSpec:
    return ActivationSpec(8, type_, strategy, dynamic=True, group_size=group_size)


_FP8_TOKEN = _dyn("float")
_FP8_GROUP = _dyn("float", "group", 128)
_INT8_TOKEN = _dyn("int")
_FP8_STATIC = ActivationSpec(8, "float", "tensor", dynamic=False)
#: NVFP4 inputs: FP4 per 16 channels, local e4m3 scales computed on the fly, one global
#: scale per Linear (``input_global_scale``)
_NVFP4_ACT = ActivationSpec(
    4, "float", "tensor_group", dynamic="local", group_size=16, scale_dtype="float8_e4m3fn"
)

# Presets as users know them (llm-compressor / compressed-tensors names).
for _s in (
    FP8Scheme("fp8", _FP8_STATIC, strategy="tensor"),
    FP8Scheme("fp8-dynamic", _FP8_TOKEN, strategy="channel"),
    FP8Scheme("fp8-block", _FP8_GROUP, strategy="block"),
    FP8Scheme("fp8-block-ue8m0", _FP8_GROUP, strategy="block", scale_fmt="ue8m0"),
    IntScheme("w8a8", _INT8_TOKEN, num_bits=8, strategy="channel", scale_dtype="float32"),
    IntScheme("w8a8-g128", _INT8_TOKEN, num_bits=8, group_size=128, scale_dtype="float32"),
    IntScheme("w4a16", num_bits=4),
    IntScheme("w4a16-asym", num_bits=4, symmetric=False),
    IntScheme("w4a8-fp8", _FP8_TOKEN, num_bits=4),
    IntScheme("w3a16", num_bits=3),
    IntScheme("w2a16", num_bits=2),
    FP4Scheme("mxfp4", encoding=fmt.MXFP4),
    FP4Scheme("nvfp4a16", encoding=fmt.NVFP4),
    FP4Scheme("nvfp4", _NVFP4_ACT, encoding=fmt.NVFP4),
    # weight-only building blocks
    FP8Scheme("fp8-tensor", strategy="tensor"),
    FP8Scheme("fp8-channel", strategy="channel"),
    FP8Scheme("fp8-block-w", strategy="block"),
    IntScheme("int8-channel", num_bits=8, strategy="channel", scale_dtype="float32"),
):
    register(_s)
for _b in (8, 4, 3, 2):
    for _g in (32, 64, 128):
        register(IntScheme(f"int{_b}-g{_g}", num_bits=_b, group_size=_g))
        register(IntScheme(f"int{_b}-g{_g}-asym", num_bits=_b, group_size=_g, symmetric=False))

"""FP8 weights (per tensor, channel, group or 128x128 block; float32 or ue8m0 scales)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ... import formats as fmt
from ...errors import (
    ConfigError,
    short_repr,
)
from ...formats import FP8_MAX
from .base import (
    _F32_MAX,
    _SIGNLESS,
    Scheme,
    Support,
    _finite_scale,
    _not_finite,
    _one_of,
    _out_of_range,
    _positive_int,
)


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

    @property
    def support(self) -> Support:
        """vLLM's FP8 kernels by strategy and activations; GPTQ rounds to e4m3 against
        the fixed scales; no weight observer (the scale is the range's); an MXFP4
        release is transcoded from its bytes, and held exactly by block scales (a 128 x
        128 block spans a few binades of E8M0 exponents, e4m3 with its power-of-two scale
        17; one scale per row or tensor may not reach a row's smallest groups)."""
        if self.strategy == "block":
            kernel = "fp8-block"
        elif self.act is None:
            kernel = "fp8-w8a16"
        else:
            kernel = "fp8-w8a8-dynamic" if self.act.dynamic else "fp8-w8a8-static"
        holds = (fmt.MXFP4,) if self.strategy == "block" else ()
        return Support(kernel=kernel, verify_family="fp8", gptq="fp8",
                       transcodes=(fmt.MXFP4,), holds=holds)  # fmt: skip

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

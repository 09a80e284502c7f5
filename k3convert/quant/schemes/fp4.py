"""FP4 weights: MXFP4 (E8M0 scales per 32) and NVFP4 (e4m3 scales per 16 under a global
scale)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import formats as fmt
from ...errors import (
    ConfigError,
    GroupSizeError,
    WeightRangeError,
)
from ...formats.fp4 import fp4_codes, pack_fp4
from .base import _SIGNLESS, Scheme, Support, _not_finite

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
    #: how each group's scale is chosen: ``minmax`` (its largest |value|, as
    #: compressed-tensors) or ``mse`` (the stored scale codes around it searched for the
    #: smallest error, :mod:`k3convert.quant.fp4_search`); the parts are the same tensors
    observer: str = "minmax"

    def __post_init__(self):
        if self.observer not in ("minmax", "mse"):
            raise ConfigError(f"weight observer must be minmax or mse, not {self.observer!r}.")

    @property
    def spec(self) -> fmt.Encoding:
        return fmt.FORMATS[self.encoding]

    @property
    def group(self) -> int:
        return self.spec.group

    def options(self) -> dict:
        return {"observer": self.observer}

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
        return {**self.spec.weight_args, "actorder": None, "observer": self.observer}

    @property
    def support(self) -> Support:
        """MXFP4 weights (vLLM's W4A16 MXFP4 kernels) or NVFP4 with or without its
        activations, each its own verify family; GPTQ rounds to E2M1 against the fixed
        scales; minmax or mse scales; an MXFP4 release is held exactly (NVFP4 is
        transcoded from its bytes; MXFP4 is copied as stored)."""
        if self.encoding == fmt.MXFP4:
            kernel, family, transcodes = "mxfp4-a16", "mxfp4", ()
        elif self.act is not None:
            kernel, family, transcodes = "nvfp4", "nvfp4", (fmt.MXFP4,)
        else:
            kernel, family, transcodes = "nvfp4-a16", "nvfp4a16", (fmt.MXFP4,)
        return Support(kernel=kernel, verify_family=family, gptq="fp4",
                       observers=("minmax", "mse"), transcodes=transcodes,
                       holds=(fmt.MXFP4,))  # fmt: skip

    @property
    def format(self):
        return self.spec.name

    def quantize(self, w: torch.Tensor, *, name: str = "weight", global_amax=None):
        """w: [out, in] -> parts: :meth:`quantize_rtn`'s, or with the ``mse`` observer
        each group's scale searched (:func:`k3convert.quant.fp4_search.quantize`)."""
        if self.observer == "mse":
            from .. import fp4_search

            return fp4_search.quantize(self, w, name=name, global_amax=global_amax)
        return self.quantize_rtn(w, name=name, global_amax=global_amax)

    def quantize_rtn(self, w: torch.Tensor, *, name: str = "weight", global_amax=None):
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

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

Modules: :mod:`.base` (the :class:`Scheme` interface and the scale checks), :mod:`.fp8`,
:mod:`.intn`, :mod:`.fp4` (one family each); this package holds the registry and the
named presets.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import replace

import torch

from ... import formats as fmt
from ...errors import (
    ConfigError,
    GroupSizeError,
    NonFiniteWeightError,
    UnknownSchemeError,
    WeightRangeError,
    short_repr,
)
from ..activations import ActivationSpec
from .base import Scheme
from .fp4 import FP4Scheme
from .fp8 import FP8Scheme
from .intn import IntScheme

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


def quantize_mxfp4(w: torch.Tensor, *, name: str = "weight") -> dict[str, torch.Tensor]:
    """One weight [out, in] (in a multiple of 32) in the Kimi K3 release's expert
    format: ``{"weight_packed": uint8 [out, in/2], "weight_scale": uint8 [out, in/32]}``,
    byte for byte what compressed-tensors writes for preset scheme MXFP4."""
    return get_scheme("mxfp4").quantize(w, name=name)


__all__ = [
    "FP4Scheme",
    "FP8Scheme",
    "GroupSizeError",
    "IntScheme",
    "NonFiniteWeightError",
    "Scheme",
    "UnknownSchemeError",
    "WeightRangeError",
    "get_scheme",
    "known_schemes",
    "quantize_mxfp4",
    "register",
]

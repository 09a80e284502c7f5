"""Source encodings of a logical weight and their dequantizers.

A released checkpoint stores some weights as several physical tensors: DeepSeek-V3 /
Kimi-K2 FP8 blocks (``weight`` e4m3 + ``weight_scale_inv``), compressed-tensors
pack-quantized int-N (``weight_packed`` + ``weight_scale`` + ``weight_shape`` [+
``weight_zero_point``]) as shipped for Kimi-K2-Thinking, and compressed-tensors
float/int-quantized (``weight`` fp8/int8 + ``weight_scale`` [+ zero point]). The reader
groups those parts under one logical name (``...weight``) and each encoding below
knows its parts, its logical shape and how to dequantize. Activation parameters
(``input_scale`` ...) ride along as parts; they do not change the weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError
from ..quant.packing import unpack_int32

#: suffixes that attach to a weight instead of being tensors of their own
ACTIVATION_PARTS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale")
WEIGHT_PARTS = (
    "weight",
    "weight_scale_inv",
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "weight_g_idx",
    "weight_global_scale",
)
ALL_PARTS = WEIGHT_PARTS + ACTIVATION_PARTS


@dataclass(frozen=True)
class QuantParams:
    """What config.json says about a weight's quantization (may be partly unknown)."""

    num_bits: int | None = None
    block: tuple[int, int] | None = None  # (rows, cols) covered by one scale
    symmetric: bool | None = None
    extra: dict = field(default_factory=dict)


def scale_block(
    scale_shape: tuple[int, ...], shape: tuple[int, ...], block: tuple[int, int] | None
) -> tuple[int, int]:
    """Rows x cols of weight covered by one scale; ValueError if they do not tile.

    ``block`` comes from config.json when known; otherwise ``ceil(dim / scale_dim)``,
    which is exact whenever the dims divide.
    """
    out, inp = shape
    if block is not None and min(block) < 1:
        raise ValueError(f"block {tuple(block)} is not positive")
    if len(scale_shape) == 0 or math.prod(scale_shape) == 1:
        return out, inp
    s0, s1 = (scale_shape[0], 1) if len(scale_shape) == 1 else tuple(scale_shape[:2])
    if len(scale_shape) > 2:
        raise ValueError(f"scale shape {tuple(scale_shape)} is not 1-D or 2-D")
    if not block and 0 in (s0, s1, out, inp):
        raise ValueError(f"scale shape {tuple(scale_shape)} or weight {tuple(shape)} is empty")
    b0 = block[0] if block else math.ceil(out / s0)
    b1 = block[1] if block else math.ceil(inp / s1)
    if b0 == 1 and s0 == out and block and block[0] == 1 and s1 == 1:
        b1 = inp  # per-channel scale under a group config
    if math.ceil(out / b0) != s0 or math.ceil(inp / b1) != s1:
        raise ValueError(
            f"scale shape {tuple(scale_shape)} does not tile weight {tuple(shape)} in "
            f"blocks of {b0}x{b1}"
        )
    return b0, b1


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None):
    """Broadcast a per-block scale to ``shape`` [out, in] (float32).

    scale: [] | [1] | [out, 1] | [out, n_groups] | [ceil(out/b0), ceil(in/b1)]
    """
    out, inp = shape
    b0, b1 = scale_block(tuple(scale.shape), shape, block)
    s = scale.float()
    if (b0, b1) == (out, inp):
        return s.reshape(1, 1).expand(out, inp)
    s = s.reshape(math.ceil(out / b0), math.ceil(inp / b1))
    return s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]


PartSig = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # part -> (shape, dtype)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Encoding:
    """One way a logical weight is stored.

    Detected when every ``required`` part is present, no ``forbidden`` one is, and the
    ``weight`` part (if the encoding has one) has one of ``weight_dtypes``.
    ``scale_part`` holds the scales; ``shape_part`` is where the logical shape comes
    from ("weight": that part's shape; "weight_shape": that part's data, 2 ints).
    ``default_block`` applies when config.json does not say the block size.
    """

    name: str
    required: tuple[str, ...]
    forbidden: tuple[str, ...]
    dequantize: Callable[[Mapping[str, torch.Tensor], QuantParams], torch.Tensor]
    description: str
    scale_part: str = "weight_scale"
    shape_part: str = "weight"
    weight_dtypes: tuple[torch.dtype, ...] | None = None
    default_block: tuple[int, int] | None = None

    def matches(self, parts: PartSig) -> bool:
        if not all(p in parts for p in self.required):
            return False
        if any(p in parts for p in self.forbidden):
            return False
        return self.weight_dtypes is None or parts["weight"][1] in self.weight_dtypes


def _deq_fp8_block(p: Mapping[str, torch.Tensor], q: QuantParams) -> torch.Tensor:
    w = p["weight"]
    return w.float() * expand_scale(p["weight_scale_inv"], tuple(w.shape), q.block)


def _deq_scaled(p: Mapping[str, torch.Tensor], q: QuantParams) -> torch.Tensor:
    w = p["weight"].float()
    if "weight_zero_point" in p:
        w = w - expand_scale(p["weight_zero_point"], tuple(w.shape), q.block)
    return w * expand_scale(p["weight_scale"], tuple(w.shape), q.block)


def _packed_shape(p) -> tuple[int, int]:
    ws = p["weight_shape"]
    if isinstance(ws, torch.Tensor):
        return tuple(int(x) for x in ws.tolist())
    return tuple(ws)


def infer_num_bits(n_cols: int, packed_cols: int) -> int | None:
    """The unique bit width b with ceil(n_cols*b/32) == packed_cols, or None."""
    hits = [b for b in range(1, 9) if math.ceil(n_cols * b / 32) == packed_cols]
    return hits[0] if len(hits) == 1 else None


def _deq_packed(p: Mapping[str, torch.Tensor], q: QuantParams) -> torch.Tensor:
    out, inp = _packed_shape(p)
    packed = p["weight_packed"]
    bits = q.num_bits or infer_num_bits(inp, packed.shape[-1])
    if bits is None:
        raise ValueError("cannot tell the bit width; config.json has no num_bits for it")
    vals = unpack_int32(packed, bits, (out, inp)).float()
    scale = p["weight_scale"]
    if "weight_zero_point" in p:
        zshape = tuple(scale.shape)
        if len(zshape) != 2 or p["weight_zero_point"].dim() != 2:
            raise ValueError(
                f"zero points {tuple(p['weight_zero_point'].shape)} packed along dim 0 need "
                f"2-D zero points and scales (scale is {zshape})"
            )
        zp = unpack_int32(p["weight_zero_point"], bits, zshape, packed_dim=0)
        vals = vals - expand_scale(zp, (out, inp), q.block)
    return vals * expand_scale(scale, (out, inp), q.block)


ENCODINGS: dict[str, Encoding] = {
    e.name: e
    for e in (
        Encoding(
            "fp8-block",
            ("weight", "weight_scale_inv"),
            ("weight_scale", "weight_packed"),
            _deq_fp8_block,
            "DeepSeek-V3 FP8 e4m3 with one fp32 (or ue8m0) scale per 128x128 block",
            scale_part="weight_scale_inv",
            weight_dtypes=FP8_DTYPES,
            default_block=(128, 128),
        ),
        Encoding(
            "pack-quantized",
            ("weight_packed", "weight_scale", "weight_shape"),
            ("weight",),
            _deq_packed,
            "compressed-tensors int-N packed into int32 with group/channel scales",
            shape_part="weight_shape",
        ),
        Encoding(
            "float-quantized",
            ("weight", "weight_scale"),
            ("weight_packed", "weight_scale_inv"),
            _deq_scaled,
            "compressed-tensors FP8 weight with tensor/channel/group/block scales",
            weight_dtypes=FP8_DTYPES,
        ),
        Encoding(
            "int-quantized",
            ("weight", "weight_scale"),
            ("weight_packed", "weight_scale_inv"),
            _deq_scaled,
            "compressed-tensors int8 weight with scales (and optional zero point)",
            weight_dtypes=(torch.int8,),
        ),
    )
}


def detect_encoding(logical: str, parts: PartSig) -> Encoding | None:
    """The encoding of a group of parts; None for a plain tensor. Errors if ambiguous."""
    if set(parts) <= {"weight", *ACTIVATION_PARTS} and "weight" in parts:
        return None
    hits = [e for e in ENCODINGS.values() if e.matches(parts)]
    if len(hits) != 1:
        known = ", ".join(f"{e.name}: {'+'.join(e.required)}" for e in ENCODINGS.values())
        raise CheckpointError(
            f"tensor '{logical}': parts {sorted(parts)} match "
            f"{'several' if hits else 'no'} known encodings ({known})."
        )
    return hits[0]

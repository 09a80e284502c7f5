"""Part names and roles, format constants and what config.json says about a weight:
the vocabulary the registry and the codecs share (imports nothing of k3convert)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

VALUES = "values"


SCALE = "scale"


ZERO_POINT = "zero_point"


GLOBAL_SCALE = "global_scale"


SHAPE = "shape"


G_IDX = "g_idx"


ACTIVATION = "activation"


#: the role of every part suffix k3convert knows
PART_ROLES: dict[str, str] = {
    "weight": VALUES,
    "weight_scale_inv": SCALE,
    "weight_packed": VALUES,
    "weight_scale": SCALE,
    "weight_shape": SHAPE,
    "weight_zero_point": ZERO_POINT,
    "weight_g_idx": G_IDX,
    "weight_global_scale": GLOBAL_SCALE,
    "input_scale": ACTIVATION,
    "input_zero_point": ACTIVATION,
    "input_global_scale": ACTIVATION,
    "output_scale": ACTIVATION,
}


#: suffixes that attach to a weight instead of being tensors of their own
ACTIVATION_PARTS = tuple(p for p, r in PART_ROLES.items() if r == ACTIVATION)


WEIGHT_PARTS = tuple(p for p, r in PART_ROLES.items() if r != ACTIVATION)


ALL_PARTS = WEIGHT_PARTS + ACTIVATION_PARTS


#: activation parameters, by what they hold: a static per-tensor scale (and zero point)
#: of a calibrated FP8 / INT8 input, the global scale of an NVFP4 input
INPUT_SCALE = "input_scale"


INPUT_ZERO_POINT = "input_zero_point"


INPUT_GLOBAL_SCALE = "input_global_scale"


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


FP4_MAX = 6.0  # largest E2M1 magnitude


MX_GROUP = 32  # OCP MX: one E8M0 exponent per 32 values


NV_GROUP = 16  # NVFP4: one e4m3 scale per 16 values


E8M0_BIAS = 127


PartSig = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # part -> (shape, dtype)


@dataclass(frozen=True, slots=True)
class QuantParams:
    """What config.json says about a weight's quantization (may be partly unknown)."""

    num_bits: int | None = None
    block: tuple[int, int] | None = None  # (rows, cols) covered by one scale
    symmetric: bool | None = None
    extra: dict = field(default_factory=dict)

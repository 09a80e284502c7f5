"""Float dtype names, defined once: torch's (``config.json``'s ``torch_dtype``, a scheme's
``scale_dtype``) and the short ones the command line takes."""

from __future__ import annotations

import torch

#: torch's names of the float dtypes a checkpoint is stored or computed in
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: the command line's short name of each
SHORT_NAMES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
SHORT_DTYPES: dict[str, torch.dtype] = {SHORT_NAMES[k]: v for k, v in FLOAT_DTYPES.items()}


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of floating-point ``t`` is finite, in one reduction that
    allocates nothing: min and max propagate NaN, and are finite exactly when every value
    is. (FP8 e4m3 has no inf, and no ``aminmax``: callers test its NaN code.)"""
    if not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))

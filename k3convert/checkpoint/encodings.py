"""Source encodings of a logical weight and their dequantizers (names kept for callers).

The facts themselves - parts, roles, detection, logical shape, geometry checks,
dequantizers, split granules - are in the one registry :mod:`k3convert.formats`; this
module re-exports the names the reader, the stream and older code import from here.
"""

from __future__ import annotations

from ..formats import (
    ACTIVATION_PARTS,
    ALL_PARTS,
    ENCODINGS,
    FORMATS,
    FP8_DTYPES,
    WEIGHT_PARTS,
    Encoding,
    PartSig,
    QuantParams,
    detect_encoding,
    expand_scale,
    infer_num_bits,
    scale_block,
)

__all__ = [
    "ACTIVATION_PARTS",
    "ALL_PARTS",
    "ENCODINGS",
    "FORMATS",
    "FP8_DTYPES",
    "WEIGHT_PARTS",
    "Encoding",
    "PartSig",
    "QuantParams",
    "detect_encoding",
    "expand_scale",
    "infer_num_bits",
    "scale_block",
]

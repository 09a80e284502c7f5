"""Checkpoint readers: lazy, validated, one tensor at a time.

``open_checkpoint(path)`` gives a :class:`Checkpoint` over a Hugging Face directory
(safetensors, sharded with an index, or torch .bin through the safe unpickler only).
"""

from .encodings import ENCODINGS, Encoding, QuantParams
from .reader import Checkpoint, FileInfo, PartMeta, TensorMeta, load_json, open_checkpoint
from .safetensors_io import read_header

__all__ = [
    "ENCODINGS",
    "Checkpoint",
    "Encoding",
    "FileInfo",
    "PartMeta",
    "QuantParams",
    "TensorMeta",
    "load_json",
    "open_checkpoint",
    "read_header",
]

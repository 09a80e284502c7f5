"""FP4 (MXFP4 / NVFP4) decode through one lookup table per (scale code, byte) pair.

Why: the K3 release stores ~1.4 TB of MXFP4 experts, and decoding them as "unpack the
nibbles to floats, build the scales, multiply" walks every value three or four times
through freshly allocated float tensors. Here a packed byte (two E2M1 nibbles) and the
8-bit code of its group's scale (an E8M0 exponent, or an e4m3 scale viewed as uint8)
together pick ONE word of a 65536-entry table holding both output values already
scaled: the index is ``scale_code << 8 | byte`` and the gather writes the result.

The table is built by the reference dequantizer itself (:mod:`k3convert.formats`'
``mxfp4_reference`` / ``nvfp4_reference``) applied to every (scale code, byte) pair,
so every entry is bit for bit what the reference computes for that pair - and the
reference is elementwise, so a whole tensor decoded through the table is bit-identical
to the reference (tests/test_formats_fp4.py checks both, and the reference against
compressed-tensors' decompressors). Entries are word pairs: two bfloat16 in an int32,
two float32 in an int64 (low nibble first, on a little-endian host; big-endian hosts
keep the reference path).

The gather runs in C where :mod:`k3convert.native` has its kernels (one table load per
byte); otherwise in torch ops. Rows are decoded in chunks into the one output tensor, so
the int32 index buffer stays small (``_CHUNK_BYTES`` packed bytes) and no float32 copy
of the tensor exists: the only allocation the size of the tensor is the result.
"""

from __future__ import annotations

import sys

import torch

from .. import native

#: packed bytes decoded per gather: under torch's intra-op grain (32768 elements), so each
#: op of a chunk runs on the calling thread - on 2 cores shared with other jobs, an
#: OpenMP team waiting on a descheduled thread cost 10x (measured) - and the int32 index
#: (4x this) stays in L2
_CHUNK_BYTES = 32000
#: with one torch thread there is no team to wait on: fewer, larger chunks (less Python)
_CHUNK_BYTES_1T = 1 << 18

#: the output dtype -> the integer dtype holding two of its values
PAIR_WORD = {torch.bfloat16: torch.int32, torch.float32: torch.int64}

LITTLE_ENDIAN = sys.byteorder == "little"


def pair_table(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[256 scale codes, 256 bytes, 2] values in ``dtype`` -> the [65536] word table."""
    if tuple(values.shape) != (256, 256, 2) or values.dtype != dtype:
        raise ValueError(f"a pair table needs [256, 256, 2] {dtype}, got {values.dtype}"
                         f"{list(values.shape)}")  # fmt: skip
    return values.contiguous().view(PAIR_WORD[dtype]).reshape(65536)


def decode(
    packed: torch.Tensor, codes: torch.Tensor, group: int, table: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """uint8 ``packed`` [out, in/2] with uint8 scale ``codes`` [out, in/group] -> the
    [out, in] ``dtype`` values ``table`` holds for each (code, byte)."""
    out, cols = packed.shape
    if codes.shape != (out, 2 * cols // group):
        raise ValueError(f"scale codes {list(codes.shape)} do not hold one per {group} values")
    res = torch.empty(out, cols, dtype=PAIR_WORD[dtype])
    key = codes.contiguous().view(-1).to(torch.int32)
    if out and cols and native.gather(packed.contiguous(), key, table, res):
        return res.view(dtype).view(out, 2 * cols)
    keyed_gather(packed, codes, table, res)
    return res.view(dtype).view(out, 2 * cols)


def keyed_gather(packed: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                 res: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``res[r, c] = table[keys[r, c // per] << 8 | packed[r, c]]`` in torch ops, a chunk of
    rows at a time: uint8 ``packed`` [out, cols], integer ``keys`` [out, cols / per],
    ``res`` [out, cols] of the table's dtype."""
    out, cols = packed.shape
    ng = keys.shape[1]
    per = cols // ng
    chunk = _CHUNK_BYTES_1T if torch.get_num_threads() == 1 else _CHUNK_BYTES
    rows = max(1, chunk // max(cols, 1))
    idx = torch.empty(min(rows, out), ng, per, dtype=torch.int32)
    shifted = torch.empty(min(rows, out), ng, 1, dtype=torch.int32)
    for r0 in range(0, out, rows):
        r1 = min(out, r0 + rows)
        n = r1 - r0
        sh = shifted[:n]
        sh.copy_(keys[r0:r1].unsqueeze(-1)).bitwise_left_shift_(8)
        ix = idx[:n]
        ix.copy_(packed[r0:r1].reshape(n, ng, per)).bitwise_or_(sh)  # measured 20 % faster
        # than one bitwise_or promoting the bytes
        torch.index_select(table, 0, ix.view(-1), out=res[r0:r1].view(-1))
    return res

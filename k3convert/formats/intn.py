"""Int-N values packed in int32 words (compressed-tensors ``pack-quantized``).

The layout is the one compressed-tensors' ``pack-quantized`` format uses, so its own
loader reads what we write and we read what it writes: signed ``num_bits`` values are
offset by ``2**(num_bits-1)`` to unsigned, element ``i`` of a row occupies bits
``[i*num_bits, (i+1)*num_bits)`` of the row's little-endian bit stream (values may
straddle a 32-bit word for 3/5/6/7 bits), and a row of ``n`` values takes
``ceil(n*num_bits/32)`` words. ``packed_dim=0`` packs along columns instead (used for
zero points). Vectorised: one gather / scatter per call, no Python loop over elements.
"""

from __future__ import annotations

import math

import torch

_MASK32 = (1 << 32) - 1


def packed_len(n: int, num_bits: int) -> int:
    """Number of int32 words that hold ``n`` values of ``num_bits`` bits."""
    return math.ceil(n * num_bits / 32)


def _bit_positions(n: int, num_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.arange(n, dtype=torch.int64) * num_bits
    return starts // 32, starts % 32


def pack_int32(values: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack signed ``values`` (any int dtype, in ``[-2**(b-1), 2**(b-1)-1]``) into int32.

    values: [rows, n] -> [rows, ceil(n*b/32)] (packed_dim=1)
            [n, cols] -> [ceil(n*b/32), cols] (packed_dim=0)
    """
    if not 1 <= num_bits <= 8:
        raise ValueError(f"num_bits must be in [1, 8], got {num_bits}")
    if values.ndim != 2:
        raise ValueError(f"pack_int32 expects a 2-D tensor, got shape {tuple(values.shape)}")
    if num_bits in (1, 2, 4, 8) and packed_dim == 1 and values.dtype == torch.int8:
        return _pack_bytes(values, num_bits)
    v = values.to(torch.int64) + (1 << (num_bits - 1))
    lo_v, hi_v = 0, (1 << num_bits) - 1
    if v.numel() and (int(v.min()) < lo_v or int(v.max()) > hi_v):
        raise ValueError(f"values out of range for signed {num_bits}-bit packing")
    if packed_dim == 0:
        v = v.t()
    rows, n = v.shape
    words = packed_len(n, num_bits)
    word, off = _bit_positions(n, num_bits)
    out = torch.zeros(rows, words + 1, dtype=torch.int64)
    out.scatter_add_(1, word.expand(rows, n), (v << off) & _MASK32)
    spill = off + num_bits > 32
    if bool(spill.any()):
        idx = (word[spill] + 1).expand(rows, -1)
        out.scatter_add_(1, idx, v[:, spill] >> (32 - off[spill]))
    out = out[:, :words] & _MASK32
    out = torch.where(out >= (1 << 31), out - (1 << 32), out).to(torch.int32)
    if packed_dim == 0:
        out = out.t()
    return out.contiguous()


def _pack_bytes(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Fast path of :func:`pack_int32` for 1/2/4/8 bits along rows (same output).

    Widths dividing 8 never straddle a byte, so values are OR-ed into bytes (uint8
    arithmetic, no int64 temporaries) and each row's bytes, zero-padded to whole words,
    are reinterpreted as little-endian int32 words - the same dense bit stream.
    """
    lo, hi = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    if values.numel() and (int(values.min()) < lo or int(values.max()) > hi):
        raise ValueError(f"values out of range for signed {num_bits}-bit packing")
    rows, n = values.shape
    per = 8 // num_bits
    words = packed_len(n, num_bits)
    u = (values.view(torch.uint8) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    pad = words * 4 * per - n
    if pad:
        u = torch.cat([u, u.new_zeros(rows, pad)], dim=1)
    u = u.view(rows, words * 4, per)
    out = u[:, :, 0].clone()
    for j in range(1, per):
        out |= u[:, :, j] << (j * num_bits)
    if torch.tensor([1], dtype=torch.int32).view(torch.uint8)[0] != 1:  # big-endian host
        return pack_int32(values.to(torch.int16), num_bits)
    return out.contiguous().view(torch.int32)


#: the host stores int32 words little-endian (the packed bit stream's byte order)
_LITTLE = torch.tensor([1], dtype=torch.int32).view(torch.uint8)[0].item() == 1


def _unpack_bytes(p: torch.Tensor, num_bits: int, rows: int, n: int) -> torch.Tensor:
    """Fast path of :func:`unpack_int32` for 1/2/4/8 bits (the inverse of
    :func:`_pack_bytes`, same output): each row's words as little-endian bytes, each
    byte's ``8 / num_bits`` fields in order (uint8 arithmetic, no int64 temporaries), the
    offset taken off modulo 256 and the bytes read as int8."""
    # [rows, 4 * words] (flattened first: a tensor with a size-1 dim can count as
    # contiguous with a last stride other than 1, which a dtype view refuses)
    b = p.contiguous().reshape(-1).view(torch.uint8).view(rows, -1)
    per = 8 // num_bits
    if per == 1:
        u = b.clone()
    else:
        mask = (1 << num_bits) - 1
        u = torch.empty(rows, b.shape[1], per, dtype=torch.uint8)
        for j in range(per):
            torch.bitwise_and(b >> (j * num_bits), mask, out=u[:, :, j])
        u = u.view(rows, -1)
    u = u[:, :n].sub_(1 << (num_bits - 1))  # stored = value + 2**(bits - 1), mod 256
    return u.view(torch.int8)


def unpack_int32(
    packed: torch.Tensor, num_bits: int, shape: tuple[int, int], packed_dim: int = 1
) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 words -> signed int8 values of ``shape``."""
    if not 1 <= num_bits <= 8:
        raise ValueError(f"num_bits must be in [1, 8], got {num_bits}")
    if packed.dtype != torch.int32:
        raise ValueError(f"packed data must be int32, got {packed.dtype}")
    rows, n = (shape[1], shape[0]) if packed_dim == 0 else (shape[0], shape[1])
    p = packed.t() if packed_dim == 0 else packed
    want = packed_len(n, num_bits)
    if tuple(p.shape) != (rows, want):
        raise ValueError(
            f"packed shape {tuple(packed.shape)} does not hold {tuple(shape)} values of "
            f"{num_bits} bits packed along dim {packed_dim}"
        )
    if 8 % num_bits == 0 and _LITTLE:
        vals = _unpack_bytes(p, num_bits, rows, n)
        return (vals.t() if packed_dim == 0 else vals).contiguous()
    w = p.to(torch.int64) & _MASK32
    w = torch.cat([w, torch.zeros(rows, 1, dtype=torch.int64)], dim=1)
    word, off = _bit_positions(n, num_bits)
    lo = torch.gather(w, 1, word.expand(rows, n)) >> off
    hi = torch.gather(w, 1, (word + 1).expand(rows, n)) << (32 - off)
    vals = ((lo | hi) & ((1 << num_bits) - 1)) - (1 << (num_bits - 1))
    vals = vals.to(torch.int8)
    return (vals.t() if packed_dim == 0 else vals).contiguous()

"""Dense bit-packing of low-bit values: int-N in int32 words, FP4 E2M1 in bytes.

Int-N (compressed-tensors ``pack-quantized``):

The layout is the one compressed-tensors' ``pack-quantized`` format uses, so its own
loader reads what we write and we read what it writes: signed ``num_bits`` values are
offset by ``2**(num_bits-1)`` to unsigned, element ``i`` of a row occupies bits
``[i*num_bits, (i+1)*num_bits)`` of the row's little-endian bit stream (values may
straddle a 32-bit word for 3/5/6/7 bits), and a row of ``n`` values takes
``ceil(n*num_bits/32)`` words. ``packed_dim=0`` packs along columns instead (used for
zero points). Vectorised: one gather / scatter per call, no Python loop over elements.

FP4 E2M1 (compressed-tensors ``mxfp4-pack-quantized`` / ``nvfp4-pack-quantized``): a
code is ``sign << 3 | index`` with index 0..7 the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6;
two codes per byte, the even column in the LOW nibble. :func:`fp4_codes` rounds to the
nearest E2M1 value with ties to the even index (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, which is compressed-tensors' ``cast_to_fp4``),
and a value below zero keeps its sign even when it rounds to zero (-0.1 -> code 8),
while -0.0 itself is code 0 (``cast_to_fp4`` multiplies by ``sign(x)``, which is 0 there).
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
    w = p.to(torch.int64) & _MASK32
    w = torch.cat([w, torch.zeros(rows, 1, dtype=torch.int64)], dim=1)
    word, off = _bit_positions(n, num_bits)
    lo = torch.gather(w, 1, word.expand(rows, n)) >> off
    hi = torch.gather(w, 1, (word + 1).expand(rows, n)) << (32 - off)
    vals = ((lo | hi) & ((1 << num_bits) - 1)) - (1 << (num_bits - 1))
    vals = vals.to(torch.int8)
    return (vals.t() if packed_dim == 0 else vals).contiguous()


# -- FP4 E2M1 -------------------------------------------------------------------------
#: E2M1 magnitudes by index; codes 8..15 are their negatives (8 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
#: byte -> (value of the low nibble, value of the high nibble)
_BYTE_LUT = torch.stack(
    [_E2M1[torch.arange(256) & 15], _E2M1[torch.arange(256) >> 4]], dim=1
).contiguous()


def _e2m1_index(v: float) -> int:
    """Index of the E2M1 magnitude nearest to ``v`` >= 0, a tie to the even index."""
    d = [abs(v - m) for m in E2M1_VALUES]
    best = min(d)
    return min(i for i, x in enumerate(d) if x == best and (d.count(best) == 1 or i % 2 == 0))


#: every rounding boundary (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is a multiple of 1/4, so
#: the index is constant on each open quarter (k/4, (k+1)/4): entry 2k holds it, entry
#: 2k + 1 the index of k/4 itself (0 <= k <= 24, |x| <= 6)
_QUARTER_LUT = torch.tensor(
    [_e2m1_index(k / 4 + (j == 0) / 8) for k in range(26) for j in (0, 1)], dtype=torch.uint8
)


def fp4_codes(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 codes (uint8, ``sign << 3 | index``) of float32 ``x``, already clamped to
    [-6, 6]: round to nearest, ties to the even index (see the module docstring).

    One gather: key = 2 * floor(4|x|) + (4|x| is an integer) into a 52-entry table.
    out: an optional uint8 tensor of x's shape to write into. ``x`` is left unchanged.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"fp4_codes expects float32 values, got {x.dtype}")
    a = x.abs().mul_(4)  # exact: a power of two
    f = torch.floor(a)
    key = f.to(torch.int32).mul_(2).add_(torch.eq(a, f))
    idx = _QUARTER_LUT.index_select(0, key.view(-1)).view(x.shape)
    codes = idx if out is None else out.copy_(idx)
    return codes.bitwise_or_((x < 0).to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, n] (n even) -> bytes [rows, n/2], even column in the low nibble."""
    if codes.ndim != 2 or codes.shape[1] % 2:
        raise ValueError(f"pack_fp4 expects [rows, even n] codes, got {tuple(codes.shape)}")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


#: byte -> its two values as one word (float32 pairs in an int64, bfloat16 pairs in an
#: int32): one gather per byte, viewed back as the float dtype (low nibble first)
_PAIR_LUT = {
    torch.float32: _BYTE_LUT.contiguous().view(torch.int64).reshape(256),
    torch.bfloat16: _BYTE_LUT.to(torch.bfloat16).contiguous().view(torch.int32).reshape(256),
}


def unpack_fp4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 bytes [rows, cols] -> E2M1 values [rows, 2 * cols] in ``dtype`` (float32 or
    bfloat16; both exact)."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(
            f"FP4 data must be uint8 [rows, cols], got {packed.dtype}{list(packed.shape)}"
        )
    if dtype not in _PAIR_LUT:
        raise ValueError(f"unpack_fp4 gives float32 or bfloat16, not {dtype}")
    rows, cols = packed.shape
    idx = packed.reshape(-1).to(torch.int32)
    if torch.tensor([1], dtype=torch.int16).view(torch.uint8)[0] != 1:  # big-endian host
        return _BYTE_LUT.index_select(0, idx).view(rows, 2 * cols).to(dtype)
    return _PAIR_LUT[dtype].index_select(0, idx).view(dtype).view(rows, 2 * cols)

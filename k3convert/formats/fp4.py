"""FP4 E2M1 (MXFP4 / NVFP4): codes, bytes, the reference dequantizers and the table decode.

Codes (compressed-tensors ``mxfp4-pack-quantized`` / ``nvfp4-pack-quantized``): a
code is ``sign << 3 | index`` with index 0..7 the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6;
two codes per byte, the even column in the LOW nibble. :func:`fp4_codes` rounds to the
nearest E2M1 value with ties to the even index (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, which is compressed-tensors' ``cast_to_fp4``),
and a value below zero keeps its sign even when it rounds to zero (-0.1 -> code 8),
while -0.0 itself is code 0 (``cast_to_fp4`` multiplies by ``sign(x)``, which is 0 there).

Decode through one lookup table per (scale code, byte) pair. Why: the K3 release stores
~1.4 TB of MXFP4 experts, and decoding them as "unpack the nibbles to floats, build the
scales, multiply" walks every value three or four times through freshly allocated float
tensors. Here a packed byte (two E2M1 nibbles) and the 8-bit code of its group's scale
(an E8M0 exponent, or an e4m3 scale viewed as uint8) together pick ONE word of a
65536-entry table holding both output values already scaled: the index is ``scale_code
<< 8 | byte`` and the gather writes the result.

The table is built by the reference dequantizer itself (:func:`mxfp4_reference` /
:func:`nvfp4_reference`) applied to every (scale code, byte) pair,
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

import functools
import sys
from collections.abc import Mapping

import torch

from .. import native
from .base import MX_GROUP, NV_GROUP, QuantParams

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


#: E2M1 magnitudes by index; codes 8..15 are their negatives (8 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


E2M1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


#: byte -> (value of the low nibble, value of the high nibble)
_BYTE_LUT = torch.stack(
    [E2M1[torch.arange(256) & 15], E2M1[torch.arange(256) >> 4]], dim=1
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


def _edges() -> torch.Tensor:
    """The 7 rounding edges between E2M1 magnitudes as ``torch.bucketize`` must see them:
    a value on an edge goes to the lower index, so an edge whose tie goes up (to an even
    upper index: 0.75, 1.75, 3.5) is its float32 predecessor."""
    m = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    mid = (m[:-1] + m[1:]) / 2  # exact
    up = torch.arange(1, 8) % 2 == 0
    return torch.where(up, torch.nextafter(mid, torch.zeros(7)), mid)


_E2M1_EDGES = _edges()


def fp4_codes_short(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fp4_codes` by a search of the 7 rounding edges (``torch.bucketize``): the
    same codes (tests/test_formats_fp4.py), in fewer ops: faster on a short vector (a
    GPTQ column: 30 vs 45 us at 2048 values), slower on a long one (the table gather
    wins above ~100 K values)."""
    if x.dtype != torch.float32:
        raise ValueError(f"fp4_codes expects float32 values, got {x.dtype}")
    idx = torch.bucketize(x.abs(), _E2M1_EDGES, out_int32=True)
    codes = idx.to(torch.uint8) if out is None else out.copy_(idx)
    return codes.bitwise_or_((x < 0).to(torch.uint8) << 3)


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


def _fp4_groups(
    p: Mapping[str, torch.Tensor], group: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, int, int]:
    """E2M1 values of ``weight_packed`` as ``dtype`` [out, in / group, group]."""

    out, inp = _check_fp4_groups(p, group)
    return unpack_fp4(p["weight_packed"], dtype).view(out, inp // group, group), out, inp


def _check_fp4_groups(p: Mapping[str, torch.Tensor], group: int) -> tuple[int, int]:
    """(out, in) of an FP4 weight whose ``weight_scale`` holds one scale per ``group``."""
    packed, scale = p["weight_packed"], p["weight_scale"]
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(
            f"FP4 data must be uint8 [rows, cols], got {packed.dtype}{list(packed.shape)}"
        )
    out, cols = packed.shape
    inp = 2 * cols
    if inp % group or tuple(scale.shape) != (out, inp // group):
        raise ValueError(
            f"weight_scale {list(scale.shape)} does not hold one scale per {group} values "
            f"of the {out} x {inp} weight (expected {[out, inp // group]})"
        )
    return out, inp


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8, bias 127) -> their float32 powers of two, exactly.

    0 is 2**-127 (a float32 subnormal), 255 is +inf (as compressed-tensors decodes it).
    """
    e32 = e.to(torch.int32)
    bits = torch.where(e32 == 0, torch.tensor(1 << 22, dtype=torch.int32), e32 << 23)
    return bits.view(torch.float32)


def mxfp4_reference(
    p: Mapping[str, torch.Tensor], q: QuantParams, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """E2M1 x 2**(e - 127): a value of at most 2 significant bits times a power of two,
    exact in float32 and in bfloat16 (same exponent range), so either is computed
    directly. The reference the lookup table of :func:`decode_mxfp4` is built from."""
    vals, out, inp = _fp4_groups(p, MX_GROUP, dtype)
    scale = e8m0_to_float(p["weight_scale"]).to(dtype)
    return vals.mul_(scale.unsqueeze(-1)).view(out, inp)


def nvfp4_reference(
    p: Mapping[str, torch.Tensor], q: QuantParams, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """E2M1 x (scale / global_scale) in float32 (as compressed-tensors computes it),
    rounded to ``dtype`` last. The reference the tables of :func:`decode_nvfp4` are built
    from."""
    vals, out, inp = _fp4_groups(p, NV_GROUP)
    g = p["weight_global_scale"].to(torch.float32).reshape(1, 1)
    eff = p["weight_scale"].to(torch.float32) / g  # compressed-tensors: scale / global
    return vals.mul_(eff.unsqueeze(-1)).view(out, inp).to(dtype)


def all_pairs(scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Parts of a [256, 512] FP4 weight whose row s holds every byte under scale code s
    (one scale per 16 bytes: each byte appears in its own group when viewed [256, 256, 2])."""
    packed = torch.arange(256, dtype=torch.uint8).repeat_interleave(16).repeat(256, 1)
    per = 32 if scale_dtype == torch.uint8 else 16  # values per scale
    codes = torch.arange(256, dtype=torch.uint8).unsqueeze(1).expand(256, 512 * 16 // per)
    return {"weight_packed": packed, "weight_scale": codes.contiguous().view(scale_dtype)}


def _pair_values(vals: torch.Tensor) -> torch.Tensor:
    """[256, 256 * 16 * 2] reference output of :func:`all_pairs` -> [256, 256, 2]."""
    return vals.view(256, 256, 16, 2)[:, :, 0, :].contiguous()


@functools.cache
def mx_values(dtype: torch.dtype) -> torch.Tensor:
    """[256 E8M0 codes, 16 nibbles] ``dtype``: :func:`mxfp4_reference`'s own output for
    each nibble under each code (one MX group per code, byte k holding nibble k low and 0
    high), computed once per dtype."""
    with torch.inference_mode(False):  # plain tensors, whichever mode the first caller runs in
        packed = torch.arange(16, dtype=torch.uint8).repeat(256, 1)
        codes = torch.arange(256, dtype=torch.uint8).unsqueeze(1)
        ref = mxfp4_reference({"weight_packed": packed, "weight_scale": codes}, QuantParams(),
                              dtype)  # fmt: skip
        return ref[:, 0::2].contiguous()


@functools.cache
def _mx_kernel(dtype: torch.dtype) -> torch.Tensor:
    """The decode kernel's table of :func:`mx_values`, once per dtype."""

    with torch.inference_mode(False):
        return native.decode_table(mx_values(dtype), dtype)


@functools.cache
def _mx_pair_table(dtype: torch.dtype) -> torch.Tensor:
    """The MXFP4 pair table of the torch path (without the kernels): the reference on
    every (E8M0 code, byte) pair, once per dtype."""

    with torch.inference_mode(False):
        ref = mxfp4_reference(all_pairs(torch.uint8), QuantParams(), dtype)
        return pair_table(_pair_values(ref), dtype)


def decode_mxfp4(
    p: Mapping[str, torch.Tensor], q: QuantParams, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """:func:`mxfp4_reference` bit for bit: the nibble-table kernel of
    :mod:`k3convert.native` (every output a copy of :func:`mx_values`' entry for its
    code and nibble) where it is available, else one (E8M0 code, byte) pair-table gather
    (:func:`decode`)."""

    if not LITTLE_ENDIAN or dtype not in PAIR_WORD:
        return mxfp4_reference(p, q, dtype)
    _check_fp4_groups(p, MX_GROUP)
    packed, codes = p["weight_packed"].contiguous(), p["weight_scale"].contiguous()
    if packed.numel() and native.ENABLED and native.library() is not None:
        vals = mx_values(dtype)
        got = native.fp4_decode(packed, codes, vals, dtype, MX_GROUP, table=_mx_kernel(dtype))
        if got is not None:
            return got
    return decode(packed, codes, MX_GROUP, _mx_pair_table(dtype), dtype)


def decode_nvfp4(
    p: Mapping[str, torch.Tensor], q: QuantParams, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """:func:`nvfp4_reference` bit for bit: the reference's own float32 ops (scale / global,
    times E2M1, rounded to ``dtype``) on every (e4m3 code, nibble) pair of this tensor's
    global scale, then each value a copy of its pair's: the nibble-table kernel of
    :mod:`k3convert.native` (4096 values per tensor), else a (code, byte) pair-table gather
    (65536 pairs, small next to an expert)."""

    if not LITTLE_ENDIAN or dtype not in PAIR_WORD:
        return nvfp4_reference(p, q, dtype)
    _check_fp4_groups(p, NV_GROUP)

    g = p["weight_global_scale"].to(torch.float32).reshape(1, 1)
    packed, stored = p["weight_packed"].contiguous(), p["weight_scale"].contiguous()
    codes = stored.view(torch.uint8)
    if packed.numel() and native.ENABLED and native.library() is not None:
        vals, table = _nv_kernel(int(g.reshape(()).view(torch.int32)), dtype)
        got = native.fp4_decode(packed, codes, vals, dtype, NV_GROUP, table=table)
        if got is not None:
            return got
    return decode(packed, codes, NV_GROUP, _nv_table(g, dtype), dtype)


#: float32 [256, 1, 1]: the value of each e4m3 byte
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


_E4M3 = _E4M3.reshape(256, 1, 1)


def _nv_eff(g: torch.Tensor) -> torch.Tensor:
    """float32 [256, 1, 1]: the reference's effective scale (scale / global) of each e4m3
    scale byte under global scale ``g``."""
    return _E4M3 / g


def nv_values(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[256 e4m3 codes, 16 nibbles] ``dtype``: the reference's value of each nibble under
    each scale byte (the pair table's entries for the bytes 0..15, low nibble)."""

    vals = torch.empty(256, 16, dtype=dtype)
    torch.mul(_BYTE_LUT[:16, 0].reshape(1, 16), _nv_eff(g).view(256, 1), out=vals)
    return vals


@functools.lru_cache(maxsize=64)
def _nv_kernel(bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nv_values` and the decode kernel's table of them, per (global scale bits,
    dtype): a checkpoint's experts share a few global scales, so each is built once."""

    with torch.inference_mode(False):  # plain tensors, whichever mode the first caller runs in
        g = torch.tensor([bits], dtype=torch.int32).view(torch.float32).reshape(1, 1)
        vals = nv_values(g, dtype)
        return vals, native.decode_table(vals, dtype)


def _nv_table(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (e4m3 code, byte) pair table under global scale ``g``: the reference's own ops."""

    eff = _nv_eff(g)  # the reference's eff, per code
    vals = torch.empty(256, 256, 2, dtype=dtype)
    for c in range(0, 256, 32):  # 16384 products per op: each runs on this thread
        torch.mul(_BYTE_LUT.view(1, 256, 2), eff[c : c + 32], out=vals[c : c + 32])
    return pair_table(vals, dtype)


#: packed bytes per row chunk of :func:`max_codes`' torch path (its int64 words stay in L2)
_MAX_CODES_CHUNK = 1 << 18
#: the low three bits of every byte of a word: E2M1 magnitude codes
_LOW3 = 0x0707070707070707


def max_codes(packed: torch.Tensor, per: int) -> torch.Tensor:
    """uint8 [out, cols] bytes -> the largest E2M1 magnitude code of each ``per`` bytes
    (8 or 16: one NVFP4 / MXFP4 group), uint8 [out, cols / per].

    On 64-bit words (8 bytes, 16 nibbles): the low and the high nibbles' magnitudes in
    byte lanes, their lane-wise maximum, then three folds (the word shifted by 32, 16, 8
    bits, lane-wise maximum), so byte 0 holds the word's maximum - every op elementwise
    and vectorised, where a reduction over 8 contiguous bytes is not (measured 2.5x)."""
    out, cols = packed.shape
    if cols % per or per not in (8, 16):
        raise ValueError(f"max codes of {per} bytes need rows of a multiple of {per} bytes")
    res = torch.empty(out, cols // per, dtype=torch.uint8)
    if native.max_codes(packed.contiguous(), per, res):
        return res
    res = torch.empty(out, cols // 8, dtype=torch.uint8)
    rows = max(1, _MAX_CODES_CHUNK // max(cols, 1))
    n0 = min(rows, out) * cols // 8
    buf = torch.empty(n0, dtype=torch.int64)  # aligned: the source may sit at any offset
    x = torch.empty(n0, dtype=torch.int64)
    y = torch.empty(n0, dtype=torch.int64)
    for r0 in range(0, out, rows):
        r1 = min(out, r0 + rows)
        k = (r1 - r0) * cols // 8
        w = buf[:k]
        w.view(torch.uint8).view(r1 - r0, cols).copy_(packed[r0:r1])
        xs, ys = x[:k], y[:k]
        torch.bitwise_and(w, _LOW3, out=xs)
        torch.bitwise_right_shift(w, 4, out=ys).bitwise_and_(_LOW3)
        xb, yb = xs.view(torch.uint8), ys.view(torch.uint8)
        torch.maximum(xb, yb, out=xb)
        for shift in (32, 16, 8):  # lanes <= 7: the arithmetic shift brings in zeros
            torch.bitwise_right_shift(xs, shift, out=ys)
            torch.maximum(xb, yb, out=xb)
        res[r0:r1] = xb.view(r1 - r0, cols // 8, 8)[:, :, 0]
    if per == 16:
        res = torch.maximum(res[:, 0::2], res[:, 1::2])
    return res

"""MXFP4 weights re-encoded as NVFP4, FP8 or int4 straight from their bytes.

Why: the Kimi K3 release stores its ~1.4 TB of routed experts as MXFP4, and a recipe that
serves them as NVFP4 (or int4 w4a16) would otherwise dequantize every expert to float32
(8 bytes per stored byte) and run the scheme's float arithmetic over it: measured 0.07x
(NVFP4) and 0.18x (int4) of the raw read rate of the same bytes on one core. Here the
output bytes come from one table gather per stored byte, and no float copy of the tensor
exists.

What makes it exact. An MXFP4 value is ``e2m1(nibble) * 2**(e - 127)``, with one E8M0 code
``e`` per 32 values, and E2M1 magnitude codes are ordered like their values (0, 0.5, 1,
1.5, 2, 3, 4, 6), so a group's largest magnitude is the value of its largest magnitude
code ``m``. What the scheme computes for a value therefore depends on a few small
integers only:

* NVFP4 (groups of 16, inside one MX group) holds the MXFP4 values exactly: NVFP4 decodes
  ``e2m1(nibble) * scale / global_scale``, so with a power-of-two global scale ``2**k``
  and each group's e4m3 scale ``2**(e - 127 + k)`` the nibbles are copied unchanged.
  e4m3 holds the powers of two ``2**-9`` (its smallest subnormal) to ``2**8``: ``k`` puts
  the largest E8M0 code of a nonzero group (over a fused set: w1 / w3 share it) at
  ``2**8``, so every group within 17 binades of it is exact. A group further below is
  rounded to the nearest values the smallest scale ``2**-9`` gives (E2M1 round to
  nearest, ties to even, as every FP4 quantizer here) and counted
  (:class:`TranscodeLossWarning`). This is not ``scheme.quantize`` of the decode, whose
  amax-based scales move about half the values (issue 37's measurement: 44 %).
* FP8 (:func:`fp8_exact`): power-of-two scales put a block's largest value at 256 or 384,
  so every value within 17 binades of it is exact in e4m3; whole 128 x 128 blocks come
  from a table of e4m3 bytes (:func:`_fp8_bytes`), no float copy.
* int4 under the ``search`` observer (the default for an MXFP4 source): :mod:`.mx_int4`.
  Under ``minmax`` (symmetric, groups of a multiple of 32): the group's scale on its
  largest value ``amax``; each output nibble on ``amax``'s significand (1 or 1.5: a
  power of two times an E2M1 magnitude), on ``d = e_j - exponent(amax)`` of the value's
  own MX group ``j`` and on the nibble, because ``x / scale`` and the scale's rounding
  are exact under a common power of two while every value is a normal float. The table
  is the scheme's own ``quantize`` on one synthetic group per (significand, d). Outside
  the E8M0 codes where that holds (:data:`INT_CODES`), and for scale dtypes whose range
  is not float32's, :func:`requantize` returns None and the caller takes the float path.

With :mod:`k3convert.native`'s kernels the int4 path is one pass over the bytes (group
maxima, table rows and output nibbles per int group, in C); torch ops otherwise. Where
the caller wants the loss report (``stats``), ``minmax`` runs as the search kernel over
minmax's one candidate (:data:`.mx_int4.MINMAX`): the same bytes, with the loss measured
in the same pass instead of by decoding the output again.

tests/test_fp4_requant.py checks both against ``scheme.quantize`` of the float32 decode,
bit for bit, on random and extreme tensors; tests/test_mx_transcode.py the FP8 and the
int4 search against references written from their definitions.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping

import torch

from .. import formats as fmt
from .. import native
from ..formats import fp4
from ..formats.fp4 import E2M1_VALUES, fp4_codes
from ..formats.intn import unpack_int32
from . import mx_int4
from .schemes import FP4Scheme, FP8Scheme, IntScheme, NonFiniteWeightError, Scheme, WeightRangeError

#: E8M0 codes for which the int path is exact (every nonzero value and scale normal, far
#: from overflow); a tensor with a code outside takes the float path
INT_CODES = (16, 240)
#: the d = e_j - exponent(amax) rows of the int table: below D_LO every value rounds to 0
#: (|x / scale| <= 6 * 2**-7 / (1 / 7.5) < 0.5), above D_HI only zero groups occur
D_LO, D_HI = -7, 2


def supported(scheme: Scheme) -> bool:
    """Whether :func:`requantize` can produce ``scheme`` from MXFP4 parts: the scheme
    declares it (``support.transcodes``); big-endian hosts take the float path (the byte
    tables are little-endian)."""
    return fp4.LITTLE_ENDIAN and fmt.MXFP4 in scheme.support.transcodes


def _gather_bytes(packed: torch.Tensor, rowkey: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """out[r, c] = table[rowkey[r, c // per] << 8 | packed[r, c]]: uint8 [out, cols]."""
    res = torch.empty(packed.shape, dtype=torch.uint8)
    if native.gather(packed.contiguous(), rowkey.contiguous().view(-1), table, res):
        return res
    return fp4.keyed_gather(packed, rowkey, table, res)


def _values() -> torch.Tensor:
    """float32 [256 codes, 16 nibbles]: the reference decode of each nibble under each
    E8M0 code."""
    return fp4.mx_values(torch.float32)


def abs_max_and_top(parts: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, int | None] | None:
    """(max |value| as float32 0-dim, exactly the maximum of the decode; the largest E8M0
    code of a group holding a nonzero value, what an exact NVFP4 global scale is set
    from, None for an all-zero tensor) of MXFP4 parts, from one pass over their group
    maxima; None where the maximum is not finite or the parts are not MXFP4's shapes (the
    float path names the problem)."""
    if not _mx_parts(parts):
        return None
    packed, codes = parts["weight_packed"].contiguous(), parts["weight_scale"].contiguous()
    m = fp4.max_codes(packed, fmt.MX_GROUP // 2)
    hit = _present(codes.to(torch.int32).mul_(8).add_(m))
    if not hit.numel():
        return torch.zeros(()), None
    top = _values()[hit // 8, hit % 8].amax()
    if not bool(torch.isfinite(top)):
        return None
    return top, _top(codes, m)


#: E8M0 codes below this decode every E2M1 value finitely (6 * 2**(252 - 127) < 2**128)
_FINITE_BELOW = 253


def decodes_finite(packed: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether every value of MXFP4 ``packed`` / ``codes`` decodes to a finite float32
    (and bfloat16: the same range): no E8M0 NaN code (255) and no group whose largest
    value overflows (code 254 with a magnitude of 2 or more, 253 with 4 or more). Such a
    release is damaged; the byte paths decline it so that the float path refuses it with
    the tensor's name, under every scheme alike. The codes alone settle the common case."""
    if not codes.numel() or int(codes.amax()) < _FINITE_BELOW:
        return True
    m = fp4.max_codes(packed, fmt.MX_GROUP // 2)
    hit = _present(codes.to(torch.int32).mul_(8).add_(m))
    return bool(torch.isfinite(_values()[hit // 8, hit % 8]).all())


def _mx_parts(parts: Mapping[str, torch.Tensor]) -> bool:
    packed, codes = parts.get("weight_packed"), parts.get("weight_scale")
    if packed is None or codes is None or packed.dtype != torch.uint8 or packed.ndim != 2:
        return False
    out, cols = packed.shape
    return (
        codes.dtype == torch.uint8
        and cols % (fmt.MX_GROUP // 2) == 0
        and tuple(codes.shape) == (out, 2 * cols // fmt.MX_GROUP)
    )


def _present(key: torch.Tensor) -> torch.Tensor:
    """The distinct values of int32 ``key`` (all in [0, 2048)), ascending."""
    return torch.bincount(key.view(-1), minlength=2048).nonzero().view(-1)


class TranscodeLossWarning(UserWarning):
    """An MXFP4 tensor transcoded to NVFP4 where some groups lie below what the shared
    global scale lets e4m3 scales reach: those groups were rounded (see the module doc)."""


def requantize(
    parts: Mapping[str, torch.Tensor],
    scheme: Scheme,
    *,
    name: str = "weight",
    top_code=None,
    stats: dict | None = None,
) -> dict[str, torch.Tensor] | None:
    """MXFP4 ``parts`` (``weight_packed`` uint8 [out, in/2], ``weight_scale`` E8M0 uint8
    [out, in/32]) as ``scheme`` straight from their bytes; None where this path does not
    apply (see the module doc): the caller quantizes the decoded tensor.

    NVFP4: the exact transcode, its global scale from ``top_code`` (the fused set's, from
    :func:`abs_max_and_top`; None: this tensor's own). FP8: :func:`fp8_exact`. int4:
    ``scheme.quantize`` of the float32 decode, bit for bit. stats: ``exact`` set True
    where every value is known to be held (NVFP4 / FP8 transcodes without rounded
    groups); ``loss`` where the transcode measured what it rounded (the int4 search: see
    :func:`.mx_int4.search`)."""
    if not supported(scheme) or not _mx_parts(parts) or not parts["weight_packed"].numel():
        return None
    packed, codes = parts["weight_packed"].contiguous(), parts["weight_scale"].contiguous()
    if not decodes_finite(packed, codes):
        return None  # the float path refuses it, naming the tensor, as every scheme does
    if isinstance(scheme, FP8Scheme):
        return fp8_exact(packed, codes, scheme, name, stats=stats)
    if isinstance(scheme, FP4Scheme):
        res, low = nvfp4_exact(packed, codes, top_code)
        if stats is not None:
            stats["exact"] = not low
        if low:
            warnings.warn(
                f"'{name}': {low} of {codes.numel()} MXFP4 groups lie more than 17 binades "
                f"below the tensor's largest (or its fused partner's): NVFP4's e4m3 scales "
                f"cannot reach them, their values were rounded to the nearest NVFP4 holds; "
                f"every other group is bit-exact.",
                TranscodeLossWarning,
                stacklevel=2,
            )
        return {**res, **scheme.act_values()}
    if scheme.observer == "search" and mx_int4.applies(scheme):
        loss: dict | None = {} if stats is not None else None
        got = mx_int4.search(packed, codes, scheme, loss)
        if got is not None and loss:
            stats["loss"] = loss
        return got
    minmax = scheme.observer == "minmax" and mx_int4.applies(scheme)
    if minmax and stats is not None and native.ENABLED:  # its loss in the kernel's pass
        loss = {}
        got = mx_int4.search(packed, codes, scheme, loss, mx_int4.MINMAX)
        if got is not None and loss:
            stats["loss"] = loss
            return got
    try:
        return _to_int4(packed, codes, scheme, name)
    except (NonFiniteWeightError, WeightRangeError):
        return None  # raised on the synthetic groups: the float path gives the message


#: the e4m3 bytes of 2**j, j = -9 .. 8: the subnormals 2**-9 .. 2**-7, then normals
_POW2_E4M3 = torch.tensor([1, 2, 4] + [(j + 7) << 3 for j in range(-6, 9)], dtype=torch.uint8)
#: nibble maps for a group d = -12 .. -1 binades below the smallest e4m3 scale (row
#: d + 12: each nibble's value times 2**d rounded to E2M1), then the identity (row 12)
_LOW_MAPS = torch.cat(
    [
        fp4_codes(
            torch.tensor([v * 2.0**d for v in E2M1_VALUES] + [-v * 2.0**d for v in E2M1_VALUES])
        ).unsqueeze(0)
        for d in range(-12, 0)
    ]
    + [torch.arange(16, dtype=torch.uint8).unsqueeze(0)]
)


def nvfp4_exact(packed: torch.Tensor, codes: torch.Tensor, top: int | None = None):
    """(NVFP4 parts of MXFP4 ``packed`` / ``codes``, the number of MX groups rounded): see
    the module doc. ``top``: the E8M0 code the global scale is set from (None: the
    tensor's own)."""
    m = fp4.max_codes(packed, fmt.MX_GROUP // 2)  # [out, in/32] largest magnitude code
    if top is None:
        top = _top(codes, m)
    k = min(135 - (127 if top is None else top), 127)  # global 2**k: the top scale 2**8
    # each E8M0 code's e4m3 scale byte, 2**clamp(code - 127 + k, -9, 8), through one table
    lut = _POW2_E4M3.index_select(0, (torch.arange(256) + (k - 127)).clamp_(-9, 8).add_(9))
    twice = codes.unsqueeze(-1).expand(*codes.shape, 2).reshape(codes.shape[0], -1).contiguous()
    scale = _lut_bytes(twice, lut)
    # groups whose scale exponent is below -9 (code < 118 - k) and that hold a value
    low = (codes < 118 - k) * m if 118 - k > 0 else None  # uint8 ops: no bool temporaries
    n_low = int(low.bool().sum()) if low is not None and int(low.amax()) else 0
    if n_low:  # those groups at the smallest scale, their nibbles re-rounded
        j = codes.to(torch.int32).add_(k - 127)
        rowkey = torch.where(low.bool(), j.clamp_(min=-21).add_(21), 12).to(torch.int32)
        out = torch.empty_like(packed)
        if not native.gather_nib(packed, rowkey.contiguous().view(-1), _LOW_MAPS.view(-1), out):
            out = _gather_bytes(packed, rowkey, _byte_table(_LOW_MAPS))
        packed = out
    return {
        "weight_packed": packed,
        "weight_scale": scale.view(torch.float8_e4m3fn),
        "weight_global_scale": torch.tensor([2.0**k], dtype=torch.float32),
    }, n_low


def fp8_exact(packed: torch.Tensor, codes: torch.Tensor, scheme: FP8Scheme, name: str,
              stats: dict | None = None):  # fmt: skip
    """MXFP4 as ``scheme`` (any FP8 strategy) with power-of-two scales (see the module
    doc): the scheme with ``scale_fmt='ue8m0'`` on the bfloat16 decode (exact: an E2M1 value
    times a power of two has one significand bit). Its scale ``2**ceil(log2(amax / 448))``
    puts a group's largest value, ``1 * 2**p`` or ``1.5 * 2**p``, at 256 or 384, and
    ``x / scale`` is exact, so the e4m3 cast keeps every value within 17 binades of it
    and rounds (to nearest, ties to even) only those below. The stored parts are the
    scheme's own (float32 scales that happen to be powers of two). Whole blocks take
    :func:`_fp8_bytes` (the same bytes from a table, no float copy; it sets ``stats
    ["exact"]`` where no MX group lies below what e4m3 holds)."""
    fast = _fp8_bytes(packed, codes, scheme, stats)
    if fast is not None:
        return fast
    w = fp4.decode_mxfp4({"weight_packed": packed, "weight_scale": codes}, fmt.QuantParams(),
                       torch.bfloat16)  # fmt: skip
    return dataclasses.replace(scheme, scale_fmt="ue8m0").quantize(w, name=name)


#: the exponent of each E2M1 magnitude code's value (0.5 .. 6); code 0 (zero): the lowest
_EXP_OF_M = torch.tensor([-16384, -1, 0, 0, 1, 1, 2, 2], dtype=torch.int16)


@functools.lru_cache(maxsize=1)
def _fp8_byte_values() -> torch.Tensor:
    """[256 keys, 16 nibbles] "bfloat16" whose bits are the e4m3 byte of ``e2m1(n) *
    2**(k - 127)`` (float32, exact; cast to nearest, ties to even, as the scheme's own cast;
    values above 448 - a key no group reaches - saturated): the decode kernel's table."""
    e2m1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)
    k = torch.arange(256, dtype=torch.float64)  # float64: 2**128 x 0 is 0, not NaN
    v = (e2m1[None, :] * torch.exp2(k - 127)[:, None]).clamp_(-fmt.FP8_MAX, fmt.FP8_MAX).float()
    return v.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16).view(torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _fp8_exact_keys() -> torch.Tensor:
    """bool [256 keys * 8]: at ``k * 8 + m``, whether key ``k`` of :func:`_fp8_bytes` holds
    exactly every E2M1 value of magnitude code at most ``m`` (``e2m1(n) * 2**(k - 127)``
    is the value of its e4m3 byte): a group is exact when its largest code ``m`` is."""
    e2m1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)
    want = e2m1[None, :] * torch.exp2(torch.arange(256, dtype=torch.float64) - 127)[:, None]
    got = _fp8_byte_values().view(torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
    held = (got.double() == want).view(256, 2, 8).all(1)  # [key, magnitude code]
    return held.to(torch.int8).cummin(1).values.bool().reshape(-1)


@functools.lru_cache(maxsize=1)
def _fp8_exact_top() -> torch.Tensor:
    """uint8 [256]: per key of :func:`_fp8_bytes`, the largest magnitude code whose values
    (and every smaller one's) it holds exactly (:func:`_fp8_exact_keys`; 0 always: zero)."""
    return _fp8_exact_keys().view(256, 8).to(torch.uint8).sum(1).sub_(1).to(torch.uint8)


def _fp8_bytes(packed: torch.Tensor, codes: torch.Tensor, scheme: FP8Scheme,
               stats: dict | None = None):  # fmt: skip
    """:func:`fp8_exact` for whole blocks straight from the bytes: each block's largest
    exponent ``E`` from the MX groups' maxima and codes (no decode), then every value is
    ``e2m1(n) * 2**(k - 127)`` for its MX group's key ``k = e - E + 8`` and the output
    byte one table load (a table of e4m3 bytes). With the kernels, one C pass per band of
    block rows (:func:`k3convert.native.mx_fp8_block`; the torch steps here are its
    reference, taken without them). The bytes of the general path
    (tests/test_mx_transcode.py). None where this does not apply (other strategies, edge
    blocks, blocks whose MX groups straddle a block, exponents near float32's ends)."""
    out, cols = packed.shape
    inp = 2 * cols
    if scheme.strategy != "block" or not packed.numel():
        return None
    b0, b1 = scheme.block
    if out % b0 or inp % b1 or b1 % fmt.MX_GROUP:
        return None
    r, c, sub = out // b0, inp // b1, b1 // fmt.MX_GROUP
    if native.ENABLED and native.library() is not None:  # the steps below in one C pass
        got = native.mx_fp8_block(packed, codes, (b0, b1), _fp8_byte_table(), _fp8_exact_top())
        if got is None:
            return None  # a scale outside float32's normal range: the float path
        q, e, miss = got
        if stats is not None:
            stats["exact"] = miss == 0
        scale = torch.ldexp(torch.ones(r, c), (e - 8).float())
        return {"weight": q.view(torch.float8_e4m3fn), "weight_scale": scale}
    m = fp4.max_codes(packed, fmt.MX_GROUP // 2)  # [out, inp / 32]
    top = codes.to(torch.int16).sub_(127).add_(_EXP_OF_M[m.long()])  # zero groups: < -16000
    e = top.view(r, b0, c, sub).amax(3).amax(1)  # [r, c]: the block maximum's exponent
    zero = e < -1000
    if bool(((e < -118) & ~zero).any()) or bool((e > 135).any()):
        return None  # a scale 2**(E - 8) outside float32's normal range: the float path
    e = torch.where(zero, -118, e)  # a zero block: scale 2**-126, as the general path
    per_group = e.repeat_interleave(b0, 0).repeat_interleave(sub, 1)  # [out, inp / 32]
    keys = (codes.to(torch.int16) - per_group + 8).clamp_(0, 255).to(torch.uint8)
    if stats is not None:  # exact unless a group's largest code is past what its key holds
        stats["exact"] = bool(m.le(_lut_bytes(keys, _fp8_exact_top())).all())
    res = fp4.decode(packed, keys, fmt.MX_GROUP, _fp8_pair_table(), torch.bfloat16)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    q.view(torch.uint8).copy_(res.view(torch.int16))  # each value's low byte (high: 0)
    scale = torch.ldexp(torch.ones(r, c), (e - 8).float())
    return {"weight": q, "weight_scale": scale}


@functools.lru_cache(maxsize=1)
def _fp8_byte_table() -> torch.Tensor:
    return native.decode_table(_fp8_byte_values(), torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _fp8_pair_table() -> torch.Tensor:
    v = _fp8_byte_values()
    b = torch.arange(256)
    return fp4.pair_table(torch.stack([v[:, b & 15], v[:, b >> 4]], -1).contiguous(),
                                 torch.bfloat16)  # fmt: skip


def _top(codes: torch.Tensor, m: torch.Tensor) -> int | None:
    """The largest E8M0 code of the groups whose largest magnitude code ``m`` is nonzero
    (None where none is): uint8 products and maxima, no boolean indexing (4x faster)."""
    if not m.numel() or not int(m.amax()):
        return None
    return int((codes * (m != 0)).amax())


def _lut_bytes(src: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """``lut[src]`` for uint8 ``src`` and a 256-entry uint8 ``lut``: the gather kernel with
    one key, else torch."""
    out = torch.empty(src.shape, dtype=torch.uint8)
    if src.numel() and native.gather(src, torch.zeros(1, dtype=torch.int32), lut, out):
        return out
    return lut.index_select(0, src.reshape(-1).to(torch.int32)).view(src.shape)


def _to_int4(packed, codes, scheme: IntScheme, name: str):
    out, cols = packed.shape
    inp = 2 * cols
    g = inp if scheme.strategy == "channel" else scheme.group_size
    if inp % g or g % fmt.MX_GROUP:
        return None
    span = D_HI - D_LO + 1
    table = _int_table(scheme, "weight", span)  # data-independent: one per scheme
    if table is None:
        return None
    sub = g // fmt.MX_GROUP  # MX groups per int group
    got = native.mx_int4(packed, codes, sub, _values()[:, :8].reshape(-1).contiguous(), table,
                         INT_CODES, (D_LO, D_HI))  # fmt: skip
    if got is not None:  # the kernel: maxima, rows and output bytes in one pass
        qbytes, amax, bad = got
        if bad:  # a code outside INT_CODES: the float path
            return None
        return {
            "weight_packed": qbytes.view(torch.int32),
            "weight_scale": _by_rows(scheme.symmetric_scale, amax),
            "weight_shape": torch.tensor([out, inp], dtype=torch.int64),
        }
    lo, hi = INT_CODES
    if bool(((codes < lo) | (codes > hi)).any()):
        return None
    m = fp4.max_codes(packed, fmt.MX_GROUP // 2)  # [out, inp/32]
    key = codes.to(torch.int32).mul_(8).add_(m)
    vals = _values()[:, :8].reshape(-1)  # (e, m) -> the value of magnitude code m under e
    sub_max = vals.index_select(0, key.view(-1)).view(out, inp // g, sub)
    amax = sub_max.amax(-1)  # [out, ng] float32: the reference's group maxima, exactly
    scale = scheme.symmetric_scale(amax)
    bits = amax.view(torch.int32)
    sig = (bits & 0x7FFFFF) != 0  # significand 1.5 (1 when clear); zero groups: row 2
    k = bits >> 23
    cls = torch.where(bits == 0, 2, sig.to(torch.int32))  # [out, ng]
    d = codes.to(torch.int32).view(out, inp // g, sub) - k.unsqueeze(-1)
    d.clamp_(D_LO, D_HI).sub_(D_LO)
    rowkey = (cls.unsqueeze(-1) * span + d).view(out, inp // fmt.MX_GROUP)
    qbytes = torch.empty_like(packed)  # two nibbles per byte, low value first
    if not native.gather_nib(packed, rowkey.contiguous().view(-1), table.view(-1), qbytes):
        qbytes = _gather_bytes(packed, rowkey, _byte_table(table))
    return {
        "weight_packed": qbytes.view(torch.int32),
        "weight_scale": scale,
        "weight_shape": torch.tensor([out, inp], dtype=torch.int64),
    }


#: elements per torch op of :func:`_by_rows`: under torch's intra-op grain (32768)
_GRAIN = 32000


def _by_rows(fn, x: torch.Tensor) -> torch.Tensor:
    """Elementwise ``fn`` of 2-D ``x``, a block of rows at a time so that each op stays under
    torch's intra-op grain and runs on the calling thread: with more than one torch thread
    on cores shared with other jobs, an OpenMP team waiting on a descheduled thread made a
    0.05 ms op of the int4 scales take 24 ms (measured)."""
    rows = max(1, _GRAIN // max(1, x.shape[1]))
    if x.shape[0] <= rows:
        return fn(x)
    first = fn(x[:rows])
    res = torch.empty(x.shape, dtype=first.dtype)
    res[:rows] = first
    for r0 in range(rows, x.shape[0], rows):
        res[r0 : r0 + rows] = fn(x[r0 : r0 + rows])
    return res


@functools.lru_cache(maxsize=16)
def _int_table(scheme: IntScheme, name: str, span: int) -> torch.Tensor | None:
    """uint8 [3 * span, 16]: for (amax significand 1 / 1.5 / zero group, d, nibble) the
    stored int4 nibble, by the scheme's own quantize of one synthetic group
    per (significand, d): the largest value first, then the 16 nibbles' values times 2**d
    (clamped to it: larger ones never share a group with it), then zeros. None if the
    d = D_LO row is not all zeros (then lower d would not be the same row)."""
    width = scheme.group_size if scheme.strategy == "group" else fmt.MX_GROUP
    e2m1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    groups = torch.zeros(3 * span, width, dtype=torch.float32)
    for c, top in enumerate((1.0, 1.5, 0.0)):
        for j in range(span):
            row = groups[c * span + j]
            row[0] = top
            row[1:17] = (e2m1 * 2.0 ** (j + D_LO)).clamp(-top, top)
    parts = scheme.quantize(groups, name=name)
    q = unpack_int32(parts["weight_packed"], scheme.num_bits, tuple(groups.shape))
    if bool(q.view(3, span, width)[:, 0, 1:].any()):
        return None
    return ((q[:, 1:17].to(torch.int32) + 8) & 15).to(torch.uint8)  # pack_int32's offsets


def _byte_table(nibmap: torch.Tensor) -> torch.Tensor:
    """[rows, 16] nibble maps -> the [rows * 256] byte table of the torch path: byte b ->
    map[b & 15] | map[b >> 4] << 4."""
    b = torch.arange(256)
    return (nibmap[:, b & 15] | (nibmap[:, b >> 4] << 4)).contiguous().view(-1)

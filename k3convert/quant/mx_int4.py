"""int4 scales searched per group for an MXFP4 source (the default for MXFP4 -> int4).

int4 cannot hold the E2M1 grid, so every MXFP4 -> int4 conversion moves values; the
``minmax`` scale (``amax / 7.5``) is not the one that moves them least (issue 37: 7.8e-3
relative MSE against 5.1e-3 for the best scale per group on a K3-shaped tensor). This
module picks, for every group, the candidate scale with the smallest squared error of
the stored model, without a float copy of the tensor:

* A group of ``g`` values (a multiple of 32, aligned with the MX groups) holds E2M1 codes
  under its MX groups' E8M0 exponents. With ``U = 2**(e_ref - 127)`` for the largest
  exponent ``e_ref`` of a nonzero MX group, every value is ``e2m1(n) * 2**-d * U`` (``d``
  the MX group's exponent below ``e_ref``), and the group maximum is ``a * U`` with
  ``a`` one of eight values (0.5, 0.75, 1, 1.5, 2, 3, 4, 6: a power of two times 1 or
  1.5), its *class*.
* The candidates are ``scale = amax * r`` for the ratios ``r = 1 / t``, ``t`` = 5.5, 5.75,
  ..., 9 (:data:`DENOMS`; 7.5 is minmax's own), rounded to the scale dtype as the
  scheme stores it. Since ``U`` is a power of two, ``scale / U``, each code
  ``round(clamp(v / scale, -8, 7))`` and each dequantized value ``q * scale`` (in the
  scale's dtype, as compressed-tensors and the kernels compute it) divided by ``U``
  depend only on (class, candidate, d, nibble): one table of squared errors ``E`` and
  one of output nibbles.
* A group's error under each candidate is then the sum of its values' table entries,
  and the smallest wins (the first on a tie: candidates are tried from minmax's
  outward). With bfloat16 scales every error is an integer in units of 2**-24, so the
  sums are exact in any order: the kernel of :mod:`k3convert.native` (one pass, 16
  candidate sums in two vectors) and the torch path (a histogram of (d, nibble) per
  group times the table) write the same bytes, and so does a brute-force float64 search
  (tests/test_mx_transcode.py). MX groups more than 7 binades below ``e_ref`` round to
  zero under every candidate and do not change the choice.

Measured on K3-shaped MXFP4 tensors (Gaussian rows, tests/test_mx_transcode.py): relative
MSE 1.026x (g32) and 1.023x (g128) that of the best of every bfloat16 scale between
``amax / 10`` and ``amax / 4`` per group, against 1.68x and 1.53x for minmax.
``--weight-observer minmax`` (or ``mse``) asks for the plain observers instead.
"""

from __future__ import annotations

import functools

import torch

from .. import formats as fmt
from .. import native
from ..formats.fp4 import E2M1, E2M1_VALUES, max_codes
from .schemes import IntScheme

#: the candidate ratios' denominators, minmax's (7.5) first, then outward by distance
DENOMS = tuple(sorted((5.5 + 0.25 * i for i in range(15)), key=lambda t: (abs(t - 7.5), t)))
#: minmax's one candidate (``amax / 7.5``): the search over it alone rounds as the
#: ``minmax`` observer does, bit for bit (tests/test_mx_transcode.py), and its kernel
#: measures the loss in the same pass (:func:`..fp4_requant.requantize` takes it so)
MINMAX = (7.5,)
#: group maximum / U: (significand 1 or 1.5) x 2**p
CLASSES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: MX groups at most this many binades below e_ref are counted; further ones round to 0
DEPTH = 7
#: E8M0 codes for which every scale and value stays a normal float32 / bfloat16
CODES = (16, 240)
#: values per band of rows (the histogram's bincount and the tables' temporaries)
_BAND = 1 << 18


def applies(scheme) -> bool:
    """Whether :func:`search` produces ``scheme`` (symmetric packed int4 in groups that
    are a multiple of 32, bfloat16 scales: the dtype in which its sums are exact)."""
    return (
        isinstance(scheme, IntScheme)
        and scheme.packed and scheme.symmetric and scheme.num_bits == 4
        and scheme.strategy == "group" and scheme.group_size % fmt.MX_GROUP == 0
        and scheme.sdtype == torch.bfloat16
    )  # fmt: skip


#: squared errors are kept in units of 2**-24: every value and dequantized value of a
#: bfloat16-scale candidate is a multiple of 2**-12 (values 2**-(1 + DEPTH) at the finest,
#: scales at least 2**-5 with 8 significant bits), so the errors are integers there and
#: every sum is exact (float64 here, uint32 lanes in the kernel: :func:`_byte_errors`)
_UNIT = 2.0**24


@functools.lru_cache(maxsize=16)
def _tables(sdtype: torch.dtype, qmin: int, qmax: int, depth: int, denoms=DENOMS):
    """(rel_scale float32 [classes, C], err float64 [classes, C, depth + 1, 16] in units of
    2**-24, nibbles uint8 [classes, C, depth + 2, 16], |error| float32 [classes, C,
    depth + 1, 16] in units of U): see the module doc. Row ``depth + 1`` of the nibbles is
    a left-out MX group (every code 0)."""
    cls = torch.tensor(CLASSES, dtype=torch.float32)
    ratio = torch.tensor([1.0 / t for t in denoms], dtype=torch.float32)
    rel = (cls[:, None] * ratio[None, :]).to(sdtype)  # the stored scale / U
    d = torch.arange(depth + 1, dtype=torch.float32)
    v = E2M1[None, :] * torch.exp2(-d)[:, None]  # [depth + 1, 16]: value / U
    s = rel.float()[:, :, None, None]
    q = torch.round((v[None, None] / s).clamp_(qmin, qmax))
    dq = (q.to(sdtype) * rel[:, :, None, None]).float()  # the loaders' dequantization
    diff = (v[None, None] - dq).abs_()  # multiples of 2**-12 below 8: exact in float32
    # a value above its group's maximum never occurs: no error there (keeps the bound)
    diff.masked_fill_(v.abs()[None, None] > cls[:, None, None, None], 0.0)
    err = diff.double().square_().mul_(_UNIT)
    if not bool((err == err.round()).all()) or float(err.max()) >= 2.0**25:
        raise AssertionError("int4 search: an error is not an integer below 2**25 units")
    nib = ((q.to(torch.int32) - qmin) & 15).to(torch.uint8)  # pack_int32's offset (+8)
    zero = torch.full((*nib.shape[:2], 1, 16), -qmin & 15, dtype=torch.uint8)
    return rel.float(), err, torch.cat([nib, zero], 2).contiguous(), diff.contiguous()


@functools.lru_cache(maxsize=16)
def _byte_errors(sdtype: torch.dtype, qmin: int, qmax: int, depth: int,
                 denoms=DENOMS) -> torch.Tensor:  # fmt: skip
    """The kernel's error table: int32 [classes, depth + 1, 256 bytes, 16 lanes], a byte's
    two nibbles' errors per candidate (lanes past C zero), each below 2**26, so the sums
    over an int group of up to 128 values stay below 2**32 (the kernel's uint32 lanes)."""
    rel, err, _, _ = _tables(sdtype, qmin, qmax, depth, denoms)
    b = torch.arange(256)
    k, c = rel.shape
    pair = err[:, :, :, b & 15] + err[:, :, :, b >> 4]  # [K, C, depth + 1, 256]
    lanes = torch.zeros(k, depth + 1, 256, 16, dtype=torch.int32)
    lanes[..., :c] = pair.permute(0, 2, 3, 1).to(torch.int32)
    return lanes.contiguous()


@functools.lru_cache(maxsize=16)
def loss_tables(sdtype: torch.dtype, qmin: int, qmax: int, depth: int, denoms=DENOMS):
    """The search kernel's loss tables (:func:`k3convert.native.mx_int4_search`): per row
    (class, candidate, d) each nibble's changed flag and the rank of its |error| among the
    row's, then one row for an MX group left out (changed: the value is nonzero); the
    release's squares (2 e2m1(n))**2 by nibble; each row's |errors| / U by rank."""
    diff = _tables(sdtype, qmin, qmax, depth, denoms)[3]  # [8, C, depth + 1, 16]
    rows = diff.reshape(-1, 16)
    srt = rows.sort(1).values  # ascending: the rank of v is how many are below it
    rank = (srt[:, None, :] < rows[:, :, None]).sum(2)
    ltab = torch.zeros(rows.shape[0] + 1, 2, 16, dtype=torch.uint8)
    ltab[:-1, 0] = (rows != 0).to(torch.uint8)
    ltab[:-1, 1] = rank.to(torch.uint8)
    ltab[-1, 0] = (E2M1 != 0).to(torch.uint8)
    lval = torch.zeros_like(rows)
    lval.scatter_(1, rank, rows)  # rank r -> its value (equal values share a rank)
    sq16 = (2 * E2M1).square().to(torch.uint8)
    return ltab.contiguous(), sq16.contiguous(), lval.view(diff.shape).contiguous()


def search(
    packed: torch.Tensor,
    codes: torch.Tensor,
    scheme,
    loss: dict | None = None,
    denoms: tuple[float, ...] = DENOMS,
) -> dict | None:
    """MXFP4 ``packed`` [out, in/2] / ``codes`` [out, in/32] as ``scheme`` with searched
    scales (see the module doc); None where the E8M0 code of an MX group holding a nonzero
    value lies outside :data:`CODES` (the caller takes the float path). The kernel of
    :mod:`k3convert.native` where it is available, else torch ops: the same bytes (the
    sums are exact, the first smallest wins in both).

    denoms: the candidates' denominators (:data:`DENOMS`; :data:`MINMAX` alone is
    round to nearest with minmax scales).

    loss: filled, where the kernel ran, with what the search knows of every value it
    rounds (``err2``, ``ref2``: the squared error and the release's squared values,
    ``max_abs``, ``changed`` values, ``groups_changed`` MX groups): the loss report's
    figures without decoding the output again (:func:`k3convert.quant.fidelity.from_sums`;
    tests/test_mx_transcode.py holds them to :func:`~k3convert.quant.fidelity.measure`)."""
    out, cols = packed.shape
    inp = 2 * cols
    g = scheme.group_size
    if inp % g:
        return None
    sub, ng = g // fmt.MX_GROUP, inp // g
    depth = DEPTH if sub > 1 else 0  # one MX group per int group: d is always 0
    zero = scheme.symmetric_scale(torch.zeros(()))
    key = (scheme.sdtype, scheme.qmin, scheme.qmax, depth, tuple(denoms))
    rel = _tables(*key)[0]
    if native.ENABLED and packed.numel() and sub <= native.SEARCH_MAX_SUB:
        err = _byte_errors(*key)
        nib = _tables(*key)[2]
        lt = None if loss is None else loss_tables(*key)
        got = native.mx_int4_search(packed, codes, sub, depth, err, nib, rel,
                                    torch.tensor(E2M1_VALUES, dtype=torch.float32),
                                    float(zero), -scheme.qmin & 15 | (-scheme.qmin & 15) << 4,
                                    CODES, loss_tables=lt)  # fmt: skip
        if got is not None:
            qbytes, scale, bad, sums = got
            if bad:
                return None
            if loss is not None:
                err2, ref2, top, changed, groups = sums.tolist()
                loss.update(err2=err2, ref2=ref2, max_abs=top, changed=int(changed),
                            groups_changed=int(groups))  # fmt: skip
            return _parts(qbytes, scale.to(scheme.sdtype), out, inp)
    return _search_torch(packed, codes, scheme, sub, ng, depth, zero, tuple(denoms))


def _parts(qbytes, scale, out, inp) -> dict:
    return {
        "weight_packed": qbytes.view(torch.int32),
        "weight_scale": scale,
        "weight_shape": torch.tensor([out, inp], dtype=torch.int64),
    }


def _search_torch(packed, codes, scheme, sub, ng, depth, zero, denoms=DENOMS) -> dict:
    """:func:`search` in torch ops, a band of rows at a time: each int group's histogram
    of (d, nibble) times the error table."""
    out, cols = packed.shape
    rel, err, nib, _ = _tables(scheme.sdtype, scheme.qmin, scheme.qmax, depth, denoms)
    ncand = rel.shape[1]
    bins = (depth + 1) * 16
    errs = err.view(len(CLASSES), ncand, bins).transpose(1, 2).contiguous()  # [K, bins, C]
    scale = torch.empty(out, ng, dtype=scheme.sdtype)
    qbytes = torch.empty_like(packed)
    table = nib.view(-1, 16)
    band = max(1, _BAND // (2 * cols))
    val = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    classes = torch.tensor(CLASSES)
    for r0 in range(0, out, band):
        r1 = min(out, r0 + band)
        n = r1 - r0
        p = packed[r0:r1]
        m = max_codes(p, fmt.MX_GROUP // 2).view(n, ng, sub).to(torch.int64)
        e = codes[r0:r1].view(n, ng, sub).to(torch.int64)
        nz = m != 0
        if bool((((e < CODES[0]) | (e > CODES[1])) & nz).any()):
            return None
        e_ref = torch.where(nz, e, -1).amax(-1, keepdim=True)  # [n, ng, 1]; -1: zero group
        d = e_ref - e
        valid = nz & (d <= depth)
        top = torch.where(valid, val[m] / torch.exp2(d.clamp(0, depth).float()), 0.0).amax(-1)
        k = torch.searchsorted(classes, top.view(-1)).clamp_(max=len(CLASSES) - 1)
        # histogram of (d, nibble) per int group; left-out MX groups in a last, dropped bin
        nibs = torch.stack([p & 15, p >> 4], -1).view(n, ng, sub, fmt.MX_GROUP).to(torch.int64)
        slot = torch.where(valid, d.clamp(0, depth) * 16, bins).unsqueeze(-1) + nibs
        key = torch.arange(n * ng).view(n, ng, 1, 1) * (bins + 16) + slot
        hist = torch.bincount(key.view(-1), minlength=n * ng * (bins + 16))
        hist = hist.view(n * ng, bins + 16)[:, :bins].double()
        best = torch.zeros(n * ng, dtype=torch.int64)
        for c in range(len(CLASSES)):
            idx = (k == c).nonzero().view(-1)
            if idx.numel():
                best[idx] = (hist[idx] @ errs[c]).argmin(1)  # exact sums: the first smallest
        kb = k * ncand + best
        unit = torch.exp2(e_ref.view(-1).clamp(min=0).float() - 127)
        s = torch.where(top.view(-1) > 0, rel.view(-1)[kb] * unit, zero.float())
        scale[r0:r1] = s.view(n, ng).to(scheme.sdtype)
        row = torch.where(valid, d, depth + 1)  # [n, ng, sub]
        rowkey = (kb.view(n, ng, 1) * (depth + 2) + row).view(n, ng * sub)
        keys = rowkey.repeat_interleave(fmt.MX_GROUP // 2, 1)  # one per byte
        lo_n = table[keys, (p & 15).long()]
        hi_n = table[keys, (p >> 4).long()]
        qbytes[r0:r1] = lo_n | (hi_n << 4)
    return _parts(qbytes, scale, out, 2 * cols)

"""Small C kernels for the byte loops torch has no fast op for, built with the package.

``fp4_kernels.c`` holds table gathers keyed by (group key, stored byte) and the per-group
maximum E2M1 code: the MXFP4 / NVFP4 decode and the MXFP4 requantization
(:mod:`k3convert.formats.fp4`, :mod:`k3convert.quant.fp4_requant`) run through them
when they are available, and through torch ops giving the same bytes otherwise
(tests/test_fp4_requant.py checks both paths against each other and against the
reference).

Build: ``setup.py`` compiles ``fp4_kernels.c`` with the module shell ``_fp4_module.c``
into the extension module ``k3convert.native._fp4_kernels`` when the package is built
(``pip install``, a wheel), with setuptools' compiler and its handling of ``CC`` /
``CFLAGS``. At run time it is imported like any extension module, from the installed
package; its exported ``k3_*`` functions are then bound through ctypes from that same
loaded object. Nothing is compiled at run time and no library is loaded from any other
place. Not built (no compiler at install time, an exotic platform), built from another
source (its ABI number differs) or ``K3CONVERT_NATIVE=0``: every caller takes the torch
path, :func:`status` says why, and the first kernel call that falls back prints one line
on stderr with the reason and the fix.

Threads: every kernel takes a thread count (``nthreads=``; default :func:`threads_for`:
torch's intra-op thread count, one thread below ~1 MiB of output) and splits its groups
into that many contiguous ranges run by pthreads, the calling thread taking the first;
the bytes written do not depend on the count (tests/test_fp4_requant.py checks 1, 2, 3).

Vector ISA: each kernel has a portable loop and an AVX2 one, the bfloat16 FP4 decode an
AVX-512 (BW + VBMI) one too; a call runs the widest the CPU has (:func:`cpu_level`)
capped by torch's CPU capability (:func:`simd_level`: ``ATEN_CPU_CAPABILITY=default`` or
``=avx2`` pins these loops as it pins torch's). Every level writes the same bytes.

Arguments: the C loops trust what they are given, so every wrapper here checks every
argument it passes (dtype, device, contiguity, sizes, index ranges, values that must fit
the C types) and raises ValueError before any C code runs (tests/test_native_sanitize.py
runs the hostile cases against an ASan + UBSan build).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import sys
import threading

import torch

from . import outbuf

#: the kernels' ABI number (``k3_fp4_kernels_version`` in fp4_kernels.c): a built module
#: reporting another one was compiled from another source and is not used
ABI = 23

#: False: every caller takes its torch path (tests compare the two)
ENABLED = True
#: output bytes below which a kernel runs on the calling thread alone: under ~1 MiB the
#: threads' start and join (tens of microseconds each) cost more than they save
PAR_MIN_BYTES = 1 << 20
#: int groups per partial sum of :func:`mx_int4_search`'s loss (a thread takes whole ones)
LOSS_CHUNK = 1024
#: the C side's int parameters (thread counts, group sizes, ranges) are 32-bit
_INT32_MAX = 2**31 - 1

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # why there is no library (None: not tried yet, or loaded)
_tried = False
_told = False  # the fallback line was printed (once per process)
_FIX = (
    "reinstall k3convert where a C compiler is present (`pip install -e .` in a checkout, "
    "or `pip install --force-reinstall --no-binary k3convert k3convert`)"
)


def _import_module():
    """The built extension module (ImportError where it was not built)."""
    return importlib.import_module(f"{__name__}._fp4_kernels")


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("k3_gather_u8", "k3_gather_u32", "k3_gather_u64"):
        f = getattr(lib, name)
        f.argtypes = [p, p, i64, i64, p, p, i32]
        f.restype = None
    lib.k3_max_codes.argtypes = [p, i64, i64, p, i32, i32]
    lib.k3_max_codes.restype = None
    for name in ("k3_fp4_lut_bf16", "k3_fp4_lut_f32"):
        getattr(lib, name).argtypes = [p, p, i64, i64, p, p, i32, i32]
        getattr(lib, name).restype = None
    lib.k3_mx_fp8_block.argtypes = [p, p, i64, i64, i64, i64, p, p, p, p, p, i32, i32]
    lib.k3_mx_fp8_block.restype = i64
    lib.k3_gather_nib.argtypes = [p, p, i64, p, p, i32, i32]
    lib.k3_gather_nib.restype = None
    lib.k3_mx_int4.argtypes = [p, p, i64, i64, p, *[i32] * 5, p, p, p, i32, i32]
    lib.k3_mx_int4.restype = i64
    f32 = ctypes.c_float
    lib.k3_mx_int4_search.argtypes = [p, p, i64, i64, i32, p, p, i32, p, p, f32, i32, i32, i32,
                                      p, p, p, p, p, p, i64, i32, i32]  # fmt: skip
    lib.k3_mx_int4_search.restype = i64
    lib.k3_fp4_kernels_version.restype = ctypes.c_int
    lib.k3_fp4_simd_level.restype = ctypes.c_int


def library() -> ctypes.CDLL | None:
    """The kernels of the built extension module, bound on the first call; None where they
    cannot be had (:func:`status` says why)."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("K3CONVERT_NATIVE", "1") == "0":
                raise OSError("disabled by K3CONVERT_NATIVE=0")
            if sys.byteorder != "little":
                raise OSError("a big-endian host (the kernels assemble little-endian words)")
            try:
                mod = _import_module()
            except ImportError as e:
                raise OSError(f"the extension module was not built ({e})") from None
            if getattr(mod, "ABI", None) != ABI:
                raise OSError(
                    f"the built extension module has ABI {getattr(mod, 'ABI', None)}, this "
                    f"k3convert needs {ABI} (it was built from another source)"
                )
            lib = ctypes.CDLL(mod.__file__)  # the object the import already loaded
            _declare(lib)
            _lib = lib
        except Exception as e:  # any failure to load: the torch path, and why
            _why = f"{type(e).__name__}: {e}" if not isinstance(e, OSError) else str(e)
        _tried = True
    return _lib


def _kernels() -> ctypes.CDLL | None:
    """What a wrapper calls: the library, or None for the torch path (the tests' switch
    :data:`ENABLED`, or no kernels - then, once per process and on the first torchrun
    rank only, one line on stderr with the reason and the fix)."""
    global _told
    if not ENABLED:
        return None
    lib = library()
    if lib is None and not _told:
        _told = True
        if os.environ.get("RANK", "0") in ("0", ""):
            off = "K3CONVERT_NATIVE=0" in (_why or "")
            fix = "unset K3CONVERT_NATIVE" if off else _FIX
            print(
                f"k3convert: native FP4 kernels off ({_why}); FP4 decode / requantization run "
                f"through torch, several times slower - {fix}.",
                file=sys.stderr,
                flush=True,
            )
    return lib


def status() -> str:
    """One line: whether the kernels are in use (and at which vector ISA), and why not."""
    lib = library()
    if lib is None:
        return f"native FP4 kernels: off ({_why})"
    names = {0: "portable", 1: "AVX2", 2: "AVX-512 BW+VBMI"}
    return (
        f"native FP4 kernels: in use (ISA {names[simd_level()]}; CPU supports {names[cpu_level()]})"
    )


def threads_for(out_bytes: int, nthreads: int | None = None) -> int:
    """The thread count a kernel writing ``out_bytes`` runs with: ``nthreads`` where given
    (an int; below 1 means 1, above :data:`MAX_THREADS` means that many, as the C side
    caps it), else torch's intra-op count (``torch.get_num_threads()``), or 1 below
    :data:`PAR_MIN_BYTES` of output."""
    if nthreads is not None:
        if isinstance(nthreads, bool) or not isinstance(nthreads, int):
            raise ValueError(f"native kernels: nthreads must be an int, got {nthreads!r}")
        return min(max(1, nthreads), MAX_THREADS)
    n = torch.get_num_threads() if out_bytes >= PAR_MIN_BYTES else 1
    return min(max(1, n), MAX_THREADS)


#: the most threads one kernel call starts (``K3_MAX_THREADS`` in fp4_kernels.c)
MAX_THREADS = 64


def _int(v, name: str, lo: int, hi: int) -> int:
    """``v`` as an int in ``[lo, hi]`` (a C parameter's range): ValueError otherwise
    (bools, floats, numpy scalars of another kind and out-of-range values alike)."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"native kernels: {name} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _cpu(*ts) -> bool:
    """Every argument is a contiguous CPU tensor (a meta or CUDA tensor has no host
    memory behind its data pointer; a strided view's bytes are not where C reads)."""
    return all(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
        and not t.is_sparse and not t.is_quantized and not t.is_nested
        for t in ts
    )  # fmt: skip


#: torch's CPU capability (``ATEN_CPU_CAPABILITY`` caps it) -> the widest level the kernels
#: may use: one variable pins every vector path of a run, torch's and these kernels'
_TORCH_LEVEL = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}


def cpu_level() -> int:
    """The widest vector ISA these kernels have a loop for that this CPU runs: 2 AVX-512
    BW + VBMI (the bfloat16 FP4 decode), 1 AVX2, 0 the portable loops (also without the
    kernels)."""
    lib = library() if ENABLED else None
    return 0 if lib is None else int(lib.k3_fp4_simd_level())


def simd_level() -> int:
    """The level the kernels run at: :func:`cpu_level` capped by torch's CPU capability
    (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY=default``
    or ``=avx2`` lowers), so a run pinned to a vector ISA runs every loop at it."""
    return min(cpu_level(), _torch_level())


@functools.cache
def _torch_level() -> int:  # ATen reads its capability once per process
    return _TORCH_LEVEL.get(torch.backends.cpu.get_cpu_capability(), 0)


def _isa(simd: bool | int, top: int = 1) -> int:
    """A kernel's ``simd`` argument as the level it runs at: True the widest allowed (at
    most ``top``, the kernel's own widest loop), False the portable loop, an int capped."""
    if simd is True:
        want = top
    elif simd is False or (isinstance(simd, int) and not isinstance(simd, bool)):
        want = int(simd)
    else:
        raise ValueError(f"native kernels: simd must be a bool or an int, got {simd!r}")
    return max(0, min(want, top, simd_level()))


_WORDS = {1: "k3_gather_u8", 4: "k3_gather_u32", 8: "k3_gather_u64"}


def gather(src: torch.Tensor, key: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
           *, nthreads: int | None = None) -> bool:  # fmt: skip
    """``out.view(-1)[g * per + j] = table[key[g] << 8 | src.view(-1)[g * per + j]]``:
    uint8 ``src`` of ``groups * per`` bytes, int32 ``key`` [groups] (values in
    ``[0, len(table) / 256)``), ``table`` and ``out`` of one 1-, 4- or 8-byte dtype, all
    contiguous CPU tensors. False (nothing done) where the kernels are unavailable."""
    lib = _kernels()
    if lib is None:
        return False
    if not _cpu(src, key, table, out):
        raise ValueError("native gather: arguments of the wrong dtype, size or layout")
    size = table.element_size()
    groups = key.numel()
    if (
        src.dtype != torch.uint8 or key.dtype != torch.int32 or out.dtype != table.dtype
        or size not in _WORDS or not groups or src.numel() % groups
        or out.numel() != src.numel() or not table.numel() or table.numel() % 256
    ):  # fmt: skip
        raise ValueError("native gather: arguments of the wrong dtype, size or layout")
    lo, hi = torch.aminmax(key)
    if int(lo) < 0 or (int(hi) + 1) * 256 > table.numel():
        raise ValueError("native gather: a key outside the table")
    n = threads_for(out.numel() * size, nthreads)
    getattr(lib, _WORDS[size])(
        src.data_ptr(), key.data_ptr(), groups, src.numel() // groups,
        table.data_ptr(), out.data_ptr(), n,
    )  # fmt: skip
    return True


def max_codes(src: torch.Tensor, per: int, out: torch.Tensor, *, simd: bool = True,
              nthreads: int | None = None) -> bool:  # fmt: skip
    """``out[g]`` = the largest ``nibble & 7`` of bytes ``[g * per, (g + 1) * per)`` of
    contiguous uint8 ``src``; False where the kernels are unavailable."""
    lib = _kernels()
    if lib is None:
        return False
    per = _int(per, "max_codes per", 1, 2**62)
    if (
        not _cpu(src, out) or src.dtype != torch.uint8 or out.dtype != torch.uint8
        or src.numel() != out.numel() * per
    ):  # fmt: skip
        raise ValueError("native max_codes: arguments of the wrong dtype, size or layout")
    n = threads_for(src.numel(), nthreads)  # the work is the bytes read
    lib.k3_max_codes(src.data_ptr(), out.numel(), per, out.data_ptr(), _isa(simd), n)
    return True


_OUT_DTYPES = (torch.bfloat16, torch.float32)


def fp4_decode(packed: torch.Tensor, codes: torch.Tensor, values: torch.Tensor,
               dtype: torch.dtype, group: int, *, table: torch.Tensor | None = None,
               simd: bool = True, nthreads: int | None = None) -> torch.Tensor | None:  # fmt: skip
    """FP4 uint8 ``packed`` [out, in/2] with one scale byte per ``group`` values in
    ``codes`` (uint8 [out, in/group]: MXFP4's E8M0 codes at group 32, NVFP4's e4m3 bytes
    at 16) -> [out, in] ``dtype`` (bfloat16 / float32): value ``values[c, n]`` for nibble
    ``n`` of a group with scale byte ``c``, ``values`` the [256, 16] nibble table in
    ``dtype``; None without the kernels. ``table``: :func:`decode_table` of ``values``,
    where the caller keeps it (else built here). ``simd``: the widest vector ISA the loop may use
    where the CPU has it - True the widest (AVX-512 BW + VBMI for bfloat16, else AVX2),
    an int level of :func:`simd_level` to cap it, False the portable loop (tests: every
    level gives the same bytes)."""
    lib = _kernels()
    if lib is None:
        return None
    if group not in (16, 32) or isinstance(group, bool) or not _cpu(packed, codes):
        raise ValueError("native FP4 decode: arguments of the wrong dtype, size or layout")
    out, cols = packed.shape if packed.ndim == 2 else (0, 0)
    per = group // 2  # stored bytes per scale byte
    if (
        dtype not in _OUT_DTYPES or packed.dtype != torch.uint8
        or codes.dtype != torch.uint8 or packed.ndim != 2 or cols % per
        or tuple(codes.shape) != (out, cols // per)
        or not isinstance(values, torch.Tensor) or values.device.type != "cpu"
        or values.dtype != dtype or tuple(values.shape) != (256, 16)
    ):  # fmt: skip
        raise ValueError("native FP4 decode: arguments of the wrong dtype, size or layout")
    lut = decode_table(values, dtype) if table is None else table
    want = (torch.uint8, (256, 2, 16)) if dtype == torch.bfloat16 else (torch.int32, (256, 16))
    if not _cpu(lut) or (lut.dtype, tuple(lut.shape)) != want:
        raise ValueError(
            f"native FP4 decode: table must be a contiguous CPU {want[0]} tensor of shape "
            f"{want[1]} (decode_table's for {dtype})"
        )
    res = outbuf.empty((out, 2 * cols), dtype)  # reused pages: no faults per tensor
    fn = lib.k3_fp4_lut_bf16 if dtype == torch.bfloat16 else lib.k3_fp4_lut_f32
    n = threads_for(res.numel() * res.element_size(), nthreads)
    fn(packed.data_ptr(), codes.data_ptr(), codes.numel(), per, lut.data_ptr(),
       res.data_ptr(), _isa(simd, 2), n)  # fmt: skip
    return res


#: k3_mx_fp8_block's answer when a block's scale leaves float32's normal range
_FP8_DECLINE = 1 << 40


def mx_fp8_block(packed: torch.Tensor, codes: torch.Tensor, block: tuple[int, int],
                 table: torch.Tensor, top: torch.Tensor, *, simd: bool | int = True,
                 nthreads: int | None = None):  # fmt: skip
    """MXFP4 ``packed`` [out, in/2] / E8M0 ``codes`` [out, in/32] -> FP8 blocks of
    ``block`` (rows, cols) with power-of-two scales in one pass per band of block rows
    (:func:`k3convert.quant.fp4_requant._fp8_bytes` states the rule, and its torch steps
    are the reference): (uint8 [out, in] e4m3 bytes, int16 [out / rows, in / cols] each
    block's largest exponent ``E`` - its scale is ``2**(E - 8)`` -, the number of MX groups
    some value of which e4m3 rounds: those whose largest magnitude code is past ``top``
    [256], the largest code each key holds exactly). ``table``: uint8 [256, 2, 16], row
    ``k``'s first 16 bytes the e4m3 bytes of key ``k``'s 16 nibbles (a bfloat16
    :func:`decode_table` of them). None without the kernels, or where a block's scale
    would leave float32's normal range (the caller's float path)."""
    lib = _kernels()
    if lib is None:
        return None
    bad = ValueError("native MXFP4 -> FP8 blocks: arguments of the wrong dtype, size or layout")
    if not _cpu(packed, codes, table, top) or not isinstance(block, tuple) or len(block) != 2:
        raise bad
    b0 = _int(block[0], "mx_fp8_block block[0]", 1, 1 << 20)
    b1 = _int(block[1], "mx_fp8_block block[1]", 32, 1 << 20)
    out, cols = packed.shape if packed.ndim == 2 else (0, 0)
    if (
        packed.dtype != torch.uint8 or codes.dtype != torch.uint8 or packed.ndim != 2
        or b1 % 32 or out % b0 or (2 * cols) % b1 or tuple(codes.shape) != (out, cols // 16)
        or (table.dtype, tuple(table.shape)) != (torch.uint8, (256, 2, 16))
        or (top.dtype, tuple(top.shape)) != (torch.uint8, (256,))
    ):  # fmt: skip
        raise bad
    q = outbuf.empty((out, 2 * cols), torch.uint8)  # reused pages: no faults per tensor
    e = torch.empty((out // b0, 2 * cols // b1), dtype=torch.int16)
    if not q.numel():
        return q, e, 0
    scratch = torch.empty(2 * codes.numel(), dtype=torch.uint8)  # 2 bytes an MX group
    n = threads_for(q.numel(), nthreads)
    got = lib.k3_mx_fp8_block(packed.data_ptr(), codes.data_ptr(), out // b0, b0, cols // 16,
                              b1 // 32, table.data_ptr(), top.data_ptr(), q.data_ptr(),
                              e.data_ptr(), scratch.data_ptr(), _isa(simd, 1), n)  # fmt: skip
    if got >= _FP8_DECLINE:
        return None
    return q, e, int(got)


def decode_table(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP4 decode kernel's table for the [256, 16] nibble ``values``: bfloat16, per
    code its 16 values' low bytes then their high bytes; float32, the values' bits. A
    caller decoding many tensors under one table builds it once (``table=``)."""
    if dtype == torch.bfloat16:
        lut = values.contiguous().view(torch.uint8).view(256, 16, 2).transpose(1, 2)
    else:
        lut = values.contiguous().view(torch.int32)
    return lut.contiguous()


def _mx_pair(packed: torch.Tensor, codes: torch.Tensor) -> None:
    if not _cpu(packed, codes):
        raise ValueError("native MXFP4: parts of the wrong dtype, shape or layout")
    out, cols = packed.shape if packed.ndim == 2 else (0, 0)
    if (
        packed.dtype != torch.uint8 or codes.dtype != torch.uint8 or packed.ndim != 2
        or cols % 16 or tuple(codes.shape) != (out, cols // 16)
    ):  # fmt: skip
        raise ValueError("native MXFP4: parts of the wrong dtype, shape or layout")


def gather_nib(src: torch.Tensor, key: torch.Tensor, nibmap: torch.Tensor, out: torch.Tensor,
               *, simd: bool = True, nthreads: int | None = None) -> bool:  # fmt: skip
    """``out`` = each byte of uint8 ``src`` (groups of 16 bytes, one int32 ``key`` each)
    through the 16-entry nibble map ``nibmap[key]`` (uint8 [rows * 16]): low and high
    nibble mapped on their own. False where the kernels are unavailable."""
    lib = _kernels()
    if lib is None:
        return False
    if not _cpu(src, key, nibmap, out):
        raise ValueError("native gather_nib: arguments of the wrong dtype, size or layout")
    groups = key.numel()
    if (
        src.dtype != torch.uint8 or out.dtype != torch.uint8 or key.dtype != torch.int32
        or nibmap.dtype != torch.uint8 or nibmap.numel() % 16 or not groups
        or src.numel() != 16 * groups or out.numel() != src.numel()
    ):  # fmt: skip
        raise ValueError("native gather_nib: arguments of the wrong dtype, size or layout")
    lo, hi = torch.aminmax(key)
    if int(lo) < 0 or (int(hi) + 1) * 16 > nibmap.numel():
        raise ValueError("native gather_nib: a key outside the map")
    n = threads_for(out.numel(), nthreads)
    lib.k3_gather_nib(src.data_ptr(), key.data_ptr(), groups, nibmap.data_ptr(),
                      out.data_ptr(), _isa(simd), n)  # fmt: skip
    return True


def mx_int4(packed: torch.Tensor, codes: torch.Tensor, sub: int, values: torch.Tensor,
            nibmap: torch.Tensor, code_range: tuple[int, int], d_range: tuple[int, int], *,
            simd: bool = True, nthreads: int | None = None):  # fmt: skip
    """MXFP4 ``packed`` [out, cols] with E8M0 ``codes`` [out, cols / 16] -> symmetric int4 in
    one pass: (uint8 bytes like ``packed``, each through nibble map row ``cls * span + d``
    of ``nibmap`` (uint8 [3 * span, 16]); float32 [out, cols / (16 * sub)] group maxima
    ``amax``; the number of codes outside ``code_range``, inclusive: the output is to be
    dropped unless 0). An int group is ``sub`` MX groups; ``values`` float32 [2048] is the
    value of each (E8M0 code * 8 + magnitude code); ``cls`` is 0 / 1 for a group maximum of
    significand 1 / 1.5 and 2 for 0, ``d`` the MX group's code minus the maximum's exponent,
    clamped to ``d_range`` and counted from its low end. None without the kernels."""
    lib = _kernels()
    if lib is None:
        return None
    _mx_pair(packed, codes)
    out, cols = packed.shape
    sub = _int(sub, "mx_int4 sub", 1, 1 << 20)
    try:
        (d_lo, d_hi), (lo, hi) = d_range, code_range
    except (TypeError, ValueError):
        raise ValueError("native MXFP4 -> int4: d_range and code_range must be pairs") from None
    # d is an E8M0 code minus an exponent of the same range: |d| < 512 covers every case,
    # and keeps the C side's row arithmetic far from int32's limits
    d_lo, d_hi = _int(d_lo, "mx_int4 d_range[0]", -512, 512), _int(d_hi, "d_range[1]", -512, 512)
    lo, hi = _int(lo, "mx_int4 code_range[0]", 0, 255), _int(hi, "code_range[1]", 0, 255)
    span = d_hi - d_lo + 1
    if (
        not _cpu(values, nibmap) or (cols // 16) % sub or span < 1 or lo > hi
        or values.dtype != torch.float32 or values.numel() != 2048
        or nibmap.dtype != torch.uint8 or tuple(nibmap.shape) != (3 * span, 16)
    ):  # fmt: skip
        raise ValueError("native MXFP4 -> int4: tables or group size of the wrong shape")
    res = outbuf.empty(packed.shape, packed.dtype)
    amax = torch.empty(out, cols // (16 * sub), dtype=torch.float32)
    n = threads_for(res.numel(), nthreads)
    bad = lib.k3_mx_int4(packed.data_ptr(), codes.data_ptr(), amax.numel(), sub,
                         values.data_ptr(), lo, hi, span, d_lo, d_hi, nibmap.data_ptr(),
                         res.data_ptr(), amax.data_ptr(), _isa(simd), n)  # fmt: skip
    return res, amax, int(bad)


#: int groups of at most this many MX groups: 128 errors below 2**25 each (the tables'
#: bound) sum below 2**32, the kernel's uint32 lanes
SEARCH_MAX_SUB = 4


def mx_int4_search(packed: torch.Tensor, codes: torch.Tensor, sub: int, depth: int,
                   err: torch.Tensor, nibs: torch.Tensor, rel: torch.Tensor,
                   vals: torch.Tensor, zero_scale: float, zero_byte: int,
                   code_range: tuple[int, int], *, loss_tables=None,
                   simd: bool = True, nthreads: int | None = None):  # fmt: skip
    """MXFP4 ``packed`` [out, cols] / E8M0 ``codes`` [out, cols / 16] -> symmetric int4 with
    each int group's scale searched (:mod:`k3convert.quant.mx_int4` builds the tables):
    (uint8 bytes like ``packed``, float32 scales [out, cols / (16 * sub)], the number of
    codes outside ``code_range``: the output is to be dropped unless 0, the loss totals
    or None). ``err`` int32 [8, depth + 1, 256, 16] (read as uint32, each below 2**26),
    ``nibs`` uint8 [8, ncand, depth + 2, 16] (nibble maps), ``rel`` float32 [8, ncand],
    ``vals`` float32 [8]. ``loss_tables``: (ltab uint8 [8 * ncand * (depth + 1) + 1, 2,
    16], sq16 uint8 [16], lval float32 [8, ncand, depth + 1, 16]; built by
    :func:`k3convert.quant.mx_int4.loss_tables`): the kernel then also returns the loss
    against the release's decode, float64 [5] (squared error,
    squared reference, largest |error|, values changed, MX groups changed), summed per
    chunk of :data:`LOSS_CHUNK` int groups in group order and over the chunks here, so
    the figures do not depend on the thread count. None without the kernels."""
    lib = _kernels()
    if lib is None:
        return None
    _mx_pair(packed, codes)
    out, cols = packed.shape
    sub = _int(sub, "mx_int4_search sub", 1, SEARCH_MAX_SUB)
    depth = _int(depth, "mx_int4_search depth", 0, 30)
    try:
        lo, hi = code_range
    except (TypeError, ValueError):
        raise ValueError("native MXFP4 -> int4 search: code_range must be a pair") from None
    lo, hi = _int(lo, "mx_int4_search code_range[0]", 1, 254), _int(hi, "code_range[1]", 1, 254)
    zero_byte = _int(zero_byte, "mx_int4_search zero_byte", 0, 255)
    ncand = rel.shape[-1] if isinstance(rel, torch.Tensor) and rel.ndim == 2 else 0
    if (
        not _cpu(err, nibs, rel, vals) or (cols // 16) % sub or lo > hi
        or not 1 <= ncand <= 16
        or err.dtype != torch.int32 or tuple(err.shape) != (8, depth + 1, 256, 16)
        or int(err.min()) < 0 or int(err.max()) >= 1 << 26
        or nibs.dtype != torch.uint8 or tuple(nibs.shape) != (8, ncand, depth + 2, 16)
        or rel.dtype != torch.float32 or rel.shape[0] != 8
        or vals.dtype != torch.float32 or vals.numel() != 8
        or not isinstance(zero_scale, float)
    ):  # fmt: skip
        raise ValueError("native MXFP4 -> int4 search: tables or group size of the wrong shape")
    if loss_tables is not None:
        if not (isinstance(loss_tables, tuple) and len(loss_tables) == 3
                and all(isinstance(t, torch.Tensor) for t in loss_tables)):  # fmt: skip
            raise ValueError("native MXFP4 -> int4 search: loss_tables must be three tensors")
        ltab, sq16, lval = loss_tables
        if (  # shapes only: any byte of the tables stays in bounds (the kernel masks ranks),
            not _cpu(ltab, sq16, lval)  # and a per-call scan of them cost more than a tensor
            or ltab.dtype != torch.uint8
            or tuple(ltab.shape) != (8 * ncand * (depth + 1) + 1, 2, 16)
            or sq16.dtype != torch.uint8 or sq16.numel() != 16
            or lval.dtype != torch.float32 or tuple(lval.shape) != (8, ncand, depth + 1, 16)
        ):  # fmt: skip
            raise ValueError("native MXFP4 -> int4 search: loss tables of the wrong shape")
    res = torch.empty(packed.shape, dtype=torch.uint8)
    scale = torch.empty(out, cols // (16 * sub), dtype=torch.float32)
    n = threads_for(res.numel(), nthreads)
    chunks = -(-scale.numel() // LOSS_CHUNK)
    loss = torch.zeros(chunks, 5, dtype=torch.float64) if loss_tables is not None else None
    lt = (None, None, None) if loss is None else (ltab.data_ptr(), sq16.data_ptr(), lval.data_ptr())
    bad = lib.k3_mx_int4_search(packed.data_ptr(), codes.data_ptr(), scale.numel(), sub, depth,
                                err.data_ptr(), nibs.data_ptr(), ncand, rel.data_ptr(),
                                vals.data_ptr(), zero_scale, zero_byte, lo, hi, res.data_ptr(),
                                scale.data_ptr(), *lt, None if loss is None else loss.data_ptr(),
                                LOSS_CHUNK,
                                _isa(simd), n)  # fmt: skip
    if loss is not None and chunks != 1:  # the chunks' sums and the largest error
        top = loss[:, 2].amax() if chunks else torch.zeros((), dtype=torch.float64)
        loss = torch.cat([loss[:, [0, 1]].sum(0), top.view(1), loss[:, [3, 4]].sum(0)])
    elif loss is not None:
        loss = loss[0]
    return res, scale, int(bad), loss

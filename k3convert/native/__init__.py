"""Small C kernels for the byte loops torch has no fast op for, compiled on first use.

``fp4_kernels.c`` (shipped with the package) holds table gathers keyed by (group key,
stored byte) and the per-group maximum E2M1 code: the MXFP4 / NVFP4 decode and the
MXFP4 requantization (:mod:`k3convert.quant.fp4_decode`, :mod:`k3convert.quant.fp4_requant`)
run through them when they are available, and through torch ops giving the same bytes
otherwise (tests/test_fp4_requant.py checks both paths against each other and against the
reference).

Build: the system C compiler (``$CC``, else ``cc``) with ``-O3 -shared -fPIC -pthread``,
once per source / compiler pair, into ``$K3CONVERT_KERNEL_CACHE`` (default
``$XDG_CACHE_HOME/k3convert/kernels``, i.e. ``~/.cache/k3convert/kernels``): a temporary
name, then an atomic rename, so concurrent processes never load a half-written library.
No compiler, a failing build or ``K3CONVERT_NATIVE=0``: the torch path, and
:func:`status` says why. Only this package's own source is ever compiled or loaded;
nothing comes from a model directory.

Threads: every kernel takes a thread count (``nthreads=``; default :func:`threads_for`:
torch's intra-op thread count, one thread below ~1 MiB of output) and splits its groups
into that many contiguous ranges run by pthreads, the calling thread taking the first;
the bytes written do not depend on the count (tests/test_fp4_requant.py checks 1, 2, 3).

Vector ISA: each kernel has a portable loop and an AVX2 one, the bfloat16 FP4 decode an
AVX-512 (BW + VBMI) one too; a call runs the widest the CPU has (:func:`cpu_level`)
capped by torch's CPU capability (:func:`simd_level`: ``ATEN_CPU_CAPABILITY=default`` or
``=avx2`` pins these loops as it pins torch's). Every level writes the same bytes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from . import outbuf

SOURCE = Path(__file__).with_name("fp4_kernels.c")
ABI = 16
_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-pthread"]

#: False: every caller takes its torch path (tests compare the two)
ENABLED = True
#: output bytes below which a kernel runs on the calling thread alone: under ~1 MiB the
#: threads' start and join (tens of microseconds each) cost more than they save
PAR_MIN_BYTES = 1 << 20

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # why there is no library (None: not tried yet, or loaded)
_tried = False


def cache_dir() -> Path:
    env = os.environ.get("K3CONVERT_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "k3convert" / "kernels"


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _private_dir(d: Path) -> Path:
    """``d``, created 0700 if missing, refused unless this user owns it and nobody else
    may write to it: a library found there is loaded, so it must be ours."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(
            f"kernel cache {d} is not private to this user (owner uid {st.st_uid}, mode "
            f"{st.st_mode & 0o777:o}); set K3CONVERT_KERNEL_CACHE to a directory of your own"
        )
    return d


def _build(cc: str, *, rebuild: bool = False) -> Path:
    src = SOURCE.read_bytes()
    ver = subprocess.run([cc, "--version"], capture_output=True, timeout=60).stdout
    key = hashlib.sha256(src + ver + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out = _private_dir(cache_dir()) / f"fp4_kernels-{key}.so"
    if out.is_file() and not rebuild:
        return out
    fd, tmp = tempfile.mkstemp(prefix=".fp4_kernels-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *_FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, timeout=300)
        if r.returncode != 0:
            err = r.stderr.decode(errors="replace").strip()[-500:]
            raise OSError(f"{cc} exited {r.returncode}: {err}")
        os.chmod(tmp, 0o755)
        with open(tmp, "rb") as f:  # durable before it is named: no empty library survives
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load(cc: str) -> ctypes.CDLL:
    """The cached library, rebuilt once when the cached file does not load."""
    try:
        return ctypes.CDLL(str(_build(cc)))
    except OSError:
        return ctypes.CDLL(str(_build(cc, rebuild=True)))


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
    lib.k3_nv_maxkeys.argtypes = [p, p, i64, p, p, i32, i32]
    lib.k3_nv_maxkeys.restype = None
    lib.k3_nv_requant.argtypes = [p, p, p, i64, p, p, p, p, i32, i32]
    lib.k3_nv_requant.restype = None
    lib.k3_gather_nib.argtypes = [p, p, i64, p, p, i32, i32]
    lib.k3_gather_nib.restype = None
    lib.k3_mx_int4.argtypes = [p, p, i64, i64, p, *[i32] * 5, p, p, p, i32, i32]
    lib.k3_mx_int4.restype = i64
    lib.k3_fp4_kernels_version.restype = ctypes.c_int
    lib.k3_fp4_simd_level.restype = ctypes.c_int


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call; None where they cannot be had."""
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
            cc = _compiler()
            if cc is None:
                raise OSError("no C compiler (set CC, or install cc / gcc)")
            lib = _load(cc)
            _declare(lib)
            if lib.k3_fp4_kernels_version() != ABI:
                raise OSError("the cached library's ABI does not match this k3convert")
            _lib = lib
        except Exception as e:  # any failure to build or load: the torch path, and why
            _why = f"{type(e).__name__}: {e}" if not isinstance(e, OSError) else str(e)
        _tried = True
    return _lib


def status() -> str:
    """One line: whether the kernels are in use, and why not."""
    lib = library()
    return "native FP4 kernels: in use" if lib is not None else f"native FP4 kernels: off ({_why})"


def threads_for(out_bytes: int, nthreads: int | None = None) -> int:
    """The thread count a kernel writing ``out_bytes`` runs with: ``nthreads`` where given
    (at least 1), else torch's intra-op count (``torch.get_num_threads()``), or 1 below
    :data:`PAR_MIN_BYTES` of output."""
    if nthreads is not None:
        if isinstance(nthreads, bool) or not isinstance(nthreads, int):
            raise ValueError(f"native kernels: nthreads must be an int, got {nthreads!r}")
        return max(1, nthreads)
    return torch.get_num_threads() if out_bytes >= PAR_MIN_BYTES else 1


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
    want = top if simd is True else int(simd)
    return max(0, min(want, top, simd_level()))


_WORDS = {1: "k3_gather_u8", 4: "k3_gather_u32", 8: "k3_gather_u64"}


def gather(src: torch.Tensor, key: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
           *, nthreads: int | None = None) -> bool:  # fmt: skip
    """``out.view(-1)[g * per + j] = table[key[g] << 8 | src.view(-1)[g * per + j]]``:
    uint8 ``src`` of ``groups * per`` bytes, int32 ``key`` [groups] (values in
    ``[0, len(table) / 256)``), ``table`` and ``out`` of one 1-, 4- or 8-byte dtype, all
    contiguous CPU tensors. False (nothing done) where the kernels are unavailable."""
    lib = library() if ENABLED else None
    if lib is None:
        return False
    size = table.element_size()
    groups = key.numel()
    if (
        src.dtype != torch.uint8 or key.dtype != torch.int32 or out.dtype != table.dtype
        or size not in _WORDS or not groups or src.numel() % groups
        or out.numel() != src.numel() or table.numel() % 256
        or not all(t.is_contiguous() and t.device.type == "cpu" for t in (src, key, table, out))
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
    lib = library() if ENABLED else None
    if lib is None:
        return False
    if (
        src.dtype != torch.uint8 or out.dtype != torch.uint8 or per < 1
        or src.numel() != out.numel() * per
        or not (src.is_contiguous() and out.is_contiguous())
        or src.device.type != "cpu" or out.device.type != "cpu"
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
    lib = library() if ENABLED else None
    if lib is None:
        return None
    out, cols = packed.shape if packed.ndim == 2 else (0, 0)
    per = group // 2  # stored bytes per scale byte
    if (
        dtype not in _OUT_DTYPES or group not in (16, 32) or packed.dtype != torch.uint8
        or codes.dtype != torch.uint8 or packed.ndim != 2 or cols % per
        or tuple(codes.shape) != (out, cols // per)
        or values.dtype != dtype or tuple(values.shape) != (256, 16)
        or not all(t.device.type == "cpu" for t in (packed, codes, values))
        or not (packed.is_contiguous() and codes.is_contiguous())
    ):  # fmt: skip
        raise ValueError("native FP4 decode: arguments of the wrong dtype, size or layout")
    res = outbuf.empty((out, 2 * cols), dtype)  # reused pages: no faults per tensor
    lut = decode_table(values, dtype) if table is None else table
    fn = lib.k3_fp4_lut_bf16 if dtype == torch.bfloat16 else lib.k3_fp4_lut_f32
    n = threads_for(res.numel() * res.element_size(), nthreads)
    fn(packed.data_ptr(), codes.data_ptr(), codes.numel(), per, lut.data_ptr(),
       res.data_ptr(), _isa(simd, 2), n)  # fmt: skip
    return res


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
    out, cols = packed.shape if packed.ndim == 2 else (0, 0)
    if (
        packed.dtype != torch.uint8 or codes.dtype != torch.uint8 or packed.ndim != 2
        or cols % 16 or tuple(codes.shape) != (out, cols // 16)
        or not (packed.is_contiguous() and codes.is_contiguous())
        or packed.device.type != "cpu" or codes.device.type != "cpu"
    ):  # fmt: skip
        raise ValueError("native MXFP4 -> NVFP4: parts of the wrong dtype, shape or layout")


def nv_maxkeys(packed: torch.Tensor, codes: torch.Tensor, *, simd: bool = True,
               nthreads: int | None = None):  # fmt: skip
    """(uint8 [out, cols / 8] largest magnitude code of each NVFP4 group, uint8 [2048]
    1 at E8M0 code * 8 + the larger of an MX group's two NVFP4 maxima, for every MX group,
    else 0) of MXFP4 ``packed`` [out, cols] with ``codes`` [out, cols / 16]; None without
    the kernels. Every NVFP4 group's key (code * 8 + its maximum) is at most a marked key
    of its code."""
    lib = library() if ENABLED else None
    if lib is None:
        return None
    _mx_pair(packed, codes)
    m = torch.empty(packed.shape[0], packed.shape[1] // 8, dtype=torch.uint8)
    seen = torch.zeros(2048, dtype=torch.uint8)
    n = threads_for(packed.numel(), nthreads)  # the work is the bytes read
    lib.k3_nv_maxkeys(packed.data_ptr(), codes.data_ptr(), m.numel(), m.data_ptr(),
                      seen.data_ptr(), _isa(simd), n)  # fmt: skip
    return m, seen


def nv_requant(packed, codes, m, table, scales, *, simd: bool = True,
               nthreads: int | None = None):  # fmt: skip
    """(NVFP4 bytes like ``packed``, e4m3 scale bytes like ``m``): ``table`` uint8 [2048 *
    16], the output nibble of each input nibble, and ``scales`` uint8 [2048], both indexed
    by key ``codes[g // 2] * 8 + m[g]`` (every key < 2048 by construction); None without
    the kernels."""
    lib = library() if ENABLED else None
    if lib is None:
        return None
    _mx_pair(packed, codes)
    if (
        m.dtype != torch.uint8 or m.shape != (packed.shape[0], packed.shape[1] // 8)
        or table.dtype != torch.uint8 or table.numel() != 2048 * 16
        or scales.dtype != torch.uint8 or scales.numel() != 2048
        or not all(t.is_contiguous() and t.device.type == "cpu" for t in (m, table, scales))
    ):  # fmt: skip
        raise ValueError("native MXFP4 -> NVFP4: tables of the wrong dtype or size")
    out = outbuf.empty(packed.shape, packed.dtype)
    sout = torch.empty_like(m)
    ptrs = (t.data_ptr() for t in (packed, codes, m))
    n = threads_for(out.numel(), nthreads)
    lib.k3_nv_requant(*ptrs, m.numel(), table.data_ptr(), scales.data_ptr(), out.data_ptr(),
                      sout.data_ptr(), _isa(simd), n)  # fmt: skip
    return out, sout


def gather_nib(src: torch.Tensor, key: torch.Tensor, nibmap: torch.Tensor, out: torch.Tensor,
               *, simd: bool = True, nthreads: int | None = None) -> bool:  # fmt: skip
    """``out`` = each byte of uint8 ``src`` (groups of 16 bytes, one int32 ``key`` each)
    through the 16-entry nibble map ``nibmap[key]`` (uint8 [rows * 16]): low and high
    nibble mapped on their own. False where the kernels are unavailable."""
    lib = library() if ENABLED else None
    if lib is None:
        return False
    groups = key.numel()
    if (
        src.dtype != torch.uint8 or out.dtype != torch.uint8 or key.dtype != torch.int32
        or nibmap.dtype != torch.uint8 or nibmap.numel() % 16 or not groups
        or src.numel() != 16 * groups or out.numel() != src.numel()
        or not all(t.is_contiguous() and t.device.type == "cpu" for t in (src, key, nibmap, out))
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
    lib = library() if ENABLED else None
    if lib is None:
        return None
    _mx_pair(packed, codes)
    out, cols = packed.shape
    d_lo, d_hi = d_range
    span = d_hi - d_lo + 1
    lo, hi = code_range
    if (
        sub < 1 or (cols // 16) % sub or span < 1 or not 0 <= lo <= hi <= 255
        or values.dtype != torch.float32 or values.numel() != 2048
        or nibmap.dtype != torch.uint8 or tuple(nibmap.shape) != (3 * span, 16)
        or not (values.is_contiguous() and nibmap.is_contiguous())
        or values.device.type != "cpu" or nibmap.device.type != "cpu"
    ):  # fmt: skip
        raise ValueError("native MXFP4 -> int4: tables or group size of the wrong shape")
    res = outbuf.empty(packed.shape, packed.dtype)
    amax = torch.empty(out, cols // (16 * sub), dtype=torch.float32)
    n = threads_for(res.numel(), nthreads)
    bad = lib.k3_mx_int4(packed.data_ptr(), codes.data_ptr(), amax.numel(), sub,
                         values.data_ptr(), lo, hi, span, d_lo, d_hi, nibmap.data_ptr(),
                         res.data_ptr(), amax.data_ptr(), _isa(simd), n)  # fmt: skip
    return res, amax, int(bad)

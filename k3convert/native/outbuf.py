"""Reused output memory for the FP4 decodes: no page faults on every tensor.

A decoded expert is 4x (bfloat16) or 8x (float32) its stored bytes, and a fresh
``torch.empty`` of that size is, as often as not, fresh memory from the kernel: glibc
serves requests above its mmap threshold (dynamic, at most 32 MiB) with a new mapping
and unmaps it on free, so every first write faults a zeroed page in. Measured on 2 cores:
12 ms to fault in a 22 MB bfloat16 expert tensor against 1 ms to decode into it, and
with a decode-then-drop loop glibc handed out fresh memory for two tensors in three.

:func:`empty` keeps the memory instead: an output of at least :data:`MIN_BYTES` is a
view of an anonymous private mapping (rounded up to 2 MiB) that goes back to a free
list when the last tensor using it dies (a ``weakref.finalize`` on the numpy array
torch's storage holds), and the next output of the same rounded size takes it, pages
already in. A new mapping asks for transparent huge pages (``MADV_HUGEPAGE``, taken
where THP is ``always`` or ``madvise``): its first fill then faults 2 MiB at a time
(measured: 2.5 ms against 12 for a 22 MB expert). The free list holds at most
``$K3CONVERT_OUTPUT_POOL`` bytes (default 256 MiB; 0 turns the pool off); what does not
fit is unmapped. The tensors are ordinary CPU tensors (their storage cannot be resized
in place, as any tensor made from numpy memory), their contents before the kernel writes
them undefined, as ``torch.empty``'s.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import weakref

import numpy as np
import torch

from ..errors import ConfigError

#: outputs below this are plain torch.empty (the allocator's own free lists serve them)
MIN_BYTES = 1 << 20
#: mapping sizes are rounded up to this, so nearby shapes share buffers
ROUND = 2 << 20
#: private anonymous mapping flags (None where the platform has none: no pool)
_ANON = (
    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")
    else None
)


#: madvise advice asking for transparent huge pages (None where the platform has none)
_HUGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _limit() -> int:
    raw = os.environ.get("K3CONVERT_OUTPUT_POOL", str(256 << 20))
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError(
            f"K3CONVERT_OUTPUT_POOL={raw!r}: not a byte count; set it to the bytes of "
            f"decoded-output memory to keep for reuse (0 turns the pool off) or unset it"
        )
    return n


class OutputPool:
    """Free anonymous mappings keyed by size; at most ``limit`` bytes of them kept."""

    def __init__(self, limit: int | None = None):
        self.limit = _limit() if limit is None else limit
        self._free: dict[int, list[mmap.mmap]] = {}
        self._held = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def held(self) -> int:
        """Bytes on the free list now."""
        return self._held

    def _give_back(self, size: int, mm: mmap.mmap) -> None:
        with self._lock:
            if self._held + size <= self.limit:
                self._free.setdefault(size, []).append(mm)
                self._held += size
        # else: dropped here; unmapped when the dying array lets go of its buffer (it
        # still holds it while its finalizers run, so no close() here)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor, from the free list where one fits."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes < MIN_BYTES or self.limit <= 0 or _ANON is None:
            return torch.empty(shape, dtype=dtype)
        size = -(-nbytes // ROUND) * ROUND
        with self._lock:
            free = self._free.get(size)
            mm = free.pop() if free else None
            if mm is not None:
                self._held -= size
                self.hits += 1
            else:
                self.misses += 1
        if mm is None:
            mm = mmap.mmap(-1, size, flags=_ANON)
            if _HUGE is not None:  # 2 MiB pages where the kernel has them: a 22 MB expert
                # faulted in 2.5 ms instead of 12 (measured); refused (THP off): 4 KiB pages
                with contextlib.suppress(OSError):
                    mm.madvise(_HUGE)
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        # torch's storage holds arr until the last view of it dies; then the mapping is free
        weakref.finalize(arr, self._give_back, size, mm).atexit = False
        return torch.from_numpy(arr).view(dtype).view(shape)


_pool: OutputPool | None = None
_pool_lock = threading.Lock()


def pool() -> OutputPool:
    """The process's pool (created on first use, sized by ``$K3CONVERT_OUTPUT_POOL``)."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = OutputPool()
    return _pool


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """:meth:`OutputPool.empty` of the process's pool."""
    return pool().empty(tuple(shape), dtype)

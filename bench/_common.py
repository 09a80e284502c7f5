"""Helpers shared by the benchmark scripts (run as `python bench/NAME.py`)."""

from __future__ import annotations

import os


def evict(paths) -> bool:
    """Drop clean pages of ``paths`` from the page cache (best effort, no root needed).

    Returns False if any file could not be evicted (the "cold" rows are then warm-ish).
    """
    ok = True
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            ok = False
    return ok

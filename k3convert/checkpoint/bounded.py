"""Reading a small input file (config, tokenizer, index, report) with bounds.

Every JSON / text file k3convert reads from a model or output directory goes through
:func:`read_bytes` / :func:`read_json`:

* regular files only: a FIFO, socket or device named like a file is refused without
  blocking on it (opened ``O_NONBLOCK``, checked with ``fstat`` on the opened file, so a
  name swapped between a check and the open is caught too);
* a size cap per kind of file (:data:`LIMITS`), checked before a byte is read: a
  100 MB ``config.json`` is an error, not gigabytes of Python objects;
* strict JSON (:func:`~.safetensors_io.strict_json_loads`): a key given twice, nesting
  deeper than the parser takes, ``NaN`` / ``Infinity`` (with ``finite``) are one-line
  errors of the caller's class, never a RecursionError traceback.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..errors import CheckpointError, K3Error
from .safetensors_io import strict_json_loads

MiB = 1 << 20
#: the most each kind of file may hold. A real release's files sit far below: Kimi K3's
#: config.json is ~10 KB, its weight index ~60 MB (half a million tensor names), a
#: 256K-vocabulary tokenizer.json ~30 MB
LIMITS = {
    "config": 16 * MiB,
    "index": 256 * MiB,
    "tokenizer": 64 * MiB,
    "processor": 1 * MiB,
    "output index": 256 * MiB,
    "report": 64 * MiB,
}


def read_bytes(path: str | os.PathLike, kind: str, error: type[K3Error] = CheckpointError) -> bytes:
    """The bytes of regular file ``path``, at most ``LIMITS[kind]`` of them."""
    p = Path(path)
    limit = LIMITS[kind]
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{p}: cannot read ({e.strerror}).") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(
                f"{p}: is not a regular file (a FIFO, socket, device or directory); "
                f"k3convert reads only regular files - replace it with the real file."
            )
        if st.st_size > limit:
            raise error(
                f"{p}: {st.st_size / MiB:.1f} MiB, more than the {limit // MiB} MiB a {kind} "
                f"file may hold; this is not a real model's {kind} file - check the path, "
                f"or trim the file."
            )
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)
    except OSError as e:
        raise error(f"{p}: cannot read ({e.strerror}).") from e
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while being read
        raise error(f"{p}: grew past the {limit // MiB} MiB a {kind} file may hold.")
    return data


def read_text(path: str | os.PathLike, kind: str, error: type[K3Error] = CheckpointError) -> str:
    p = Path(path)
    data = read_bytes(p, kind, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text (byte {e.start}); JSON files must be UTF-8.") from e


def read_json(
    path: str | os.PathLike,
    kind: str,
    error: type[K3Error] = CheckpointError,
    *,
    finite: bool = False,
    obj: bool = True,
):
    """Strict, bounded JSON of regular file ``path`` (``obj``: it must be an object)."""
    p = Path(path)
    text = read_text(p, kind, error)
    try:
        data = strict_json_loads(text, f"{p}: key", error, finite=finite)
    except json.JSONDecodeError as e:
        raise error(f"{p}: not valid JSON ({e}).") from e
    if obj and not isinstance(data, dict):
        raise error(f"{p}: expected a JSON object, got {type(data).__name__}.")
    return data

"""Reading a small input file (config, tokenizer, index, report) with bounds.

Every JSON / text file k3convert reads from a model or output directory goes through
:func:`read_bytes` / :func:`read_json`:

* regular files only (:func:`~.safetensors_io.open_regular`): a FIFO, socket or device
  named like a file is refused without blocking on it;
* a size cap per kind of file (:data:`LIMITS`), checked before a byte is read: a
  100 MB ``config.json`` is an error, not gigabytes of Python objects;
* strict JSON (:func:`~.safetensors_io.strict_json_loads`): a key given twice, nesting
  deeper than the parser takes, ``NaN`` / ``Infinity`` (with ``finite``) are one-line
  errors of the caller's class, never a RecursionError traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import CheckpointError, K3Error
from .safetensors_io import open_regular, strict_json_loads

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


def _open(p: Path, kind: str, error: type[K3Error]):
    """``p`` opened (a regular file: :func:`~.safetensors_io.open_regular`) and checked
    against ``LIMITS[kind]`` before a byte is read."""
    limit = LIMITS[kind]
    fh = open_regular(p, error)
    size = os.fstat(fh.fileno()).st_size
    if size > limit:
        fh.close()
        raise error(
            f"{p}: {size / MiB:.1f} MiB, more than the {limit // MiB} MiB a {kind} file may "
            f"hold; this is not a real model's {kind} file - check the path, or trim the file."
        )
    return fh


def check_file(path: str | os.PathLike, kind: str, error: type[K3Error] = CheckpointError) -> None:
    """``error`` unless ``path`` is a regular file under ``LIMITS[kind]``; nothing read (for
    a file another library reads next: transformers' tokenizer files)."""
    _open(Path(path), kind, error).close()


def read_bytes(path: str | os.PathLike, kind: str, error: type[K3Error] = CheckpointError) -> bytes:
    """The bytes of regular file ``path``, at most ``LIMITS[kind]`` of them."""
    p = Path(path)
    limit = LIMITS[kind]
    with _open(p, kind, error) as fh:
        try:
            data = fh.read(limit + 1)
        except OSError as e:
            raise error(f"{p}: cannot read ({e.strerror}).") from e
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

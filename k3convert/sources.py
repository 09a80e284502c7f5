"""One entry point for "a thing weights can be read from": checkpoint or stream dir.

A directory with a ``manifest.json`` is a MUSA stream (k3convert shard output);
anything else is opened as a Hugging Face checkpoint. Both give ``config``,
``names()``, ``meta(name)`` and ``get(name, dtype)``, the runtime's weight source.
"""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint import open_checkpoint
from .stream import open_stream
from .stream.format import is_stream_dir


def open_source(path: str | os.PathLike):
    """A Checkpoint, or a Stream for a stream directory (``forward`` runs every rank of it)."""
    p = Path(path)
    if is_stream_dir(p):
        return open_stream(p)
    return open_checkpoint(p)

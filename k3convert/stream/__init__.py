"""The MUSA streaming format (spec: formats/musa-stream.md): reader and checker.

``open_stream(OUT)`` -> :class:`Stream` (validated manifest and rank files;
``rank(r).units()`` streams one rank's units in execution order with read-ahead, zstd
and hash verification; a single-rank stream is itself a weight source like a
Checkpoint). ``check(OUT)`` verifies a whole directory. ``read_manifest_doc`` /
``write_manifest_doc``: the whole manifest as one document (every rank's units inline)
for tools and tests. The writer lives in :mod:`k3convert.shard`.
"""

from .check import CheckReport, check
from .format import (
    ALIGN,
    FORMAT,
    MANIFEST,
    VERSION,
    IncompleteStreamError,
    ManifestError,
    NotAStreamError,
    ShardError,
    SplitError,
    StreamCorruptError,
    StreamError,
    StreamVersionError,
)
from .manifest_doc import read_manifest_doc, write_manifest_doc
from .reader import RankReader, Stream, Unit, load_manifest, open_stream
from .schema import manifest_schema, validate, validate_rank_file

__all__ = [
    "ALIGN",
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "CheckReport",
    "IncompleteStreamError",
    "ManifestError",
    "NotAStreamError",
    "RankReader",
    "ShardError",
    "SplitError",
    "Stream",
    "StreamCorruptError",
    "StreamError",
    "StreamVersionError",
    "Unit",
    "check",
    "load_manifest",
    "manifest_schema",
    "open_stream",
    "read_manifest_doc",
    "validate",
    "validate_rank_file",
    "write_manifest_doc",
]

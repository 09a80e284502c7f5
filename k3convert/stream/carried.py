"""A stream's carried files (config.json, tokenizer, processor) against the manifest:
each read once as a regular file, its size and sha256 compared with what the manifest's
``files`` records, so the runtime never uses a config or tokenizer that changed after
the stream was written."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..checkpoint.bounded import read_bytes
from ..checkpoint.safetensors_io import open_regular, strict_json_loads
from .consistency import inside
from .format import StreamCorruptError

CARRIED_FIX = (
    "re-copy the stream, or re-create it with `k3convert shard --force` (`k3convert shard "
    "--check` lists every damaged file)"
)


def carried_entry(manifest: dict, name: str) -> dict | None:
    return next((f for f in manifest["files"] if f["name"] == name), None)


def check_carried_file(p: Path, entry: dict, got: tuple[int, str]) -> None:
    """``got`` (size, sha256 hex of what was read from ``p``) against the manifest's
    ``files`` entry for it."""
    size, digest = got
    if size != entry["bytes"] or digest != entry["sha256"]:
        raise StreamCorruptError(
            f"{p}: carried file {entry['name']} does not match the manifest (sha256 "
            f"mismatch: it was changed after the stream was written); {CARRIED_FIX}."
        )


def file_digest_sha256(p: Path) -> tuple[int, str]:
    """(size, sha256 hex) of regular file ``p``; a missing, unreadable or non-regular
    file (a FIFO is not waited on: :func:`~..checkpoint.safetensors_io.open_regular`) is
    StreamCorruptError."""
    h, size = hashlib.sha256(), 0
    with open_regular(p, StreamCorruptError) as fh:
        try:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
        except OSError as e:
            raise StreamCorruptError(
                f"{p}: carried file cannot be read ({e.strerror}); {CARRIED_FIX}."
            ) from e
    return size, h.hexdigest()


def load_carried_config(root: Path, manifest: dict) -> dict:
    """The stream's config.json, read once (a regular file under the config size cap),
    checked against the size and sha256 the manifest's ``files`` records, and parsed
    from the checked bytes (strict JSON, an object); ``{}`` for a stream that carries
    none. A config.json the manifest does not list, one listed but missing, or one
    whose bytes differ is StreamCorruptError naming the file."""
    p = inside(root, "config.json", "carried file")
    entry = carried_entry(manifest, "config.json")
    if entry is None:
        if os.path.lexists(p):
            raise StreamCorruptError(
                f"{p}: is not among the carried files the manifest lists (manifest.json "
                f"files), so it was not written with the stream; the runtime will not use "
                f"it - remove it, or {CARRIED_FIX}."
            )
        return {}
    data = read_bytes(p, "config", StreamCorruptError)
    check_carried_file(p, entry, (len(data), hashlib.sha256(data).hexdigest()))
    try:
        text = data.decode("utf-8")
        doc = strict_json_loads(text, f"{p}: key", StreamCorruptError)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StreamCorruptError(
            f"{p}: the stream's carried config.json is not valid JSON ({e}); {CARRIED_FIX}."
        ) from e
    if not isinstance(doc, dict):
        raise StreamCorruptError(
            f"{p}: the stream's carried config.json holds a {type(doc).__name__}, not a "
            f"JSON object; {CARRIED_FIX}."
        )
    return doc

"""``check(out)``: verify a whole stream directory and say how it is broken.

Every unit is checked (size, hash of the stored bytes, zstd decompression with the
uncompressed size and hash, safetensors header against the manifest), and so is every
carried file (config, tokenizer, ...). Problems are collected, not raised, so one run
lists all of them. The CLI maps ``report.exit_code``: 0 intact, 1 damaged, 2 not a
stream directory (including an interrupted conversion and an unknown format version).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .consistency import check_unit_entries, coverage_problems, inside
from .format import (
    MANIFEST,
    IncompleteStreamError,
    ManifestError,
    NotAStreamError,
    StreamCorruptError,
    StreamError,
    StreamVersionError,
)
from .reader import load_manifest, manifest_where
from .unit_loader import header_of, read_unit_bytes

EXIT = {"intact": 0, "damaged": 1, "not_stream": 2}


@dataclass
class CheckReport:
    path: Path
    status: str  # intact | damaged | not_stream
    problems: list[str] = field(default_factory=list)
    units_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "intact"

    @property
    def exit_code(self) -> int:
        return EXIT[self.status]

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "status": self.status,
            "exit_code": self.exit_code,
            "units_checked": self.units_checked,
            "bytes_checked": self.bytes_checked,
            "problems": list(self.problems),
        }

    def __str__(self) -> str:
        head = (
            f"{self.path}: {self.status} ({self.units_checked} units, "
            f"{self.bytes_checked / 1e6:.1f} MB checked)"
        )
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])


def check(out, *, workers: int = 2, ranks=None) -> CheckReport:
    """Verify every unit and carried file of the stream directory ``out``; ``ranks``: only
    the units of these ranks (a torchrun process checks what it will read)."""
    root = Path(out)
    try:
        manifest = load_manifest(root)
    except (NotAStreamError, IncompleteStreamError, StreamVersionError) as e:
        return CheckReport(root, "not_stream", [str(e)])
    except (ManifestError, StreamCorruptError) as e:
        return CheckReport(root, "damaged", [str(e)])
    jobs = [
        (r["rank"], u)
        for r in manifest["ranks"]
        if ranks is None or r["rank"] in ranks
        for u in r["units"]
    ]

    def one(job) -> str | None:
        rank, u = job
        try:
            check_unit_entries(u, manifest_where(root, rank, u))  # once, before reading
            buf, path = read_unit_bytes(root, rank, u, verify=True, full=True)
            header_of(buf, rank, u, path, root)
        except StreamError as e:
            return str(e)
        return None

    problems: list[str] = coverage_problems(manifest, root / MANIFEST)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        problems += [p for p in pool.map(one, jobs) if p]
    for f in manifest["files"]:
        try:
            p = inside(root, f["name"], "carried file")  # before anything is opened
        except StreamCorruptError as e:
            problems.append(str(e))
            continue
        if not p.is_file():
            problems.append(f"{p}: carried file is missing (or not a regular file).")
            continue
        try:
            with open(p, "rb") as fh:
                got = hashlib.file_digest(fh, "sha256").hexdigest()
        except OSError as e:
            problems.append(f"{p}: carried file cannot be read ({e.strerror}).")
            continue
        if got != f["sha256"]:
            problems.append(f"{p}: sha256 mismatch with the manifest; the file was changed.")
    return CheckReport(
        root,
        "damaged" if problems else "intact",
        problems,
        len(jobs),
        sum(u["bytes"] for _, u in jobs),
    )

"""Engine-neutral: an engine target's per-rank files, written through an owned, locked,
resumable stage next to OUT (:class:`~..checkpoint.output.OwnedStage`), then its carried
files and its index, sealed, last; then the rename.

The engine says what its files are called and what its index holds (:class:`EngineFiles`,
the index's fields, each rank's :class:`~.params.Param` list); this module knows no
engine. What it guarantees every engine target:

- every rank's parameters built (every refusal made) before a byte is written;
- each rank file hashed as it is written, durable before its journal entry, each
  tensor checked finite (a non-finite value: ConfigError naming the source tensor, the
  stage removed);
- an interrupted run's rank file kept by a rerun only when its journal entry, its hash
  and the source's content fingerprint (every weight file and config.json, by content)
  all match;
- the index lists every rank file and carried file by size and hash, and seals itself
  (:data:`SEAL`: the hash of its other fields);
- under torchrun, the rank files split over the processes by bytes; process 0 takes,
  finishes and commits the stage.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from ..checkpoint import Checkpoint
from ..checkpoint.bounded import read_json
from ..checkpoint.output import OwnedStage, check_output, write_error
from ..checkpoint.safetensors_io import SafetensorsWriter
from ..errors import ConfigError, K3Error, OutputError
from ..formats.dtypes import all_finite
from ..parallel import procs
from ..parallel.procs import ProcessGroup
from ..shard.unit_io import fsync_path
from ..stream.hashing import digest, file_digest, tag
from ..stream.hashing import new as new_hasher
from ..stream.manifest_doc import atomic_json
from ..units import byte_bar
from .params import Param

#: the index's own hash: of every other field, so an edit of any (what an engine's load
#: call is built from, a version, a field added) is refused
SEAL = "index_hash"


def seal(index: dict, algo: str) -> str:
    """``ALGO:HEX`` of the index's fields but :data:`SEAL`, rendered canonically (keys
    sorted, no whitespace): what the writer stores under :data:`SEAL`, last."""
    body = {k: v for k, v in index.items() if k != SEAL}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return digest(algo, text.encode("utf-8"))


@dataclass(frozen=True)
class EngineFiles:
    """What the writer needs to know of an engine target's files."""

    #: the engine, as messages name it
    engine: str
    #: the progress bar's name for the write
    label: str
    #: the stage's suffix: ``.OUT.{stage}``, kept after an interruption
    stage: str
    #: the index, written last (a directory without it is no output)
    index: str
    #: the journal directory in the stage (one entry per finished rank file)
    journal: str
    #: each file's hash (and the source fingerprint's): ``stream.hashing`` algorithm
    hash: str
    #: any rank file's name, of any layout (owned in the stage, with ``.tmp``)
    rank_file: re.Pattern
    #: the index fields a rank file kept from an interrupted run must have been written
    #: under (with the source's content fingerprint and the file's tensor table)
    resume_key: tuple[str, ...]


@dataclass
class RankFilesResult:
    out: Path
    files: int
    bytes_written: int
    seconds: float
    #: rank files found complete in an interrupted run's stage and kept
    files_resumed: int = 0
    #: rank files written by each torchrun process (one entry: one process)
    per_process: list[int] | None = None


def write_rank_files(
    eng: EngineFiles, *, ck: Checkpoint, origin: Checkpoint, out, ranks: list,
    params_of: Callable[[object], list[Param]], index: dict,
    carried: list[tuple[str, Path | bytes]], force: bool = False, progress: bool = False,
    before_write=None, group: ProcessGroup | None = None,
) -> RankFilesResult:  # fmt: skip
    """Write ``ranks`` (each with ``file()`` and ``tp`` / ``pp``; ``params_of(rank)``:
    its parameters, built again when written), then ``carried`` (``(name, path or
    bytes)``) and ``index`` (the engine's fields; ``files``, ``carried``,
    ``source_files`` and :data:`SEAL` filled in here) into ``out``, through the stage
    (see the module docstring). ``origin``: the checkpoint on disk ``ck`` is made from
    (fingerprinted; ``ck`` itself when it is one). ``before_write(ck)``: called once
    every rank's parameters are built, before a byte is written (a serving check)."""
    group = group if group is not None else ProcessGroup()
    t0 = time.perf_counter()
    # every rank's parameters built once before a byte is written (each refusal comes
    # here), kept only as their sizes; each is built again when written
    sizes = {r: _nbytes(params_of(r)) for r in ranks}
    if before_write is not None:  # the source is valid: can the engine run it?
        before_write(ck)
    mine = procs.balance(ranks, sizes.__getitem__, group.world)[group.rank]
    out = check_output(out, force=force, need_bytes=sum(sizes.values()), source=origin.root)
    expect = getattr(ck, "expect_parts", None)
    if expect is not None:  # produced tensors: kept for their last reader, then dropped
        expect(_reads(params_of(r) for r in mine))
    for key in ("source_files", "carried", "files"):
        index.setdefault(key, [])
    rank_names = {r.file() for r in ranks}
    carried_names = {name for name, _ in carried}

    def owns(name: str) -> bool:
        rank_file = eng.rank_file.fullmatch(name.removesuffix(".tmp"))
        return (name in (eng.journal, eng.index) or name in carried_names or bool(rank_file)
                or name.startswith((f"{eng.index}.tmp-", ".k3-")))  # fmt: skip

    stage, stop = OwnedStage(out, eng.stage, [origin.root]), threading.Event()
    try:
        _take_stage(stage, group, owns, lambda n: n in rank_names or n == eng.journal)
        with ThreadPoolExecutor(max_workers=1) as pool:
            # read while the ranks are written (each process its share of the files);
            # abandoned (stop) if the write fails
            fingerprint = pool.submit(source_fingerprint, origin, eng.hash, stop, group)
            err = None
            try:
                entries, resumed = _write_ranks(eng, stage.work, mine, params_of, index,
                                                fingerprint, progress, ck, sizes)  # fmt: skip
            except BaseException as e:
                err = e
                stop.set()
            # (the hashing thread's one collective is done before the next of this one)
            with contextlib.suppress(Exception):
                fingerprint.result()
        if isinstance(err, OSError):
            err = write_error(err, out)
        try:
            group.agree(err, f"writing the rank files of {out}")
        except K3Error:
            # a damaged or refused source met here: nothing to resume (an interruption,
            # a full disk, OUT appearing, another process's failure: kept for a rerun)
            if group.leader and isinstance(err, K3Error) and not isinstance(
                    err, (OutputError, _Stopped)):  # fmt: skip
                stage.remove(owns)
            raise
        shares = group.gather((entries, resumed))
        err = None
        if group.leader:
            try:
                listed = rank_names | carried_names | {eng.index}
                _finish_stage(eng, stage, out, force, index, shares, ranks, carried,
                              fingerprint.result(), listed)  # fmt: skip
            except BaseException as e:  # (kept for a rerun: OUT appeared, a full disk)
                err = write_error(e, out) if isinstance(e, OSError) else e
        group.agree(err, f"committing {out}")
    finally:
        stop.set()
        stage.close()
    files = group.share(index["files"] if group.leader else None)
    size = sum(f["bytes"] for f in files)
    resumed = sum(k for _, k in shares)
    return RankFilesResult(out, len(files), size, time.perf_counter() - t0, resumed,
                           [len(e) - k for e, k in shares])  # fmt: skip


def rank_key(head: dict, fname: str, params: list[Param]) -> str:
    """What a rank file was written from: ``head`` (the source's content fingerprint, the
    layout and generator) and the file's tensor table. A resumed file must match it."""
    doc = dict(head, rank=fname,
               tensors=[[p.name, str(p.dtype), list(p.shape)] for p in params])  # fmt: skip
    return xxhash.xxh3_128_hexdigest(json.dumps(doc, sort_keys=True).encode())


class _Stopped(K3Error):
    """The source's hashing was abandoned: this write failed, or another process's."""

    def __init__(self):
        super().__init__("stopped: the write failed (here or in another torchrun process)")


def source_fingerprint(ck: Checkpoint, algo: str, stop: threading.Event | None = None,
                       group: ProcessGroup | None = None) -> list[list]:  # fmt: skip
    """[name, bytes, ALGO:HEX] of every weight file and config.json, by content: what a
    rerun must find unchanged to keep an interrupted run's rank files (a file swapped
    for another of the same size and mtime is caught). ``stop``: set to abandon it (a
    failed or interrupted write does not wait for the whole source to be read).
    ``group``: the torchrun job; each process hashes its share of the files (balanced
    by bytes) and every process gets the whole list (one collective, always made)."""
    group = group if group is not None else ProcessGroup()
    files = [*(f.path for f in ck.files()), ck.root / "config.json"]

    def each(_n: int) -> None:
        if stop is not None and stop.is_set():
            raise _Stopped

    hashes = None
    try:
        mine = procs.balance(files, lambda f: f.stat().st_size, group.world)[group.rank]
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            hashes = dict(zip(mine, pool.map(lambda f: file_digest(f, algo, each=each), mine),
                              strict=True))  # fmt: skip
    finally:  # (every process joins the gather, a stopped one too)
        got = group.gather(hashes)
    if any(h is None for h in got):
        raise _Stopped
    merged = {f: h for share in got for f, h in share.items()}
    return [[str(f.relative_to(ck.root)), f.stat().st_size, merged[f]] for f in files]


def _take_stage(stage: OwnedStage, group: ProcessGroup, owns, keep) -> None:
    """Process 0 takes the stage (locked, checked, its stale entries cleaned); the other
    torchrun processes join the same directory."""
    err = None
    if group.leader:
        try:
            stage.open()
            stage.clean(owns, keep=keep)
        except BaseException as e:
            err = e
    group.agree(err, f"preparing {stage.path}")
    ident = group.share(stage.identity() if group.leader else None)
    if not group.leader:
        err = None
        try:
            stage.join(ident)
        except BaseException as e:
            err = e
    group.agree(err, f"joining {stage.path}")


def _finish_stage(eng: EngineFiles, stage: OwnedStage, out: Path, force: bool, index: dict,
                  shares, ranks, carried, source_files, expected: set[str]) -> None:  # fmt: skip
    """Process 0, every rank file written: the carried files, the index (every rank's
    entry, in rank order; sealed last), the journal dropped, the stage renamed to OUT."""
    work = stage.work
    by_name = {e["name"]: e for entries, _ in shares for e in entries}
    index["files"] = [by_name[r.file()] for r in ranks]
    index["source_files"] = source_files
    for name, f in carried:
        if isinstance(f, bytes):
            (work / name).write_bytes(f)
        else:
            shutil.copyfile(f, work / name)
        fsync_path(work / name)
        index["carried"].append({"name": name, "bytes": (work / name).stat().st_size,
                                 "hash": file_digest(work / name, eng.hash)})  # fmt: skip
    stage.check_out(force)  # (before the journal goes: a refusal keeps it resumable)
    shutil.rmtree(work / eng.journal)
    index[SEAL] = seal(index, eng.hash)  # (last: of every other field)
    atomic_json(work / eng.index, json.dumps(index, indent=1) + "\n")  # (fsynced)
    # its refusals (OUT appeared meanwhile) keep the finished stage for a rerun
    stage.commit(expected, force)


def _reads(plans) -> Iterator[tuple[str, str]]:
    """(checkpoint tensor, part) of every read the parameters' values make: one per
    piece (a plain tensor's part is ``weight``)."""
    for params in plans:
        for p in params:
            for pc in p.pieces:
                yield pc.name, pc.part or "weight"


def _nbytes(params: list[Param]) -> int:
    return sum(math.prod(p.shape) * p.dtype.itemsize for p in params)


def _write_ranks(eng: EngineFiles, work: Path, ranks: list, params_of, index: dict,
                 fingerprint, progress: bool, ck: Checkpoint,
                 sizes: dict) -> tuple[list, int]:  # fmt: skip
    """The files of ``ranks`` (``params_of(rank)``: its parameters, built as it is written)
    into the stage ``work``: (their index entries, the number kept from an interrupted
    run)."""
    journal = work / eng.journal
    journal.mkdir(exist_ok=True)
    resumed, entries = 0, []
    total = sum(sizes[r] for r in ranks)
    head = {k: index[k] for k in eng.resume_key if k in index}
    dropped = getattr(ck, "drop_parts", None)
    lay = index["layout"]
    with byte_bar(total=total, desc=f"{eng.label} tp{lay['tp']} pp{lay['pp']}",
                  disable=not progress) as bar:  # fmt: skip
        for r in ranks:
            params = params_of(r)
            key = rank_key(head, r.file(), params)
            entry, kept = _write_rank(work, journal, r, params, key, fingerprint, eng)
            entries.append(entry)
            resumed += kept
            if kept and dropped is not None:  # its reads are not coming
                dropped(_reads([params]))
            bar.update(sizes[r])
    return entries, resumed


def _finite(t: torch.Tensor, p: Param, fname: str, engine: str) -> torch.Tensor:
    """``t`` (a block of parameter ``p``) if every value is finite
    (:func:`~..formats.dtypes.all_finite`), else ConfigError naming the source tensor.
    FP8 codes: the e4m3fn NaN code (there is no inf)."""
    if not t.is_floating_point():
        return t
    if t.dtype == torch.float8_e4m3fn:
        bad = bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    else:
        bad = not all_finite(t if t.element_size() > 1 else t.float())
    if bad:
        names = sorted({pc.name for pc in p.pieces}) or [p.name]
        what = names[0] if len(names) == 1 else f"one of {', '.join(names)}"
        raise ConfigError(
            f"{what}: holds NaN or infinite values ({engine} parameter '{p.name}' of "
            f"{fname}); the source checkpoint is damaged - re-download or re-export it. "
            f"Nothing was written."
        )
    return t


def _write_rank(stage: Path, journal: Path, r, params: list[Param], key: str, fingerprint,
                eng: EngineFiles):  # fmt: skip
    """(index entry, 1 if kept from an interrupted run else 0) of one rank file."""
    fname = r.file()
    path, note = stage / fname, journal / f"{fname}.json"
    try:
        old = read_json(note, "output index", ValueError)
        if (old.get("key") == key and old.get("source") == fingerprint.result()
                and path.stat().st_size == old["entry"]["bytes"]
                and file_digest(path, eng.hash) == old["entry"]["hash"]):  # fmt: skip
            return old["entry"], 1
    except (OSError, ValueError, KeyError, TypeError, K3Error):
        pass
    note.unlink(missing_ok=True)
    tmp = stage / f"{fname}.tmp"
    hasher = new_hasher(eng.hash)  # hashed as written, durable before its journal entry
    with SafetensorsWriter(tmp, [(p.name, p.dtype, p.shape) for p in params],
                           {"format": "pt"}, digest=hasher, durable=True) as w:  # fmt: skip
        for p in params:
            if p.stacked is not None:
                w.write_stacked(p.name, (_finite(t, p, fname, eng.engine) for t in p.stacked()))
            else:
                w.write(p.name, _finite(p.make(), p, fname, eng.engine))
    os.replace(tmp, path)
    entry = {
        "name": fname, "tp_rank": r.tp, "pp_rank": r.pp, "bytes": path.stat().st_size,
        "hash": tag(eng.hash, hasher.hexdigest()),
        "tensors": {p.name: {"dtype": str(p.dtype).removeprefix("torch."),
                             "shape": list(p.shape)} for p in params},
    }  # fmt: skip
    note.write_text(json.dumps({"key": key, "source": fingerprint.result(), "entry": entry}))
    return entry, 0

"""Writing a vLLM sharded_state directory (``shard --target vllm``): the rank files from
:func:`~.vllm_sharded.rank_params`, the carried files and the index, through an owned,
locked, resumable stage next to OUT.

What the index binds (``k3convert-vllm.json``, version 2, written last): every rank file
(size, xxh3-128, tensor table), every carried file (config.json, tokenizer, processor:
size and xxh3-128), and the source it was written from (the content fingerprint of its
weight files and config.json). ``shard --check``, ``verify`` and ``forward`` refuse a
directory holding anything unlisted or changed (:mod:`.vllm_index`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from .. import __version__
from ..arch import resolve
from ..checkpoint import Checkpoint, open_checkpoint
from ..checkpoint.bounded import read_json
from ..checkpoint.output import OwnedStage, check_output, write_error
from ..checkpoint.safetensors_io import SafetensorsWriter
from ..errors import ConfigError, K3Error, OutputError
from ..formats.dtypes import all_finite
from ..parallel import procs
from ..parallel.procs import ProcessGroup
from ..shard.unit_io import fsync_path
from ..shard.writer import carried_files
from ..stream.hashing import file_digest, tag
from ..stream.hashing import new as new_hasher
from ..stream.manifest_doc import atomic_json
from ..units import byte_bar
from .params import Param
from .vllm_index import SEAL, seal
from .vllm_layers import RANK_FILE_RX, Rank
from .vllm_sharded import (
    DESCRIBED,
    FORMAT,
    HASH,
    INDEX,
    INDEX_VERSION,
    JOURNAL,
    MAX_WORLD,
    VLLM_VERSION,
    dtype_of,
    rank_planner,
)


@dataclass
class VllmShardResult:
    out: Path
    files: int
    bytes_written: int
    seconds: float
    #: rank files found complete in an interrupted run's stage and kept
    files_resumed: int = 0
    #: rank files written by each torchrun process (one entry: one process)
    per_process: list[int] | None = None


STAGE = "vllm-partial"  # the stage ``.OUT.vllm-partial``, kept after an interruption


def _stage_of(out: Path) -> Path:
    """Where an unfinished write lives (kept after an interruption, resumed by a rerun)."""
    return out.parent / f".{out.name}.{STAGE}"


def check_layout(ck: Checkpoint, tp: int, pp: int, ep: int) -> None:
    """The layout's numbers, against vLLM's rules and the model, before anything is
    built: positive integers, at most :data:`MAX_WORLD` ranks, tp dividing the attention
    heads, pp at most the layers, ep 1 or tp."""
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--{name} must be a positive integer, got {v!r}.")
    if tp * pp > MAX_WORLD:
        raise ConfigError(
            f"--tp {tp} x --pp {pp} is {tp * pp} ranks, more than the {MAX_WORLD} a layout "
            f"may have; pick the layout of the cluster that will serve it."
        )
    if ep not in (1, tp):
        raise ConfigError(
            f"--ep {ep}: vLLM's enable_expert_parallel spreads the experts over all {tp} tp "
            f"ranks, and its sharded_state files are named by tp / pp rank only (data-"
            f"parallel replicas would read the same file); use --ep {tp} or --ep 1."
        )
    _, cfg = resolve(ck.config, str(ck.root / "config.json"))
    text = getattr(cfg, "text", cfg)
    heads, layers = text.num_heads, text.num_layers
    if tp > heads or heads % tp:
        raise ConfigError(
            f"--tp {tp}: vLLM splits the {heads} attention heads over the tp ranks, so tp "
            f"must divide {heads}; pick one of "
            f"{', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)}."
        )
    if pp > layers:
        raise ConfigError(
            f"--pp {pp}: more pipeline stages than the model's {layers} layers; use at most "
            f"--pp {layers}."
        )


def _rank_key(head: dict, fname: str, params: list[Param]) -> str:
    """What a rank file was written from: ``head`` (the source's content fingerprint, the
    layout and generator) and the file's tensor table. A resumed file must match it."""
    doc = dict(head, rank=fname,
               tensors=[[p.name, str(p.dtype), list(p.shape)] for p in params])  # fmt: skip
    return xxhash.xxh3_128_hexdigest(json.dumps(doc, sort_keys=True).encode())


class _Stopped(K3Error):
    """The source's hashing was abandoned: this write failed, or another process's."""

    def __init__(self):
        super().__init__("stopped: the write failed (here or in another torchrun process)")


def source_fingerprint(ck: Checkpoint, stop: threading.Event | None = None,
                       group: ProcessGroup | None = None) -> list[list]:  # fmt: skip
    """[name, bytes, xxh3-128] of every weight file and config.json, by content: what a
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
            hashes = dict(zip(mine, pool.map(lambda f: file_digest(f, HASH, each=each), mine),
                              strict=True))  # fmt: skip
    finally:  # (every process joins the gather, a stopped one too)
        got = group.gather(hashes)
    if any(h is None for h in got):
        raise _Stopped
    merged = {f: h for share in got for f, h in share.items()}
    return [[str(f.relative_to(ck.root)), f.stat().st_size, merged[f]] for f in files]


def shard_target(src, out, *, tp: int, pp: int, ep: int, force: bool, progress: bool,
                 before_write=None) -> str:  # fmt: skip
    """``shard --target vllm`` (:data:`k3convert.targets.TARGETS`): the write
    (``before_write(ck)``: the serving check, before the first byte) and the line that
    says what was written and how vLLM loads it."""
    from .vllm_index import llm_call

    res = write_vllm(src=src, out=out, tp=tp, pp=pp, ep=ep, force=force, progress=progress,
                     before_write=before_write, group=procs.current())  # fmt: skip
    kept = f" ({res.files_resumed} kept from the interrupted run)" if res.files_resumed else ""
    return (
        f"wrote {res.out}: vLLM sharded_state, {res.files} rank file(s){kept}, "
        f"{res.bytes_written / 2**20:.1f} MiB in {res.seconds:.1f} s; load it with "
        + llm_call(res.out)
    )


def write_vllm(
    *, src: str | os.PathLike | Checkpoint, out: str | os.PathLike, tp: int = 1, pp: int = 1,
    ep: int = 1, force: bool = False, progress: bool = False, before_write=None,
    origin: Checkpoint | None = None, identity=None, carry=None, described: bytes | None = None,
    group: ProcessGroup | None = None,
) -> VllmShardResult:  # fmt: skip
    """Write the sharded_state directory: one safetensors file per rank, then the config /
    tokenizer files and ``k3convert-vllm.json``, in a stage directory next to OUT renamed
    to OUT at the end (:class:`~..checkpoint.output.OwnedStage`: owned, locked, lstat-
    checked). An interrupted run leaves the stage; a rerun keeps every rank file it finds
    complete (its journal entry and hash match, and the source's content fingerprint is
    unchanged) and writes the rest. Every refusal (layout, source, scheme) happens
    before a byte is written; a non-finite value met while writing removes the stage.

    before_write: called with the validated source checkpoint before a byte is written
    (the caller's serving check, :func:`k3convert.serving.vllm_check`: it warns, or
    raises and nothing is written).

    ``src`` may be an open checkpoint whose tensors are produced as they are read
    (``convert``'s :class:`~k3convert.pipeline.planned.PlannedCheckpoint`: one pass, no
    quantized checkpoint on disk). Then ``origin`` is the checkpoint on disk it is made
    from (fingerprinted, named as the index's source), ``identity`` what else the bytes
    depend on (a resumed rank file must have been written under the same), ``carry``
    the non-weight files as ``(name, path or bytes)``, and ``described`` its tensor list
    (:meth:`~k3convert.pipeline.planned.PlannedCheckpoint.layout_doc`, zstd JSON),
    carried as :data:`DESCRIBED` for ``verify`` to map the rank files back.

    ``group``: the torchrun job (default: this process alone). The rank files are split
    over the processes by bytes (:func:`~k3convert.parallel.procs.balance`), each written
    by one; process 0 takes the stage and commits it. The bytes are those of one
    process. A tensor several ranks read is produced by each process holding one of
    them (EP places each routed expert on one rank)."""
    group = group if group is not None else ProcessGroup()
    t0 = time.perf_counter()
    ck = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    origin = ck if origin is None else origin
    check_layout(ck, tp, pp, ep)
    ranks = [Rank(t, p, tp, pp, ep > 1) for p in range(pp) for t in range(tp)]
    params_of = rank_planner(ck, ranks)
    # every rank's parameters built once before a byte is written (each refusal comes
    # here), kept only as their sizes; each is built again when written
    sizes = {r: _nbytes(params_of(r)) for r in ranks}
    if before_write is not None:  # the source is valid: can the engine run it?
        before_write(ck)
    mine = procs.balance(ranks, sizes.__getitem__, group.world)[group.rank]
    out = check_output(out, force=force, need_bytes=sum(sizes.values()), source=origin.root)
    carried = list(carried_files(ck) if carry is None else carry)
    if described is not None:
        carried.append((DESCRIBED, described))
    expect = getattr(ck, "expect_parts", None)
    if expect is not None:  # produced tensors: kept for their last reader, then dropped
        expect(_reads(params_of(r) for r in mine))
    index = {"format": FORMAT, "version": INDEX_VERSION, "generator": f"k3convert {__version__}",
             "vllm": VLLM_VERSION, "model_type": ck.config.get("model_type"),
             "dtype": str(dtype_of(ck)).removeprefix("torch."),
             "layout": {"tp": tp, "pp": pp, "ep": ep},
             "source": str(Path(origin.root).resolve()),
             "source_files": [], "carried": [], "files": []}  # fmt: skip
    if identity is not None:
        index["identity"] = identity
    if described is not None:
        index["described"] = DESCRIBED
    rank_names = {r.file() for r in ranks}
    carried_names = {name for name, _ in carried}

    def owns(name: str) -> bool:
        rank_file = RANK_FILE_RX.fullmatch(name.removesuffix(".tmp"))
        return (name in (JOURNAL, INDEX) or name in carried_names or bool(rank_file)
                or name.startswith((f"{INDEX}.tmp-", ".k3-")))  # fmt: skip

    stage, stop = OwnedStage(out, STAGE, [origin.root]), threading.Event()
    try:
        _take_stage(stage, group, owns, lambda n: n in rank_names or n == JOURNAL)
        with ThreadPoolExecutor(max_workers=1) as pool:
            # read while the ranks are written (each process its share of the files);
            # abandoned (stop) if the write fails
            fingerprint = pool.submit(source_fingerprint, origin, stop, group)
            err = None
            try:
                entries, resumed = _write_ranks(stage.work, mine, params_of, index,
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
                listed = rank_names | carried_names | {INDEX}
                _finish_stage(stage, out, force, index, shares, ranks, carried,
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
    return VllmShardResult(out, len(files), size, time.perf_counter() - t0, resumed,
                           [len(e) - k for e, k in shares])  # fmt: skip


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


def _finish_stage(stage: OwnedStage, out: Path, force: bool, index: dict, shares, ranks,
                  carried, source_files, expected: set[str]) -> None:  # fmt: skip
    """Process 0, every rank file written: the carried files, the index (every rank's
    entry, in rank order), the journal dropped, the stage renamed to OUT."""
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
                                 "hash": file_digest(work / name, HASH)})  # fmt: skip
    stage.check_out(force)  # (before the journal goes: a refusal keeps it resumable)
    shutil.rmtree(work / JOURNAL)
    index[SEAL] = seal(index)  # (last: of every other field)
    atomic_json(work / INDEX, json.dumps(index, indent=1) + "\n")  # (fsynced)
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


def _write_ranks(work: Path, ranks: list[Rank], params_of, index: dict, fingerprint,
                 progress: bool, ck: Checkpoint, sizes: dict) -> tuple[list, int]:  # fmt: skip
    """The files of ``ranks`` (``params_of(rank)``: its parameters, built as it is written)
    into the stage ``work``: (their index entries, the number kept from an interrupted
    run)."""
    journal = work / JOURNAL
    journal.mkdir(exist_ok=True)
    resumed, entries = 0, []
    total = sum(sizes[r] for r in ranks)
    head = {k: index[k] for k in ("generator", "vllm", "layout", "source", "identity")
            if k in index}  # fmt: skip
    dropped = getattr(ck, "drop_parts", None)
    lay = index["layout"]
    with byte_bar(total=total, desc=f"vllm tp{lay['tp']} pp{lay['pp']}",
                  disable=not progress) as bar:  # fmt: skip
        for r in ranks:
            params = params_of(r)
            key = _rank_key(head, r.file(), params)
            entry, kept = _write_rank(work, journal, r, params, key, fingerprint)
            entries.append(entry)
            resumed += kept
            if kept and dropped is not None:  # its reads are not coming
                dropped(_reads([params]))
            bar.update(sizes[r])
    return entries, resumed


def _finite(t: torch.Tensor, p: Param, fname: str) -> torch.Tensor:
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
            f"{what}: holds NaN or infinite values (vLLM parameter '{p.name}' of {fname}); "
            f"the source checkpoint is damaged - re-download or re-export it. Nothing was "
            f"written."
        )
    return t


def _write_rank(stage: Path, journal: Path, r: Rank, params: list[Param], key: str, fingerprint):
    """(index entry, 1 if kept from an interrupted run else 0) of one rank file."""
    fname = r.file()
    path, note = stage / fname, journal / f"{fname}.json"
    try:
        old = read_json(note, "output index", ValueError)
        if (old.get("key") == key and old.get("source") == fingerprint.result()
                and path.stat().st_size == old["entry"]["bytes"]
                and file_digest(path, HASH) == old["entry"]["hash"]):  # fmt: skip
            return old["entry"], 1
    except (OSError, ValueError, KeyError, TypeError, K3Error):
        pass
    note.unlink(missing_ok=True)
    tmp = stage / f"{fname}.tmp"
    digest = new_hasher(HASH)  # hashed as written, durable before its journal entry
    with SafetensorsWriter(tmp, [(p.name, p.dtype, p.shape) for p in params],
                           {"format": "pt"}, digest=digest, durable=True) as w:  # fmt: skip
        for p in params:
            if p.stacked is not None:
                w.write_stacked(p.name, (_finite(t, p, fname) for t in p.stacked()))
            else:
                w.write(p.name, _finite(p.make(), p, fname))
    os.replace(tmp, path)
    entry = {
        "name": fname, "tp_rank": r.tp, "pp_rank": r.pp, "bytes": path.stat().st_size,
        "hash": tag(HASH, digest.hexdigest()),
        "tensors": {p.name: {"dtype": str(p.dtype).removeprefix("torch."),
                             "shape": list(p.shape)} for p in params},
    }  # fmt: skip
    note.write_text(json.dumps({"key": key, "source": fingerprint.result(), "entry": entry}))
    return entry, 0

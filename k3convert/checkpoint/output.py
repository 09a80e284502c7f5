"""Writing outputs safely: checks first, temp dir, rename last, sources never touched.

Every stage that writes (synth, quantize, shard, forward --save-logits) goes through
here, so they share one behaviour:

* :func:`guard_out` refuses, before anything is touched, an OUT that is a source, holds
  a source, lies inside one (symlinks resolved), or is itself a symbolic link; ``--force``
  only ever replaces a previous *output*;
* :func:`staged_output` checks the disk-space estimate, writes into ``.OUT.partial-PID``
  (with an ownership marker naming the process), renames the directory into place only
  when complete (a crash never leaves something that looks finished), and removes stale
  partial directories of earlier runs that it can prove are dead;
* :func:`refuse_partial` keeps readers from taking such a partial directory (or an
  interrupted stream) for a checkpoint;
* every ``OSError`` while writing (disk full, read-only filesystem, permissions) becomes
  one :class:`OutputError` line naming the path.

Shards are named and indexed the way transformers expects.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from ..errors import CheckpointError, OutputError

T = TypeVar("T")
INDEX = "model.safetensors.index.json"
#: ownership marker inside a partial output directory (removed just before the rename)
PARTIAL_MARKER = ".k3-partial.json"
#: an interrupted ``shard`` keeps its journal in OUT until the manifest is written
STREAM_JOURNAL = ".k3-journal"
_PARTIAL_RX = re.compile(r"^\..+\.(partial-\d+|vllm-partial)$")
_RANK_DIR_RX = re.compile(r"rank\d{5}")  # a stream's per-rank folder (formats/musa-stream.md)


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    return shutil.disk_usage(existing_parent(Path(path))).free


def existing_parent(p: Path) -> Path:
    """``p`` resolved, or its nearest ancestor that exists."""
    p = p.resolve()
    while not p.exists():
        p = p.parent
    return p


def group_by_size(items: Sequence[T], size_of: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive groups of at most ``limit`` bytes (an item larger than that stands alone);
    ``limit <= 0`` means one group."""
    if limit <= 0:
        return [list(items)]
    groups: list[list[T]] = [[]]
    size = 0
    for it in items:
        n = size_of(it)
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(it)
        size += n
    return groups


def shard_names(n: int) -> list[str]:
    """``model.safetensors`` for one file, else ``model-0000i-of-0000n.safetensors``."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


# -- OUT versus the sources ----------------------------------------------------------
def guard_out(out: str | os.PathLike, sources: Iterable[str | os.PathLike | None]) -> Path:
    """Refuse an OUT that would destroy or mix with a source; returns ``out`` as a Path.

    Refused: OUT is a symbolic link; OUT resolves to a source, contains one, or lies
    inside one (so neither ``--force`` nor the temp directory next to OUT can touch a
    source). ``sources`` are directories or files that are read (``None`` entries are
    ignored): OUT may sit next to a source file, not at it or above it.
    """
    out = Path(out)
    if out.is_symlink():
        raise OutputError(
            f"{out}: is a symbolic link (to {os.readlink(out)}); k3convert neither writes "
            f"through nor replaces links: give the real path, or remove the link."
        )
    o = out.resolve()
    o_chain = _identities([o, *o.parents])  # OUT and every directory above it
    for s in sources:
        if s is None:
            continue
        sp = Path(s).resolve()
        is_dir = sp.is_dir()
        s_id = _identity(sp)
        # compared by (device, inode), so a bind mount or other alias is caught too
        if o == sp or (s_id is not None and s_id == _identity(o)):
            what = "is the source"
        elif is_dir and s_id is not None and s_id in o_chain[1:]:
            what = f"lies inside the source {sp}"
        elif _identity(o) is not None and _identity(o) in _identities(list(sp.parents)):
            what = f"contains the source {sp}"
        else:
            continue
        raise OutputError(
            f"{out}: {what}; writing there could overwrite or delete the input. Choose an "
            f"OUT outside {sp} (and not a directory above it)."
        )
    return out


def _identity(p: Path) -> tuple[int, int] | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _identities(paths: list[Path]) -> list[tuple[int, int] | None]:
    return [_identity(p) for p in paths]


def check_replaceable(out: Path, looks_like_output: bool, what: str) -> None:
    """``--force`` replaces a previous output, never an arbitrary directory: refuse a
    non-empty OUT that is not ``what`` (``looks_like_output`` False)."""
    if out.is_dir() and not looks_like_output and any(out.iterdir()):
        raise OutputError(
            f"{out}: --force replaces a previous {what}, but this directory is not one "
            f"(and is not empty); remove it yourself if that is really meant, or choose "
            f"another OUT."
        )


def probe_writable(out: Path, *, inside: bool = False) -> None:
    """Fail now, with the OS's reason, if the directory the writes go to cannot be
    written (read-only filesystem, permissions), rather than after the work or with a
    misleading message. ``inside``: the writes go into OUT itself (shard), else next to
    it (the ``.OUT.partial`` directory, a logits temp file)."""
    d = existing_parent(out if inside and out.is_dir() else out.parent)
    try:  # an unnamed file (O_TMPFILE where the OS has it): a kill leaves nothing behind
        with tempfile.TemporaryFile(dir=d, prefix=".k3-probe-"):
            pass
    except OSError as e:
        raise write_error(e, out, "creating a file in " + str(d)) from e


def write_error(e: OSError, out: Path, what: str = "writing") -> OutputError:
    """One line for an OSError raised while writing ``out`` (disk full, read-only, ...)."""
    where = e.filename or out
    hint = {
        errno.ENOSPC: "the disk is full: free space or choose another OUT",
        errno.EDQUOT: "the disk quota is exhausted: free space or choose another OUT",
        errno.EROFS: "the filesystem is read-only: choose another OUT",
        errno.EACCES: "permission denied: choose a directory you can write to",
        errno.EPERM: "permission denied: choose a directory you can write to",
        errno.EFBIG: "the file grew past the size this system allows",
    }.get(e.errno, "check the path and the disk")
    return OutputError(
        f"{out}: {what} failed: {where}: {e.strerror or e}; {hint}. Nothing was left "
        f"that looks complete."
    )


def reports_write_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate a keyword-only stage that writes ``out=``: an OSError escaping it (disk
    full mid-write, read-only filesystem) becomes one OutputError line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            raise write_error(e, Path(kwargs.get("out") or "OUT")) from e

    return wrapper


# -- partial directories -------------------------------------------------------------
def _proc_start(pid: int) -> str | None:
    """An identifier of process ``pid``'s start (Linux: /proc start time), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22: starttime


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start is not None and Path("/proc").is_dir():
        return _proc_start(pid) == start  # a reused pid is another process
    return True


def _marker() -> dict:
    return {
        "tool": "k3convert",
        "pid": os.getpid(),
        "start": _proc_start(os.getpid()),
        "host": socket.gethostname(),
    }


def _read_marker(d: Path) -> dict | None:
    """The owner marker of partial directory ``d`` (a regular file, bounded, strict: it
    never blocks), or None when there is none that reads as one."""
    from .bounded import read_json

    try:
        return read_json(d / PARTIAL_MARKER, "report", OutputError)
    except OutputError:
        return None


def _owned_stale(d: Path, out: Path) -> bool:
    """True if ``d`` is a partial output of ``out`` by a k3convert run that is dead."""
    m = _read_marker(d)
    if m is None or m.get("tool") != "k3convert" or m.get("out") != str(out):
        return False
    if m.get("host") != socket.gethostname() or not isinstance(m.get("pid"), int):
        return False  # another machine's run on a shared filesystem: cannot tell
    if _alive(m["pid"], m.get("start")):
        raise OutputError(
            f"{out}: another k3convert run (pid {m['pid']}) is writing it right now "
            f"({d.name}); wait for it to finish, or choose another OUT."
        )
    return True


def _remove_stale(out: Path) -> None:
    parent = out.parent
    if not parent.is_dir():
        return
    for d in parent.glob(f".{glob_escape(out.name)}.partial-*"):
        if d.is_dir() and not d.is_symlink() and _owned_stale(d, out.resolve()):
            shutil.rmtree(d, ignore_errors=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def refuse_partial(path: str | os.PathLike) -> None:
    """CheckpointError if ``path`` is (inside) an unfinished k3convert output."""
    p = Path(path)
    d = p if p.is_dir() else p.parent
    if (d / PARTIAL_MARKER).exists() or _PARTIAL_RX.match(d.resolve().name):
        raise CheckpointError(
            f"{p}: is the unfinished output of an interrupted k3convert run (a "
            f"'.OUT.partial-PID' or '.OUT.vllm-partial' directory), not a checkpoint; "
            f"rerun the command that wrote it (it resumes or removes it) and use its OUT."
        )
    if is_unfinished_stream(d):
        raise CheckpointError(
            f"{p}: is a k3convert stream directory without its manifest.json (the commit "
            f"marker, written last): an interrupted or damaged `shard` / `convert` output, "
            f"not a checkpoint. Rerun the same shard / convert command to resume it, or copy "
            f"the stream again if its manifest.json was lost."
        )


def is_unfinished_stream(d: Path) -> bool:
    """``d`` holds stream parts (the unit journal or ``rankNNNNN`` folders) but no
    ``manifest.json``, the commit marker written last."""
    if not d.is_dir() or (d / "manifest.json").is_file():
        return False
    return (d / STREAM_JOURNAL).is_dir() or any(
        q.is_dir() and _RANK_DIR_RX.fullmatch(q.name) for q in d.glob("rank*")
    )


def check_output(
    out: str | os.PathLike,
    *,
    force: bool,
    need_bytes: int,
    source: str | os.PathLike | None = None,
) -> Path:
    """The checks :func:`staged_output` runs before it creates anything (a stage with
    long work before its first write, such as calibration, runs them first too)."""
    out = guard_out(out, [source])
    if out.exists() and not force:
        raise OutputError(f"{out} already exists; choose another OUT or pass --force.")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory; remove it or choose another OUT.")
    check_replaceable(out, (out / "config.json").is_file(), "model directory (no config.json)")
    probe_writable(out)
    free = free_bytes(out.parent)
    need = int(need_bytes * 1.02) + (16 << 20)
    if need > free:
        raise OutputError(
            f"{out}: needs about {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is "
            f"free on {existing_parent(out.parent)}; free disk, choose another OUT, or write "
            f"less (e.g. synth --tiny / fewer --layers)."
        )
    return out


@contextmanager
def staged_output(
    out: str | os.PathLike,
    *,
    force: bool,
    need_bytes: int,
    source: str | os.PathLike | None = None,
) -> Iterator[Path]:
    """Yield a fresh temp directory next to ``out``; rename it to ``out`` on success.

    Refuses up front: an OUT that :func:`guard_out` refuses, an existing ``out`` without
    ``force``, and less free disk than ``need_bytes`` (plus a small margin). On any error
    the temp directory is removed and ``out`` is left as it was; OSErrors become one
    OutputError line.
    """
    out = check_output(out, force=force, need_bytes=need_bytes, source=source)
    _remove_stale(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        (tmp / PARTIAL_MARKER).write_text(json.dumps({**_marker(), "out": str(out.resolve())}))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(e, out, "creating the output directory") from e
    try:
        yield tmp
        (tmp / PARTIAL_MARKER).unlink()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(e, out) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- resumable stages ----------------------------------------------------------------
class OwnedStage:
    """A resumable stage directory ``.OUT.<kind>`` next to OUT, held by one run.

    Kept after an interruption so that a rerun resumes it; renamed to OUT when complete.
    What makes it safe to write into, delete from and rename (the stream's
    :func:`staged_output` rules, for a stage that outlives its process):

    * the stage path is checked with ``lstat`` and :func:`guard_out` first: a symbolic
      link (to a source or anywhere), a file, a source directory that happens to carry
      the stage's name, or a directory that lies inside / above a source is refused;
    * an existing directory is taken over only if its owner marker says it is this
      kind of stage of this OUT, written by k3convert on this host, by a process that
      is dead; anything else is refused, never emptied;
    * the run holds an exclusive ``flock`` on the directory itself for as long as it
      writes: a second writer of the same OUT is refused at once (exit 2), and the lock
      moves with the directory when it is renamed to OUT;
    * once locked, every file operation goes through :attr:`work`, a path to the locked
      directory itself (``/proc/self/fd/N``): a name swapped for a link after the checks
      (to the source, say) is never written into, emptied or removed;
    * cleanup removes only names the writer declares its own (``owns(name)``), and a
      name that is not a regular file / directory of its own is refused, not removed;
    * :meth:`commit` checks OUT first, then refuses any entry the writer did not
      account for, removes the marker, fsyncs and renames (the marker is put back if
      the rename fails, so a rerun resumes the finished stage).
    """

    def __init__(self, out: Path, kind: str, sources: Iterable[str | os.PathLike | None]):
        self.out = Path(out)
        self.kind = kind
        self.path = self.out.parent / f".{self.out.name}.{kind}"
        self._sources = list(sources)
        self._fd: int | None = None

    @property
    def work(self) -> Path:
        """The locked directory, as a path that cannot be redirected by a rename or a
        link at :attr:`path` (Linux: the open descriptor in /proc; else the path)."""
        if self._fd is not None and os.path.isdir(f"/proc/self/fd/{self._fd}"):
            return Path(f"/proc/self/fd/{self._fd}")
        return self.path

    # -- taking the stage ----------------------------------------------------------
    def open(self) -> OwnedStage:
        try:
            return self._open()
        except BaseException as e:
            self.close()
            if isinstance(e, OSError):
                raise write_error(e, self.out, "taking the stage directory") from e
            raise

    def _open(self) -> OwnedStage:
        p = self.path
        guard_out(p, self._sources)  # a link; the source itself; inside / above one
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise OutputError(
                f"{p}: exists and is not a directory k3convert made (a file or a link); "
                f"k3convert writes OUT's stage there and never replaces what it did not "
                f"make: remove it yourself, or choose another OUT."
            )
        if st is not None:
            self._check_marker(p)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # (another run, this instant:
                p.mkdir()  # the lock below decides)
        self._lock()
        self._check_marker(self.work)
        atomic_write(self.work / PARTIAL_MARKER, json.dumps(
            {**_marker(), "out": str(self.out.resolve()), "kind": self.kind}))  # fmt: skip
        return self

    def identity(self) -> dict:
        """The owner marker process 0 wrote into the locked directory (its pid, host and
        start time): what a torchrun peer :meth:`join` s. A marker, not the inode: on a
        network file system every node sees its own device number."""
        return _read_marker(self.work) or {}

    def join(self, identity: dict) -> OwnedStage:
        """A torchrun peer's view of the stage that process 0 took (``identity``: its
        :meth:`identity`): the directory at the stage's path, opened without following a
        link, holding that very marker; never locked (process 0 holds the lock), cleaned
        or committed by the peer."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            raise OutputError(f"{self.path}: cannot be opened ({e.strerror}); rerun.") from None
        self._fd = fd
        if not identity or _read_marker(self.work) != identity:
            self.close()
            raise OutputError(
                f"{self.path}: is not the directory torchrun process 0 took (replaced, or "
                f"OUT's parent is not one file system that every node sees); rerun."
            )
        return self

    def _lock(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            raise OutputError(
                f"{self.path}: cannot be opened as a directory ({e.strerror}): it was "
                f"replaced, or is a link, while k3convert took it; rerun."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            who = _read_marker(self.path) or {}
            raise OutputError(
                f"{self.out}: another k3convert run (pid {who.get('pid', '?')}) is writing "
                f"it right now ({self.path.name}); wait for it to finish, or choose another "
                f"OUT."
            ) from None
        except OSError as e:
            os.close(fd)
            raise OutputError(
                f"{self.path}: cannot be locked ({e.strerror}); the filesystem has no "
                f"working locks, so two runs could write OUT at once: write OUT on a local "
                f"filesystem."
            ) from None
        self._fd = fd
        self._same_directory()

    def _same_directory(self) -> None:
        """The name still leads to the locked directory (not swapped under us)."""
        try:
            now = os.lstat(self.path)
        except OSError:
            now = None
        st = os.fstat(self._fd)
        if now is None or (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            raise OutputError(
                f"{self.path}: was replaced while k3convert held it; nothing was removed "
                f"through the new name. Check what else writes there, and rerun."
            )

    def _check_marker(self, d: Path) -> None:
        """The directory ``d`` (the stage) is this kind of stage of this OUT, by a dead
        run of this host (or an empty directory: nothing in it to lose)."""
        doc = _read_marker(d)
        if doc is None:
            with os.scandir(d) as it:
                if not any(it):
                    return
        mine = (
            doc is not None
            and doc.get("tool") == "k3convert"
            and doc.get("out") == str(self.out.resolve())
            and doc.get("kind") == self.kind
        )
        if not mine:
            raise OutputError(
                f"{self.path}: exists but is not an interrupted k3convert write of "
                f"{self.out} (no matching owner marker); k3convert empties only stages it "
                f"made: remove it yourself, or choose another OUT."
            )
        if doc.get("host") != socket.gethostname():
            raise OutputError(
                f"{self.path}: is being (or was) written by a k3convert run on host "
                f"{doc.get('host')}; resume it there, or remove it yourself."
            )
        pid = doc.get("pid")
        # (checked before the lock: under it, a live pid can only be a reused one)
        live = isinstance(pid, int) and pid != os.getpid() and _alive(pid, doc.get("start"))
        if live and self._fd is None:
            raise OutputError(
                f"{self.out}: another k3convert run (pid {pid}) is writing it right now "
                f"({self.path.name}); wait for it to finish, or choose another OUT."
            )

    # -- its contents ----------------------------------------------------------------
    def clean(self, owns: Callable[[str], bool], keep: Callable[[str], bool]) -> None:
        """Remove the entries this writer owns (``owns``) that it will not reuse
        (``keep`` False); refuse any entry it does not own."""
        work = self.work
        with os.scandir(work) as it:
            entries = list(it)
        for e in entries:
            if e.name == PARTIAL_MARKER:
                continue
            if not owns(e.name) or e.is_symlink():
                raise OutputError(
                    f"{self.path / e.name}: is not something k3convert writes into this "
                    f"stage; it would end up in OUT. Remove it yourself (or the whole "
                    f"{self.path.name}), then rerun."
                )
            if keep(e.name):
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(work / e.name)
            else:
                os.unlink(work / e.name)

    def check_out(self, force: bool) -> None:
        """OUT may be replaced by the commit: absent, or (``force``) a previous output.
        A writer calls it before it drops its resume journal, and :meth:`commit` again."""
        if os.path.lexists(self.out):
            if not force:
                raise OutputError(
                    f"{self.out} appeared while this run wrote it; choose another OUT or "
                    f"pass --force (the finished stage {self.path.name} is kept: rerun to "
                    f"use it)."
                )
            check_replaceable(self.out, _looks_like(self.out), "k3convert output")
            guard_out(self.out, self._sources)

    def commit(self, expected: set[str], force: bool) -> None:
        """Rename the stage to OUT: it must hold exactly ``expected`` (and the marker)."""
        self.check_out(force)
        work = self.work
        with os.scandir(work) as it:
            names = {e.name for e in it} - {PARTIAL_MARKER}
        if names != expected:
            extra, missing = sorted(names - expected), sorted(expected - names)
            raise OutputError(
                f"{self.path}: holds {extra or 'nothing extra'} and lacks "
                f"{missing or 'nothing'} at commit; something else wrote into it. Remove "
                f"it and rerun."
            )
        marker = (work / PARTIAL_MARKER).read_text()
        (work / PARTIAL_MARKER).unlink()
        fsync_dir(work)
        try:
            if os.path.lexists(self.out):  # --force, checked above
                shutil.rmtree(self.out)
            self._same_directory()  # (the name is renamed, the lock goes with it)
            self.path.rename(self.out)
        except BaseException:
            with contextlib.suppress(OSError):  # still the stage: a rerun resumes it
                atomic_write(work / PARTIAL_MARKER, marker)
            raise
        fsync_dir(self.out.parent)

    def remove(self, owns: Callable[[str], bool]) -> None:
        """Drop what this writer made in the stage (a refusal mid-write that a rerun
        cannot resume), and the stage itself once empty; anything else stays."""
        if self._fd is None:
            return
        work = self.work
        with os.scandir(work) as it:
            entries = list(it)
        for e in entries:
            if e.name != PARTIAL_MARKER and (not owns(e.name) or e.is_symlink()):
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(work / e.name, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(work / e.name)
        with contextlib.suppress(OSError, OutputError):  # (not if the name was swapped)
            self._same_directory()
            self.path.rmdir()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OwnedStage:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def _looks_like(out: Path) -> bool:
    """A previous output of an engine target (its index is there)."""
    return out.is_dir() and any(p.name.startswith("k3convert-") for p in out.iterdir())


# -- durable small writes (the stream's manifest and journal use them too) ---------------
def atomic_write(path: Path, text: str, fsync: bool = True) -> None:
    """``text`` to a temporary name next to ``path``, [fsynced], renamed over it."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)  # one write: json.dump would issue one per token
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """fsync a directory (its names durable); a filesystem that cannot is let be."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

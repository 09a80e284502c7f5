"""Writing a Hugging Face model directory safely: checks first, temp dir, rename last.

Every stage that writes a checkpoint (synth, quantize) goes through here, so they share
one behaviour: an existing OUT is refused unless forced, the disk-space estimate is
checked before a byte is written, files are written into ``.OUT.partial-PID`` and the
directory is renamed into place only when complete (a crash never leaves something
that looks finished), and shards are named and indexed the way transformers expects.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from ..errors import OutputError

T = TypeVar("T")
INDEX = "model.safetensors.index.json"


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


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


@contextmanager
def staged_output(
    out: str | os.PathLike,
    *,
    force: bool,
    need_bytes: int,
    source: str | os.PathLike | None = None,
) -> Iterator[Path]:
    """Yield a fresh temp directory next to ``out``; rename it to ``out`` on success.

    Refuses up front: an existing ``out`` without ``force``, ``out`` equal to ``source``,
    and less free disk than ``need_bytes`` (plus a small margin). On any error the temp
    directory is removed and ``out`` is left as it was.
    """
    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"{out} already exists; choose another OUT or pass --force.")
    if source is not None and out.resolve() == Path(source).resolve():
        raise OutputError(f"{out} is the source checkpoint; choose another OUT.")
    free = free_bytes(out.parent)
    need = int(need_bytes * 1.02) + (16 << 20)
    if need > free:
        raise OutputError(
            f"{out}: needs about {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is "
            f"free on {free_dir(out)}; free disk, choose another OUT, or write less (e.g. "
            f"synth --tiny / fewer --layers)."
        )
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def free_dir(out: Path) -> Path:
    p = out.parent.resolve()
    while not p.exists():
        p = p.parent
    return p

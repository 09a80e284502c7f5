"""The processes of one conversion job under ``torchrun`` (``torch.distributed``, gloo).

Conversion stages (``shard``, ``quantize``, ``convert``) split their work over the
processes of a torchrun job, one node or many: each process writes its own share of the
output, and process 0 alone prepares the output directory and commits it (the manifest,
the index, the rename) once every process has reported. Only small Python objects travel
(results, hashes, paths): the weights are read and written by each process itself, so OUT
must be one shared directory on every node (NFS, Lustre, a cloud file system).

Work is balanced by bytes with the longest-processing-time rule: items, largest first,
each to the process with the least bytes so far (ties: the lowest process number). The
assignment depends only on the items and the number of processes, so a rerun with the
same world finds its finished units where it left them; with another world the journal
entries still tell every process which units are done.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import K3Error
from .collectives import init_distributed, under_torchrun

T = TypeVar("T")


@dataclass
class ProcessGroup:
    """This process's place in the job: ``rank`` of ``world`` (world 1: alone)."""

    rank: int = 0
    world: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` (picklable), in rank order, on every process."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def share(self, obj: Any) -> Any:
        """Process 0's ``obj`` on every process."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every process when any process failed at this point (its own error on
        itself, a one-line note naming the failed process on the others)."""
        mine = None if error is None else (_brief(error), getattr(error, "exit_code", 1))
        flags = self.gather(mine)
        if error is not None:
            raise error
        bad = [(i, m) for i, m in enumerate(flags) if m is not None]
        if bad:
            i, (msg, code) = bad[0]
            err = K3Error(f"torchrun process {i} failed while {what}: {msg}")
            err.exit_code = code  # the failed process's own exit status
            raise err


def _brief(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def current() -> ProcessGroup:
    """The job this process belongs to: torchrun's (the default process group, gloo on
    CPU, initialised here if needed) or a group of one."""
    if not under_torchrun():
        return ProcessGroup()
    import torch
    import torch.distributed as dist

    device = os.environ.get("K3_DIST_DEVICE", "cpu")
    init_distributed(torch.device(device))
    return ProcessGroup(dist.get_rank(), dist.get_world_size())


def cores_per_process() -> int:
    """The cores this process may run on, divided among the torchrun processes of its
    node (``LOCAL_WORLD_SIZE``): the default number of worker threads of a stage."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if under_torchrun() else 1
    except ValueError:
        local = 1
    return max(1, n // max(1, local))


def balance(items: Sequence[T], size: Callable[[T], int], world: int) -> list[list[T]]:
    """``items`` split over ``world`` processes by bytes (largest first onto the least
    loaded; each share keeps the items' original order)."""
    order = sorted(range(len(items)), key=lambda i: (-size(items[i]), i))
    heap = [(0, p) for p in range(world)]
    share: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        load, p = heapq.heappop(heap)
        share[p].append(i)
        heapq.heappush(heap, (load + size(items[i]), p))
    return [[items[i] for i in sorted(s)] for s in share]

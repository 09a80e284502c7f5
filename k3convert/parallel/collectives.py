"""Collectives: how the ranks of a layout combine partial results.

One interface, two implementations:

- :class:`SimulatedCollectives` (default): every rank of the layout runs in this
  process, one rank at a time, so a call receives the contributions of *all* ranks of
  the group;
- :class:`TorchDistributedCollectives`: one process per rank under ``torchrun``
  (``torch.distributed``: gloo on CPU, the device's backend otherwise); a call receives
  this process's own contribution and exchanges the rest.

A call takes ``parts``: the contributions of the ranks this process executes (a dict
rank -> tensor), and returns the group's result. Reductions are deterministic: the
group's contributions are gathered and summed in rank order by :func:`ordered_sum`, the
same function in both implementations, so a simulated run and a torchrun run give
bit-identical results.
"""

from __future__ import annotations

import atexit
import os
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import Sequence

import torch

from ..errors import ConfigError


def ordered_sum(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """t0 + t1 + ... in that order (never a tree or a fused reduction)."""
    acc = ts[0].clone()
    for t in ts[1:]:
        acc += t
    return acc


class Collectives(ABC):
    """all_reduce / all_gather over a group of global ranks, point-to-point hand-offs
    between pipeline stages, broadcast and barrier."""

    world: int

    @abstractmethod
    def runs(self, rank: int) -> bool:
        """Whether this process executes ``rank``."""

    def local(self, ranks: Sequence[int]) -> list[int]:
        return [r for r in ranks if self.runs(r)]

    @abstractmethod
    def all_gather(
        self, parts: dict[int, torch.Tensor], group: Sequence[int]
    ) -> list[torch.Tensor]:
        """Every rank's tensor of ``group``, in group order."""

    def all_reduce(self, parts: dict[int, torch.Tensor], group: Sequence[int]) -> torch.Tensor:
        """The group's sum, in rank order."""
        return ordered_sum(self.all_gather(parts, group))

    @abstractmethod
    def send(self, t: torch.Tensor, src: int, dst: int) -> None: ...

    @abstractmethod
    def recv(self, src: int, dst: int, shape, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def broadcast(
        self, t: torch.Tensor | None, src: int, shape, dtype: torch.dtype
    ) -> torch.Tensor:
        """``t`` from rank ``src`` on every process."""

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def flags(self, flag: bool) -> list[bool]:
        """Every process's ``flag`` (one per process): how all processes agree on an
        error that only some of them saw, so all stop the same way."""

    def describe(self) -> str:
        return type(self).__name__


class SimulatedCollectives(Collectives):
    """Every rank in this process: a call sees every contribution of the group."""

    def __init__(self, world: int):
        self.world = world
        self._mail: dict[tuple[int, int], deque] = defaultdict(deque)

    def runs(self, rank: int) -> bool:
        return 0 <= rank < self.world

    def all_gather(self, parts, group):
        missing = [r for r in group if r not in parts]
        if missing:
            raise RuntimeError(f"simulated collective is missing the parts of ranks {missing}")
        return [parts[r] for r in group]

    def send(self, t, src, dst):
        self._mail[(src, dst)].append(t)

    def recv(self, src, dst, shape, dtype):
        return self._mail[(src, dst)].popleft()

    def broadcast(self, t, src, shape, dtype):
        return t

    def barrier(self):
        pass

    def flags(self, flag):
        return [bool(flag)]

    def describe(self) -> str:
        return f"simulated in one process ({self.world} ranks, one at a time)"


#: gloo reduces / moves float32 on every version; lower precisions travel widened (exact)
_WIRE = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


class TorchDistributedCollectives(Collectives):
    """One rank per process (``torchrun``). Process groups are made for the given groups
    up front (every process must create every group, in the same order)."""

    def __init__(self, world: int, groups: Sequence[Sequence[int]], device: torch.device):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised (run under torchrun).")
        if dist.get_world_size() != world:
            raise ConfigError(
                f"torchrun started {dist.get_world_size()} processes but the layout has "
                f"{world} ranks; run with --nproc-per-node {world} (times --nnodes)."
            )
        self.dist = dist
        self.world = world
        self.rank = dist.get_rank()
        self.device = device
        self._groups = {}
        for g in groups:
            key = tuple(g)
            if key not in self._groups:
                self._groups[key] = dist.new_group(list(key)) if len(key) < world else None

    def runs(self, rank: int) -> bool:
        return rank == self.rank

    def _pg(self, group):
        return self._groups.get(tuple(group))

    def all_gather(self, parts, group):
        group = tuple(group)
        if self.rank not in group:
            raise RuntimeError(f"rank {self.rank} is not in group {group}")
        if len(group) == 1:
            return [parts[self.rank]]
        t = parts[self.rank].contiguous()
        wire = _WIRE.get(t.dtype, t.dtype)
        send = t.to(wire)
        out = [torch.empty_like(send) for _ in group]
        self.dist.all_gather(out, send, group=self._pg(group))
        return [o.to(t.dtype) for o in out]

    def send(self, t, src, dst):
        self.dist.send(t.contiguous().to(_WIRE.get(t.dtype, t.dtype)), dst)

    def recv(self, src, dst, shape, dtype):
        buf = torch.empty(tuple(shape), dtype=_WIRE.get(dtype, dtype), device=self.device)
        self.dist.recv(buf, src)
        return buf.to(dtype)

    def broadcast(self, t, src, shape, dtype):
        wire = _WIRE.get(dtype, dtype)
        if self.rank == src:
            buf = t.contiguous().to(wire)
        else:
            buf = torch.empty(tuple(shape), dtype=wire, device=self.device)
        self.dist.broadcast(buf, src)
        return buf.to(dtype)

    def barrier(self):
        self.dist.barrier()

    def flags(self, flag):
        return process_flags(flag, self.device)

    def describe(self) -> str:
        return f"torch.distributed ({self.dist.get_backend()}, {self.world} processes)"


def process_flags(flag: bool, device: torch.device | None = None) -> list[bool]:
    """Every process's ``flag`` over the default process group (one element each)."""
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [bool(o.item()) for o in out]


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher that sets the
    torch.distributed environment) with more than one process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


#: collectives wait this long for a peer (gloo's default, 30 min, is shorter than rank 0's
#: reference forward of a large model); K3_DIST_TIMEOUT_S overrides
DIST_TIMEOUT_S = 6 * 3600


def init_distributed(device: torch.device) -> None:
    """Initialise the default process group from torchrun's environment (idempotent)."""
    from datetime import timedelta

    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "gloo" if device.type == "cpu" else None  # None: the device's default
    timeout = float(os.environ.get("K3_DIST_TIMEOUT_S", DIST_TIMEOUT_S))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout))
    # a process that reaches interpreter teardown with gloo's threads still up is aborted
    # ("terminate called without an active exception", SIGABRT after all work succeeded):
    # leave the group first, whoever initialised it and however the process ends
    atexit.register(_leave_distributed)


def _leave_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()

"""Distributed primitives: the collectives a parallel runtime uses (simulated in one process
or ``torch.distributed``) and the torchrun job the conversion stages split their work over
(:mod:`.procs`). What each rank of a layout holds and the parallel runtime itself are in
:mod:`k3convert.runtime.ranks` and :mod:`k3convert.runtime.parallel`.
"""

from .collectives import (
    Collectives,
    SimulatedCollectives,
    TorchDistributedCollectives,
    init_distributed,
    ordered_sum,
    under_torchrun,
)

__all__ = [
    "Collectives",
    "SimulatedCollectives",
    "TorchDistributedCollectives",
    "init_distributed",
    "ordered_sum",
    "under_torchrun",
]

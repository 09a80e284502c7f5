"""Parallel execution: what each rank of a layout holds and how ranks combine.

``Layout`` and the split rules are the shard planner's (``k3convert.shard.layout`` /
``k3convert.shard.split``): one copy, used by ``shard`` to write and by the parallel
runtime to slice an unsharded checkpoint on the fly.
"""

from ..shard.layout import Layout
from .collectives import (
    Collectives,
    SimulatedCollectives,
    TorchDistributedCollectives,
    init_distributed,
    ordered_sum,
    under_torchrun,
)
from .ranks import RankSet, planned_ranks, stream_ranks
from .runtime import ParallelRuntime

__all__ = [
    "Collectives",
    "Layout",
    "ParallelRuntime",
    "RankSet",
    "SimulatedCollectives",
    "TorchDistributedCollectives",
    "init_distributed",
    "ordered_sum",
    "planned_ranks",
    "stream_ranks",
    "under_torchrun",
]

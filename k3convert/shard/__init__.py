"""Resharding for tensor / pipeline / expert parallelism into the MUSA stream format.

``shard(src=..., out=..., tp=, pp=, ep=)`` plans (layout, split rules, expert placement;
all validated before writing) and writes one directory per rank of layer-ordered units;
``check(out)`` verifies a written directory. ``Layout`` is the rank arithmetic.
"""

from ..layout import Layout, partition_layers, place_experts
from ..stream.check import CheckReport, check
from ..stream.format import ShardError, SplitError
from .plan import Plan, build_plan
from .split import legal_degrees, split_tensor
from .writer import ShardResult, shard

__all__ = [
    "CheckReport",
    "Layout",
    "Plan",
    "ShardError",
    "ShardResult",
    "SplitError",
    "build_plan",
    "check",
    "legal_degrees",
    "partition_layers",
    "place_experts",
    "shard",
    "split_tensor",
]

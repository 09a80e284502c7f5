"""Where every unit and every routed expert lives: the parallel layout.

``Layout(tp, pp, moe_tp, moe_ep)``: ``world = tp * pp`` ranks numbered
``rank = pp_rank * tp + tp_rank``. Inside a pipeline stage the ``tp`` ranks form the
tensor-parallel group for dense weights; for routed experts the same ``tp`` ranks are
viewed as ``moe_ep`` expert-parallel groups of ``moe_tp`` ranks each
(``tp_rank = ep_rank * moe_tp + moe_tp_rank``), so ``moe_tp * moe_ep == tp``.

Pipeline stages take contiguous layer ranges. The default partition minimises the
largest stage's bytes, counting the embedding and vision tower on the first stage and
the final norm / lm_head (and MTP layers) on the last. Experts go to EP ranks in
contiguous blocks, or, given routing counts from calibration, by greedy bin packing on
token load (largest first onto the least-loaded rank with a free slot), optionally with
redundant replicas of the hottest experts as DeepSeek's EPLB does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ConfigError

#: the largest parallel degree a layout may ask for (world = tp * pp is bounded by its
#: square): values past it are typos, and planning them would take hours
MAX_DEGREE = 1 << 16


@dataclass(frozen=True)
class Layout:
    """Parallel degrees. ``moe_tp * moe_ep == tp``; world = tp * pp."""

    tp: int = 1
    pp: int = 1
    moe_tp: int | None = None
    moe_ep: int = 1

    def __post_init__(self):
        for k in ("tp", "pp", "moe_ep"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"layout: {k} must be a positive integer, got {v!r}.")
            if v > MAX_DEGREE:
                raise ConfigError(
                    f"layout: {k}={v} is beyond any cluster (at most {MAX_DEGREE}); check "
                    f"the value."
                )
        if self.moe_tp is None:
            if self.tp % self.moe_ep:
                raise ConfigError(
                    f"layout: ep={self.moe_ep} must divide tp={self.tp} (experts are spread "
                    f"over the tensor-parallel ranks); legal ep: {divisors(self.tp)}."
                )
            object.__setattr__(self, "moe_tp", self.tp // self.moe_ep)
        if self.moe_tp * self.moe_ep != self.tp:
            raise ConfigError(
                f"layout: moe_tp * moe_ep must equal tp, got {self.moe_tp} * {self.moe_ep} "
                f"!= {self.tp}."
            )

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    def coords(self, rank: int) -> dict[str, int]:
        """pp_rank, tp_rank, ep_rank, moe_tp_rank of a global rank."""
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is outside the world of {self.world} ranks.")
        pp_rank, tp_rank = divmod(rank, self.tp)
        ep_rank, moe_tp_rank = divmod(tp_rank, self.moe_tp)
        return dict(pp_rank=pp_rank, tp_rank=tp_rank, ep_rank=ep_rank, moe_tp_rank=moe_tp_rank)

    def to_json(self) -> dict:
        return dict(tp=self.tp, pp=self.pp, moe_tp=self.moe_tp, moe_ep=self.moe_ep)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- pipeline partition ----------------------------------------------------------------
def partition_layers(
    layer_bytes: Sequence[int],
    pp: int,
    *,
    first_fixed: int = 0,
    last_fixed: int = 0,
    explicit: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, one per stage.

    ``explicit``: layer counts per stage (must sum to the number of layers). Otherwise
    the partition minimising the heaviest stage (``first_fixed`` bytes are added to stage
    0, ``last_fixed`` to the last stage); ties prefer earlier boundaries. A stage may get
    no layers only when there are fewer layers than stages.
    """
    n = len(layer_bytes)
    if explicit is not None:
        counts = [int(c) for c in explicit]
        if len(counts) != pp or any(c < 0 for c in counts) or sum(counts) != n:
            raise ConfigError(
                f"pp_layers={list(explicit)}: need {pp} non-negative layer counts (one per "
                f"pipeline stage) summing to the model's {n} decoder layers."
            )
        out, pos = [], 0
        for c in counts:
            out.append((pos, pos + c))
            pos += c
        return out
    if pp == 1:
        return [(0, n)]
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + int(b))
    min_layers = 1 if n >= pp else 0
    inf = float("inf")
    # best[s][i]: minimal max-stage cost placing the first i layers on stages 0..s
    best = [[inf] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp)]
    for i in range(n + 1):
        if i >= min_layers:
            best[0][i] = first_fixed + prefix[i] + (last_fixed if pp == 1 else 0)
    for s in range(1, pp):
        extra = last_fixed if s == pp - 1 else 0
        for i in range(n + 1):
            for j in range(i - min_layers, -1, -1):
                if best[s - 1][j] == inf:
                    continue
                c = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if c < best[s][i]:
                    best[s][i], cut[s][i] = c, j
    bounds, i = [], n
    for s in range(pp - 1, 0, -1):
        j = cut[s][i]
        bounds.append((j, i))
        i = j
    bounds.append((0, i))
    return bounds[::-1]


# -- expert placement ------------------------------------------------------------------
def place_experts(
    num_experts: int,
    ep: int,
    *,
    load: Sequence[float] | None = None,
    redundant: int = 0,
    where: str = "",
) -> list[list[int]]:
    """Experts held by each EP rank (``slots = (num_experts + redundant) / ep`` each).

    Without ``load``: contiguous blocks (rank r holds ``[r*k, (r+1)*k)``), and
    ``redundant`` must be 0. With ``load`` (tokens routed to each expert): the hottest
    experts get extra replicas one at a time (always the expert with the highest load
    per replica), then replicas are packed largest-first onto the least-loaded rank that
    has a free slot and does not already hold that expert.
    """
    loc = f" ({where})" if where else ""
    slots_total = num_experts + redundant
    if redundant < 0:
        raise ConfigError(f"redundant_experts must be >= 0, got {redundant}.")
    if slots_total % ep:
        legal = divisors(slots_total)
        raise ConfigError(
            f"{num_experts} routed experts + {redundant} redundant copies = {slots_total} "
            f"slots cannot be spread evenly over ep={ep} ranks{loc}; legal ep for this count: "
            f"{legal}, or change redundant_experts so that ep divides experts + copies."
        )
    per = slots_total // ep
    if load is None:
        if redundant:
            raise ConfigError(
                "redundant_experts needs routing counts (expert_load from calibration) to "
                "know which experts are hot."
            )
        return [list(range(r * per, (r + 1) * per)) for r in range(ep)]
    if len(load) != num_experts:
        raise ConfigError(
            f"expert_load{loc} has {len(load)} counts but the layer has {num_experts} experts."
        )
    if redundant > num_experts * (ep - 1):
        top = num_experts * (ep - 1)
        raise ConfigError(
            f"redundant_experts={redundant} is more than {ep} ranks can hold{loc}: a rank holds "
            f"an expert at most once, so at most {top} copies ({num_experts} experts x "
            f"{ep - 1} other rank(s)); lower it (--redundant-experts {top}, or in a recipe "
            f"--set layout.redundant_experts={top}) or raise ep."
        )
    loads = [float(x) for x in load]
    for e, x in enumerate(loads):
        if not math.isfinite(x) or x < 0:
            raise ConfigError(
                f"expert_load{loc}, expert {e}: count {x!r} is not a finite non-negative number."
            )
    replicas = [1] * num_experts
    heap = [(-loads[e], e) for e in range(num_experts)]
    heapq.heapify(heap)
    added = 0
    while added < redundant:
        _, e = heapq.heappop(heap)
        if replicas[e] < ep:
            replicas[e] += 1
            added += 1
        heapq.heappush(heap, (-(loads[e] / replicas[e]) if replicas[e] < ep else 1.0, e))
    items = sorted(
        ((loads[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
        key=lambda t: (-t[0], t[1]),
    )
    bins: list[list[int]] = [[] for _ in range(ep)]
    totals = [0.0] * ep
    for w, e in items:
        choices = [r for r in range(ep) if len(bins[r]) < per and e not in bins[r]]
        if not choices:
            raise ConfigError(
                f"cannot place {replicas[e]} copies of expert {e} on distinct EP ranks{loc}; "
                f"lower redundant_experts."
            )
        r = min(choices, key=lambda r: (totals[r], r))
        bins[r].append(e)
        totals[r] += w
    return [sorted(b) for b in bins]

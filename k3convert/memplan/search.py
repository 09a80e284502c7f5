"""The smallest layouts that fit a device: the search over tp, pp and ep."""

from __future__ import annotations

from ..errors import ConfigError, K3Error
from ..layout import Layout, divisors
from ..shard.plan import unit_sort_key
from ..units import human_bytes
from .render import LayoutFit, RankMemory
from .tensors import Tensors
from .weights import WeightModel
from .workload import LayerModel, Workload


class Planner:
    """Weights, caches and activations of every rank of any layout of one model."""

    def __init__(self, t: Tensors, workload: Workload, *, load=None, redundant: int = 0):
        self.t, self.w = t, workload
        self.weights = WeightModel(t)
        self.layers = LayerModel(t.cfg)
        self.load, self.redundant = load, redundant
        if redundant < 0:
            raise ConfigError(f"--redundant-experts must be 0 or more, got {redundant}.")
        self.num_experts = getattr(self.layers.text, "num_experts", 0) or 0

    def legal_ep(self, tp: int) -> list[int]:
        if not self.num_experts:
            return [1]
        slots = self.num_experts + self.redundant
        return [e for e in divisors(tp) if slots % e == 0]

    def check(self, layout: Layout) -> None:
        self.layers.check_tp(layout.tp)
        if self.num_experts and (self.num_experts + self.redundant) % layout.moe_ep:
            raise ConfigError(
                f"--ep {layout.moe_ep}: the {self.num_experts} routed experts + "
                f"{self.redundant} redundant copies do not spread evenly over {layout.moe_ep} "
                f"EP ranks; legal ep for tp={layout.tp}: {self.legal_ep(layout.tp)}."
            )
        if not self.num_experts and self.redundant:
            raise ConfigError("--redundant-experts was given but the model has no routed experts.")
        if layout.pp > self.layers.n:
            raise ConfigError(
                f"--pp {layout.pp} exceeds the model's {self.layers.n} decoder layers; use "
                f"pp <= {self.layers.n}."
            )

    def ranks(self, layout: Layout, pp_layers=None) -> tuple[list[RankMemory], list]:
        weights, ranges, _ = self.weights.per_rank(
            layout, pp_layers=pp_layers, load=self.load, redundant=self.redundant
        )
        L, w, tp, ep = self.layers, self.w, layout.tp, layout.moe_ep
        out = []
        for s, (a, b) in enumerate(ranges):
            kv = sum(L.kv_cache(i, tp, w) for i in range(a, b))
            kda = sum(L.kda_state(i, tp, w) for i in range(a, b))
            act = max((L.activations(i, tp, ep, w) for i in range(a, b)), default=0)
            if s == layout.pp - 1:
                act += L.logits(w)
            for t in range(tp):
                r = layout.rank(s, t)
                out.append(RankMemory(r, s, t, t // layout.moe_tp, weights[r], kv, kda, act))
        return out, ranges

    def lower_bound(self, tp: int, ep: int) -> int:
        """Memory some rank of every (tp, ep, any pp) layout needs at least: the heaviest
        single unit with its own layer's cache, state and activations."""
        lay = Layout(tp=tp, pp=1, moe_ep=ep)
        L, w, wm = self.layers, self.w, self.weights
        placed = wm.placement(lay, self.load, self.redundant)
        best = 0
        for u in wm.units:
            extra = 0
            kind, idx = unit_sort_key(u)
            if kind == 2:
                extra = L.kv_cache(idx, tp, w) + L.kda_state(idx, tp, w)
                extra += L.activations(idx, tp, ep, w)
            elif u == "head":
                extra = L.logits(w)
            best = max(best, max(wm.unit_vector(u, lay, placed)) + extra)
        return best

    def search(self, budget: int, top: int = 5) -> tuple[list[LayoutFit], str]:
        """The smallest layouts (devices = tp * pp) whose every rank fits ``budget``."""
        L = self.layers
        tps = L.legal_tp()
        pps = range(1, L.n + 1)
        cands = sorted((tp * pp, tp, pp) for tp in tps for pp in pps)
        fits: list[LayoutFit] = []
        pruned: set[tuple[int, int]] = set()
        bounds: dict[tuple[int, int], int] = {}
        skipped = 0
        for devices, tp, pp in cands:
            if len(fits) >= top and devices > fits[top - 1].devices:
                break
            for ep in self.legal_ep(tp):
                if (tp, ep) in pruned:
                    continue
                try:
                    if (tp, ep) not in bounds:
                        bounds[(tp, ep)] = self.lower_bound(tp, ep)
                    if bounds[(tp, ep)] > budget:
                        pruned.add((tp, ep))
                        continue
                    ranks, _ = self.ranks(Layout(tp=tp, pp=pp, moe_ep=ep))
                except K3Error:  # a split or placement this layout cannot do
                    pruned.add((tp, ep))
                    skipped += 1
                    continue
                peak = max(r.total for r in ranks)
                if peak <= budget:
                    fits.append(LayoutFit(tp, pp, ep, peak, budget))
            fits.sort(key=lambda f: (f.devices, f.peak))
        fits = fits[:top]
        note = ""
        if not fits:
            most = max(tps) * L.n
            note = (
                f"no layout fits {human_bytes(budget, 2)} per device: searched tp in {tps}, "
                f"pp up to {L.n}, ep dividing tp (up to {most} devices); every one has a rank over "
                f"budget - use a smaller --context / --batch, --kv-dtype fp8, a lower-bit "
                f"--scheme, or a larger device."
            )
        elif skipped:
            note = f"({skipped} tp/ep combination(s) skipped: the tensors cannot be split so)"
        return fits, note

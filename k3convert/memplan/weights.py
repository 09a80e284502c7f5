"""Weights per rank: exactly what ``shard`` writes to each rank, summed by tensor
signature so a layout costs milliseconds."""

from __future__ import annotations

from collections.abc import Sequence

from ..arch.base import Role
from ..checkpoint import TensorMeta
from ..errors import ConfigError, short_list
from ..layout import Layout, partition_layers, place_experts
from ..shard.plan import Splitter, build_plan, unit_sort_key, units_by_stage
from .tensors import Tensors, _nbytes


def _piece_bytes(piece) -> int:
    return sum(_nbytes(ps.src.dtype, ps.shape) for ps in piece.parts)


class WeightModel:
    """Per-rank weight bytes of any layout, computed as ``shard.plan.build_plan`` cuts
    the tensors (the same splitter, partition and placement), summed by signature."""

    def __init__(self, t: Tensors):
        self.t = t
        self.cfg = t.cfg
        roles, metas = t.roles, t.metas
        items = [(r.unit, r, m) for r, m in zip(roles, metas, strict=True)]
        has_head = any(r.kind == "lm_head" for r in roles)
        embed = [i for i, r in enumerate(roles) if r.kind == "embed_tokens" and not r.mtp]
        tied = getattr(self.cfg, "tie_word_embeddings", False) and not has_head and embed
        if tied and any(s.kind == "lm_head" for s in t.arch.specs(self.cfg)):
            i = embed[0]  # build_plan: a tied lm_head is a copy of the embedding, in "head"
            items.append(("head", roles[i], metas[i]))
        self.classes: list[tuple[TensorMeta, Role]] = []
        index: dict[tuple, int] = {}
        self.unit_bytes: dict[str, int] = {}
        self.dense: dict[str, dict[int, int]] = {}  # unit -> class -> count
        experts: dict[str, dict[int, list[int]]] = {}  # unit -> expert -> classes
        self.expert_layer: dict[str, int] = {}
        self.expert_role: dict[int, Role] = {}
        for unit, role, m in items:
            self.unit_bytes[unit] = self.unit_bytes.get(unit, 0) + m.nbytes
            key = (id(m), role.split, role.kind, role.expert is not None)
            c = index.get(key)
            if c is None:
                c = index[key] = len(self.classes)
                self.classes.append((m, role))
            if role.expert is None:
                d = self.dense.setdefault(unit, {})
                d[c] = d.get(c, 0) + 1
            else:
                experts.setdefault(unit, {}).setdefault(role.expert, []).append(c)
                self.expert_layer[unit] = role.layer
                self.expert_role.setdefault(role.layer, role)
        # the experts of a unit: one kind (its sorted tuple of classes) per expert
        self.expert_kinds: dict[str, tuple[list[tuple[int, ...]], dict[int, int]]] = {}
        for unit, by_e in experts.items():
            kinds: list[tuple[int, ...]] = []
            kidx: dict[tuple[int, ...], int] = {}
            of: dict[int, int] = {}
            for e, cs in by_e.items():
                k = tuple(sorted(cs))
                if k not in kidx:
                    kidx[k] = len(kinds)
                    kinds.append(k)
                of[e] = kidx[k]
            self.expert_kinds[unit] = (kinds, of)
        self.units = sorted(self.unit_bytes, key=unit_sort_key)
        self._vec: dict[tuple, list[int]] = {}
        self._unit_vec: dict[tuple, list[int]] = {}
        self._ranges: dict[tuple, list[tuple[int, int]]] = {}
        self._placed: dict[tuple, dict | None] = {}

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def _class_vec(self, c: int, tp: int, moe_tp: int) -> list[int]:
        """Bytes of class ``c`` on each local rank: tp entries (dense) or moe_tp (experts)."""
        m, role = self.classes[c]
        expert = role.expert is not None
        key = (c, tp, moe_tp if expert else tp)
        v = self._vec.get(key)
        if v is None:
            sp = Splitter(self.cfg, Layout(tp=tp, moe_ep=tp // moe_tp))
            view = sp.view(m, role)
            pieces = sp.pieces(view, role)
            if pieces is None:
                v = [view.nbytes] * (moe_tp if expert else tp)
            else:
                v = [_piece_bytes(p) for p in pieces]
            self._vec[key] = v
        return v

    def ranges(self, pp: int, pp_layers: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """Layer range per stage, as build_plan partitions them (by stored bytes)."""
        key = (pp, tuple(pp_layers) if pp_layers is not None else None)
        r = self._ranges.get(key)
        if r is None:
            ub = self.unit_bytes
            layer_bytes = [ub.get(f"layer.{i}", 0) for i in range(self.num_layers)]
            first = ub.get("embed", 0) + ub.get("vision", 0)
            last = sum(b for u, b in ub.items() if u == "head" or u.startswith("mtp."))
            r = partition_layers(
                layer_bytes, pp, first_fixed=first, last_fixed=last, explicit=pp_layers
            )
            self._ranges[key] = r
        return r

    def placement(self, layout: Layout, load, redundant: int) -> dict[int, list] | None:
        """MoE layer -> experts held by each EP rank, as build_plan places them
        (``shard.plan._place``'s rules, each distinct count list placed once); redundant
        copies without routing counts are placed from uniform counts (the
        lowest-numbered experts get the copies)."""
        key = (layout.moe_ep, redundant, id(load))
        if key in self._placed:
            return self._placed[key]
        layers = sorted(self.expert_role)
        if not layers:
            if redundant:
                raise ConfigError(
                    "--redundant-experts was given but the model has no routed experts."
                )
            self._placed[key] = None
            return None
        n = self.cfg.num_experts
        if redundant and load is None:
            load = {L: [1.0] * n for L in layers}
        if load is not None:
            missing = [L for L in layers if L not in load and self.num_layers > L]
            if missing:
                raise ConfigError(
                    f"--expert-load has no routing counts for MoE layer(s) {missing}; give "
                    f"counts for every MoE layer, or leave it out for contiguous placement."
                )
        done: dict[tuple, list] = {}
        out = {}
        for L in layers:
            counts = None if load is None else load.get(L, [1.0] * n)
            ck = tuple(counts) if counts is not None else None
            if ck not in done:
                done[ck] = place_experts(
                    n, layout.moe_ep, load=counts, redundant=redundant, where=f"layer {L}"
                )
            out[L] = done[ck]
        self._placed[key] = out
        return out

    def unit_vector(self, u: str, layout: Layout, placed: dict | None) -> list[int]:
        """Bytes of unit ``u`` on each tp rank of its stage."""
        tp, moe_tp = layout.tp, layout.moe_tp
        key = (u, tp, moe_tp, id(placed))
        v = self._unit_vec.get(key)
        if v is not None:
            return v
        v = [0] * tp
        for c, n in self.dense.get(u, {}).items():
            for i, b in enumerate(self._class_vec(c, tp, tp)):
                v[i] += n * b
        if u in self.expert_kinds:
            kinds, of = self.expert_kinds[u]
            kvec = [
                [sum(x) for x in zip(*(self._class_vec(c, tp, moe_tp) for c in k), strict=True)]
                for k in kinds
            ]
            held = placed[self.expert_layer[u]]
            for e, experts in enumerate(held):
                if len(kinds) == 1:
                    for j, b in enumerate(kvec[0]):
                        v[e * moe_tp + j] += len(experts) * b
                    continue
                for x in experts:
                    for j, b in enumerate(kvec[of[x]]):
                        v[e * moe_tp + j] += b
        self._unit_vec[key] = v
        return v

    def per_rank(
        self,
        layout: Layout,
        *,
        pp_layers: Sequence[int] | None = None,
        load=None,
        redundant: int = 0,
    ) -> tuple[list[int], list[tuple[int, int]], list[list[str]]]:
        """(weight bytes per global rank, layer range per stage, units per stage)."""
        ranges = self.ranges(layout.pp, pp_layers)
        stages = units_by_stage(self.units, ranges)
        for s, us in enumerate(stages):
            if not us:
                raise ConfigError(
                    f"pipeline stage {s} of pp={layout.pp} would hold nothing (layers per "
                    f"stage {short_list([b - a for a, b in ranges])}); use pp <= "
                    f"{self.num_layers} or set --pp-layers."
                )
        placed = self.placement(layout, load, redundant)
        out = [0] * layout.world
        for s, us in enumerate(stages):
            for u in us:
                for t, b in enumerate(self.unit_vector(u, layout, placed)):
                    out[layout.rank(s, t)] += b
        return out, ranges, stages


def build_plan_bytes(t: Tensors, layout: Layout, **kw) -> list[int]:
    """Per-rank tensor bytes of ``shard.plan.build_plan`` run on a metadata-only
    checkpoint of ``t`` (what ``shard`` writes): the reference :class:`WeightModel` must
    equal. Slow for a full-size model (every tensor entry of every rank is built)."""
    plan = build_plan(t.checkpoint(), layout, **kw)
    out = [0] * layout.world
    for u in plan.units:
        for tp in u.tensors:
            e = tp.entry
            out[u.rank] += _nbytes(tp.slice.src.dtype, e["shape"])
    return out

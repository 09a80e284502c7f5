"""The shard planner: which bytes of which source tensor go into which rank's unit.

Planning reads only metadata (headers, config), so every layout / split problem is
reported before a byte is written, and the plan doubles as the manifest's tensor
tables. Units per rank follow execution order: ``embed``, ``vision``, ``layer.0`` ...
``layer.N-1``, ``head``, then ``mtp.N`` ... (MTP layers run after the head on the last
stage). A tied lm_head is written into the head unit as a copy of the embedding
(``tied_to`` names the source) so the last stage never needs the first stage's unit.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..arch import resolve, validate_source
from ..arch.base import Role
from ..checkpoint import Checkpoint, TensorMeta
from ..checkpoint.bounded import read_json
from ..checkpoint.safetensors_io import TORCH_TO_ST
from ..errors import ConfigError, short_list
from ..layout import Layout, divisors, partition_layers, place_experts
from ..stream.format import SplitError, build_header, nbytes_of, unit_file, unit_metadata
from .split import PartSlice, Piece, split_tensor, whole

_UNIT_RX = re.compile(r"(embed|vision|head)|(layer|mtp)\.(\d+)\Z")
_UNIT_ORDER = {"embed": 0, "vision": 1, "layer": 2, "head": 3, "mtp": 4}


def unit_sort_key(unit: str) -> tuple[int, int]:
    m = _UNIT_RX.match(unit)
    if not m:
        raise ValueError(f"unknown unit name {unit!r}")
    if m.group(1):
        return _UNIT_ORDER[m.group(1)], 0
    return _UNIT_ORDER[m.group(2)], int(m.group(3))


@dataclass
class TensorPlan:
    """One physical tensor of one unit: its manifest entry and where its bytes come from."""

    entry: dict
    src_logical: str
    slice: PartSlice


@dataclass(eq=False)
class UnitPlan:
    """One unit of one rank. Its tensor records (``tensors``) are built when asked for,
    from the plan's per-unit-name tables, and not kept: a plan holds a few numbers per
    unit, not the hundreds of thousands of entries of a large layout (Kimi K3 at tp8
    ep8: ~1.1 million), so its memory is what the unit being written needs."""

    rank: int
    index: int
    name: str
    layer: int | None
    file: str
    #: the unit's tp index in its stage (its piece of each split tensor)
    tp: int = 0
    #: the unit file's size (header and aligned tensor bytes) and its tensor count
    nbytes: int = 0
    count: int = 0
    _records: _Records | None = field(default=None, repr=False)

    @property
    def tensors(self) -> list[TensorPlan]:
        """The unit's tensors in file order (built on demand; a few recent units are
        cached, as the writer asks for the same unit's records several times)."""
        return self._records.tensors(self) if self._records is not None else []

    def header(self) -> tuple[bytes, list, int]:
        """(header prefix, placed tensors, total bytes)."""
        return build_header(
            [(t.entry["name"], t.entry["dtype"], t.entry["shape"]) for t in self.tensors],
            unit_metadata(self.rank, self.name),
        )


@dataclass
class Plan:
    layout: Layout
    arch: str
    cfg: Any
    stages: list[dict]
    experts: dict | None
    units: list[UnitPlan]  # write order: unit order, then rank
    model: dict
    #: bytes the stream holds more than once (see :meth:`replicated_bytes`)
    replicated: int = 0

    def drop_records(self) -> None:
        """Let go of what builds the units' tensor records (the checkpoint the plan was
        made from, with its caches) once the stream is written: ``up.tensors`` is
        empty after this; sizes, counts, stages and placement stay."""
        for up in self.units:
            up._records = None

    def rank_units(self, rank: int) -> list[UnitPlan]:
        return sorted((u for u in self.units if u.rank == rank), key=lambda u: u.index)

    def replicated_bytes(self) -> int:
        """Bytes the stream holds more than once: the same slice of a source tensor on
        several ranks (what every rank needs whole - norms, a vision tower, a router -
        or a share of heads replicated across ranks), counted past its first copy. Why a
        stream can be larger than its source. Counted when the plan is built."""
        return self.replicated


#: the routing counts a calibrated ``quantize`` writes into its output (``{"layers": ...}``);
#: ``shard`` reads ``SRC/routing_counts.json`` when redundant experts are asked for without
#: an explicit expert load
ROUTING_COUNTS = "routing_counts.json"


def load_expert_load(expert_load) -> dict[int, list[float]] | None:
    """Routing counts per MoE layer: a mapping ``{layer: [count per expert]}`` or a JSON
    file holding one (optionally under a ``"layers"`` key)."""
    if expert_load is None:
        return None
    src = "expert_load"
    if isinstance(expert_load, (str, os.PathLike)):
        p = Path(expert_load)
        src = str(p)
        # a regular file under the size cap, strict JSON; errors name the file
        data = read_json(p, "report", ConfigError, obj=False)
    else:
        data = expert_load
    if isinstance(data, Mapping) and "layers" in data and isinstance(data["layers"], Mapping):
        data = data["layers"]
    if not isinstance(data, Mapping):
        raise ConfigError(f"{src}: must map layer index -> list of per-expert counts.")
    out = {}
    for k, v in data.items():
        try:
            layer = int(k)
            if isinstance(v, (str, bytes, Mapping)):
                raise TypeError("not a list")
            counts = [float(x) for x in v]
        except (TypeError, ValueError, OverflowError) as e:
            raise ConfigError(
                f"{src}: layer '{k}': expected a layer index and a list of numbers."
            ) from e
        for i, x in enumerate(counts):
            # json reads NaN / Infinity; they would reach the manifest (not JSON) and
            # make every placement comparison false
            if not math.isfinite(x) or x < 0:
                raise ConfigError(
                    f"{src}: layer {layer}, expert {i}: routing count {x!r} is not a finite "
                    f"non-negative number; give tokens routed to each expert (>= 0)."
                )
        out[layer] = counts
    return out


def units_by_stage(units: list[str], ranges: list[tuple[int, int]]) -> list[list[str]]:
    pp = len(ranges)
    stages: list[list[str]] = [[] for _ in range(pp)]
    for u in units:
        kind, idx = unit_sort_key(u)
        if kind in (0, 1):
            s = 0
        elif kind in (3, 4):
            s = pp - 1
        else:
            s = next(i for i, (a, b) in enumerate(ranges) if a <= idx < b)
        stages[s].append(u)
    return stages


def _st_dtype(pm) -> str:
    return TORCH_TO_ST[pm.dtype]


def _quant_json(m: TensorMeta) -> dict | None:
    if m.encoding == "plain":
        return None
    q = m.quant
    return {
        "num_bits": q.num_bits,
        "block": list(q.block) if q.block else None,
        "symmetric": q.symmetric,
        "strategy": (q.extra or {}).get("strategy"),
        "type": (q.extra or {}).get("type"),
    }


def _physical(logical: str, part: str, pm_name: str, tied_base: str | None) -> str:
    if tied_base is None:
        return pm_name
    return logical if part == "weight" else f"{tied_base}.{part}"


class Splitter:
    """Applies the DESIGN.md split rules of one role under the layout."""

    def __init__(self, cfg, layout: Layout):
        self.cfg, self.layout = cfg, layout

    def pieces(self, m: TensorMeta, role: Role) -> list[Piece] | None:
        """One piece per tp rank of the stage (None: replicated whole)."""
        tp = self.layout.moe_tp if role.expert is not None else self.layout.tp
        dname = "moe_tp (= tp / ep)" if role.expert is not None else "tp"
        d = role.split_dim
        if d is None or tp == 1 or d >= len(m.shape):
            return None
        rule = role.split
        if rule == "vocab":
            return split_tensor(m, 0, tp, mode="pad", what="vocab rows", degree_name=dname)
        if rule in ("kda_heads", "kda_row"):
            heads = self.cfg.kda_num_heads
            g = self._granule(m, d, heads, "KDA heads")
            return split_tensor(m, d, tp, granule=g, what="KDA heads", degree_name=dname)
        if rule == "kda_a_log":
            heads = self.cfg.kda_num_heads
            return split_tensor(m, m.shape.index(heads), tp, what="KDA heads", degree_name=dname)
        if rule == "heads" or (rule == "row" and role.kind == "o_proj"):
            heads = self.cfg.num_heads
            g = self._granule(m, d, heads, "attention heads")
            return split_tensor(m, d, tp, granule=g, what="attention heads", degree_name=dname)
        if rule == "kv_heads":
            kv = self.cfg.num_kv_heads
            g = self._granule(m, d, kv, "KV heads")
            if kv % tp and tp % kv:
                over = "exceeds" if tp > kv else "does not divide"
                raise SplitError(
                    f"cannot split '{m.name}' by KV heads: tp={tp} {over} the {kv} KV heads "
                    f"and is not a multiple of them, so heads cannot be replicated evenly. "
                    f"Use tp dividing {kv} ({', '.join(map(str, divisors(kv)))}) or a "
                    f"multiple of {kv}."
                )
            if tp <= kv:
                return split_tensor(m, d, tp, granule=g, what="KV heads", degree_name=dname)
            base = split_tensor(m, d, kv, granule=g, what="KV heads", degree_name="kv groups")
            rep = tp // kv
            return [base[r // rep] for r in range(tp)]
        return split_tensor(m, d, tp, what="rows" if d == 0 else "columns", degree_name=dname)

    def view(self, m: TensorMeta, role: Role) -> TensorMeta:
        """The tensor as the stream stores it: ``m`` itself, except KDA's per-head decay
        rates under tp > 1 (see :meth:`_a_log`)."""
        if role.split != "kda_a_log" or self.layout.tp == 1:
            return m
        return self._a_log(m)

    def _a_log(self, m: TensorMeta) -> TensorMeta:
        """KDA's decay rates, one per head: transformers' [1, 1, H, 1] is split along its
        head dim as it is; a padded vector (Kimi K3 stores [128] for 96 heads) is narrowed
        to its first H entries (the rest are never used), so the split pieces and the
        manifest's logical shape are [H]."""
        heads = self.cfg.kda_num_heads
        if m.encoding != "plain" or (heads not in m.shape and max(m.shape) < heads):
            raise SplitError(
                f"tensor '{m.name}' (shape {list(m.shape)}) does not hold one KDA decay rate "
                f"per head for the {heads} heads in config.json."
            )
        d = m.shape.index(heads) if heads in m.shape else len(m.shape) - 1
        if m.shape[d] != heads:  # padded: keep the used prefix
            shape = tuple(heads if i == d else n for i, n in enumerate(m.shape))
            parts = {
                k: replace(pm, shape=shape, nbytes=pm.nbytes // pm.shape[d] * heads)
                for k, pm in m.parts.items()
            }
            m = replace(m, shape=shape, parts=parts)
        return m

    @staticmethod
    def _granule(m: TensorMeta, d: int, heads: int, what: str) -> int:
        if m.shape[d] % heads:
            raise SplitError(
                f"tensor '{m.name}' dim {d} ({m.shape[d]}) is not a multiple of the {heads} "
                f"{what} in config.json; the checkpoint and config disagree."
            )
        return m.shape[d] // heads


def build_plan(
    ck: Checkpoint,
    layout: Layout,
    *,
    compression: str = "none",
    pp_layers: Sequence[int] | None = None,
    expert_load=None,
    redundant_experts: int = 0,
) -> Plan:
    """Plan every unit of every rank; raises before anything is written."""
    arch, cfg = resolve(ck.config, str(ck.root / "config.json"))
    names = ck.names()
    roles = {n: m.role for n, m in validate_source(arch, cfg, ck, str(ck.root)).items()}
    by_unit: dict[str, list[str]] = {}
    for n in names:
        by_unit.setdefault(roles[n].unit, []).append(n)

    # tied lm_head: a copy of the (non-MTP) embedding in the head unit
    tied: tuple[str, str] | None = None
    has_head = any(r.kind == "lm_head" for r in roles.values())
    embed = [n for n, r in roles.items() if r.kind == "embed_tokens" and not r.mtp]
    if getattr(cfg, "tie_word_embeddings", False) and not has_head and embed:
        head_rows = [s for s in arch.specs(cfg) if s.kind == "lm_head"]
        if head_rows:
            tied = (head_rows[0].pattern, embed[0])
            by_unit.setdefault("head", []).append(tied[0])

    def meta_of(n: str) -> TensorMeta:
        return ck.meta(tied[1] if tied and n == tied[0] else n)

    def role_of(n: str) -> Role:
        return roles[tied[1] if tied and n == tied[0] else n]

    unit_names = sorted(by_unit, key=unit_sort_key)
    ubytes = {u: sum(meta_of(n).nbytes for n in ns) for u, ns in by_unit.items()}
    num_layers = cfg.num_layers
    layer_bytes = [ubytes.get(f"layer.{i}", 0) for i in range(num_layers)]
    first = ubytes.get("embed", 0) + ubytes.get("vision", 0)
    last = sum(b for u, b in ubytes.items() if u == "head" or u.startswith("mtp."))
    ranges = partition_layers(
        layer_bytes, layout.pp, first_fixed=first, last_fixed=last, explicit=pp_layers
    )
    stage_units = units_by_stage(unit_names, ranges)
    for s, us in enumerate(stage_units):
        if not us:
            raise ConfigError(
                f"pipeline stage {s} of pp={layout.pp} would hold nothing (layers per stage "
                f"{short_list([b - a for a, b in ranges])}); use pp <= {num_layers} or set "
                f"pp_layers."
            )

    experts = _place(cfg, roles, layout, load_expert_load(expert_load), redundant_experts)

    records = _Records(by_unit, meta_of, role_of, Splitter(cfg, layout), layout, experts,
                       tied)  # fmt: skip
    write_order: list[UnitPlan] = []
    replicated = 0
    # a source slice is placed in its own unit only, but for the tied embedding's, which
    # the head unit holds again: those are remembered across units
    tied_seen: set[tuple] = set()
    for s, us in enumerate(stage_units):
        for idx, u in enumerate(us):
            layer = unit_sort_key(u)[1] if u.startswith(("layer.", "mtp.")) else None
            seen: set[tuple] = set()
            for t in range(layout.tp):
                r = layout.rank(s, t)
                up = UnitPlan(r, idx, u, layer, unit_file(r, idx, u, compression), t)
                up._records = records
                tensors = up.tensors  # every split checked here, before a byte is written
                up.nbytes, up.count = up.header()[2], len(tensors)
                for tp in tensors:
                    sl = tp.slice
                    key = (tp.src_logical, sl.part, sl.dim, sl.start, sl.length, sl.pad)
                    held = tied_seen if tied and tp.src_logical == tied[1] else seen
                    if key in held:
                        replicated += nbytes_of(tp.entry["dtype"], tp.entry["shape"])
                    held.add(key)
                write_order.append(up)
    stages = [
        {"pp_rank": s, "layers": list(ranges[s]), "units": stage_units[s]} for s in range(layout.pp)
    ]
    model = {
        "model_type": ck.config.get("model_type"),
        "arch": arch.name,
        "num_layers": num_layers,
        "num_mtp_layers": sum(1 for u in unit_names if u.startswith("mtp.")),
        "num_experts": getattr(cfg, "num_experts", 0) or 0,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "vision": "vision" in by_unit,
    }
    return Plan(layout, arch.name, cfg, stages, experts, write_order, model, replicated)


class _Records:
    """A plan's tensor records, built per unit when asked for. Kept per unit name: its
    tensors' positions (those every tp rank holds, and each routed expert's), so a unit
    builds the records of its own tensors only - an EP rank's experts, not the layer's.
    The last few units built are kept (``CACHED``)."""

    CACHED = 16

    def __init__(self, by_unit, meta_of, role_of, splitter: Splitter, layout: Layout,
                 experts, tied) -> None:  # fmt: skip
        self.by_unit, self.meta_of, self.role_of = by_unit, meta_of, role_of
        self.splitter, self.layout, self.experts, self.tied = splitter, layout, experts, tied
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[int, int], list[TensorPlan]] = OrderedDict()
        self._tables: dict[str, tuple] = {}

    def tensors(self, up: UnitPlan) -> list[TensorPlan]:
        key = (up.rank, up.index)
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                return got
        got = self._build(up)
        with self._lock:
            self._cache[key] = got
            while len(self._cache) > self.CACHED:
                self._cache.popitem(last=False)
        return got

    def _table(self, unit: str) -> tuple[list[int], dict[tuple[int, int], list[int]]]:
        """(positions of the unit's tensors every tp rank holds, {(layer, expert):
        positions of that routed expert's tensors}) in ``by_unit[unit]``"""
        got = self._tables.get(unit)
        if got is None:
            shared: list[int] = []
            by_expert: dict[tuple[int, int], list[int]] = {}
            for i, n in enumerate(self.by_unit[unit]):
                role = self.role_of(n)
                if role.expert is None:
                    shared.append(i)
                else:
                    by_expert.setdefault((role.layer, role.expert), []).append(i)
            got = self._tables[unit] = (shared, by_expert)
        return got

    def _build(self, up: UnitPlan) -> list[TensorPlan]:
        shared, by_expert = self._table(up.name)
        moe_tp = self.layout.moe_tp
        order = list(shared)
        if by_expert:
            ep, held = up.tp // moe_tp, {}
            for (layer, e), pos in by_expert.items():
                if layer not in held:
                    held[layer] = set(self.experts["layers"][str(layer)]["ep_rank_experts"][ep])
                if e in held[layer]:
                    order.extend(pos)
            order.sort()
        names, tied, splitter = self.by_unit[up.name], self.tied, self.splitter
        out: list[TensorPlan] = []
        for i in order:
            n = names[i]
            role = self.role_of(n)
            m = splitter.view(self.meta_of(n), role)
            pieces = splitter.pieces(m, role)
            tied_base = n.removesuffix(".weight") if tied and n == tied[0] else None
            k = up.tp % moe_tp if role.expert is not None else up.tp
            piece = whole(m) if pieces is None else pieces[k]
            quant = _quant_json(m)
            for ps in piece.parts:
                entry = {
                    "name": _physical(n, ps.part, ps.src.name, tied_base),
                    "logical": n,
                    "part": ps.part,
                    "kind": role.kind,
                    "dtype": _st_dtype(ps.src),
                    "shape": list(ps.shape),
                    "global_shape": list(ps.src.shape),
                    "split_dim": ps.dim,
                    "offset": ps.start,
                    "pad": ps.pad,
                    "logical_shape": list(m.shape),
                    "encoding": m.encoding,
                    "quant": None if quant is None else dict(quant),
                    "expert": role.expert,
                    "tied_to": tied[1] if tied_base else None,
                    "contents": ps.contents,
                }
                out.append(TensorPlan(entry, m.name, ps))
        return out


def _place(cfg, roles, layout: Layout, load, redundant: int) -> dict | None:
    moe_layers = sorted({r.layer for r in roles.values() if r.expert is not None})
    if not moe_layers:
        if redundant:
            raise ConfigError("redundant_experts was given but the model has no routed experts.")
        return None
    n_exp = cfg.num_experts
    if load is not None:
        missing = [L for L in moe_layers if L not in load and cfg.num_layers > L]
        if missing:
            raise ConfigError(
                f"expert_load has no routing counts for MoE layer(s) {missing}; calibrate "
                f"all MoE layers or drop expert_load for contiguous placement."
            )
    layers = {}
    for L in moe_layers:
        counts = load.get(L) if load is not None else None
        if load is not None and counts is None:  # MTP layer without calibration counts
            counts = [1.0] * n_exp
        held = place_experts(
            n_exp, layout.moe_ep, load=counts, redundant=redundant, where=f"layer {L}"
        )
        ranks_of = [[r for r, h in enumerate(held) if e in h] for e in range(n_exp)]
        layers[str(L)] = {
            "ep_rank_experts": held,
            "expert_ep_ranks": ranks_of,
            "load": None if load is None or L not in load else list(load[L]),
        }
    return {
        "policy": "contiguous" if load is None else "load",
        "num_experts": n_exp,
        "redundant": redundant,
        "layers": layers,
    }

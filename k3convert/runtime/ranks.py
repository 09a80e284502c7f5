"""What every rank of a layout holds: from a stream's manifest, or planned on the fly.

A :class:`RankSet` is the parallel runtime's weight source: the layout, the pipeline
stages, the expert placement, one reader per rank (its units in execution order, its
local tensors by name, dequantized on request) and a *global view* (every logical
tensor with its unsharded shape) that the architecture table validates exactly as it
validates a checkpoint.

Two ways to get one, one set of split rules:

- :func:`stream_ranks`: a stream directory; each rank reads only its own unit files.
- :func:`planned_ranks`: an original (or quantized) checkpoint and a layout. The shard
  planner (``k3convert.shard.plan.build_plan``, the code ``k3convert shard`` writes
  with) decides every rank's pieces, and a unit is sliced out of the source files when
  the runtime asks for it, byte for byte what ``shard`` would have written.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import TensorMeta
from ..checkpoint.safetensors_io import ST_DTYPES
from ..layout import Layout
from ..shard.plan import build_plan
from ..shard.unit_io import SourceMaps, tensor_bytes
from ..stream.reader import RankReader, Stream, Unit, part_meta, quant_params_of


@dataclass
class StageInfo:
    pp_rank: int
    layers: tuple[int, int]  # [start, end)
    units: list[str]


class GlobalView:
    """Every logical tensor of a rank set with its unsharded (logical) shape: what
    ``Arch.validate`` checks against config.json. Tied lm_head copies are left out, as a
    checkpoint has none. Parts (``input_scale`` ...) are handed out by the rank readers,
    not by the view (``rank_parts``)."""

    rank_parts = True

    def __init__(self, config: dict, manifest: dict, root: Path):
        self.config = config
        self.root = root
        self._entries: dict[str, list[dict]] = {}
        seen: dict[str, set] = {}
        for r in manifest["ranks"]:
            for u in r["units"]:
                for e in u["tensors"]:
                    if e.get("tied_to"):
                        continue
                    parts = seen.setdefault(e["logical"], set())
                    if e["part"] not in parts:
                        parts.add(e["part"])
                        self._entries.setdefault(e["logical"], []).append(e)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def meta(self, name: str) -> TensorMeta:
        es = self._entries[name]
        parts = {e["part"]: part_meta(e, self.root, "global_shape") for e in es}
        e0 = es[0]
        return TensorMeta(
            name,
            tuple(e0["logical_shape"]),
            e0["encoding"],
            parts,
            quant_params_of(e0["quant"], e0["encoding"]),
        )


class RankSet:
    """The ranks of one layout (see the module docstring)."""

    def __init__(self, *, config: dict, manifest: dict, root: Path, readers, kind: str, where: str):
        lay = manifest["layout"]
        self.config = config
        self.manifest = manifest
        self.root = root
        self.kind = kind  # "stream" | "planned"
        self.where = where
        self.layout = Layout(lay["tp"], lay["pp"], lay["moe_tp"], lay["moe_ep"])
        self.stages = [
            StageInfo(s["pp_rank"], (s["layers"][0], s["layers"][1]), list(s["units"]))
            for s in lay["stages"]
        ]
        self.experts = lay.get("experts")
        self.readers: dict[int, RankReader] = readers
        self.view = GlobalView(config, manifest, root)

    @property
    def world(self) -> int:
        return self.layout.world

    def rank(self, r: int) -> RankReader:
        return self.readers[r]

    def tp_group(self, stage: int) -> tuple[int, ...]:
        tp = self.layout.tp
        return tuple(range(stage * tp, (stage + 1) * tp))

    def expert_copies(self, layer: int) -> list[list[int]] | None:
        """EP ranks holding each expert of ``layer`` (None: not a MoE layer)."""
        if not self.experts:
            return None
        info = self.experts["layers"].get(str(layer))
        return None if info is None else info["expert_ep_ranks"]


def stream_ranks(stream: Stream) -> RankSet:
    readers = {r: stream.rank(r) for r in range(stream.world)}
    return RankSet(
        config=stream.config,
        manifest=stream.manifest,
        root=stream.root,
        readers=readers,
        kind="stream",
        where=str(stream.root),
    )


class _PlannedStream:
    """What a :class:`RankReader` needs of its stream, for units planned in memory."""

    def __init__(self, root: Path, manifest: dict, config: dict):
        self.root = root
        self.manifest = manifest
        self.config = config
        self.verify_hashes = False


class PlannedRankReader(RankReader):
    """A rank of a layout over an unsharded checkpoint: units are cut from the source
    files by the shard plan when loaded (nothing is written)."""

    def __init__(self, stream: _PlannedStream, rank: int, ck, unit_plans):
        super().__init__(stream, rank)
        self._ck = ck
        self._plans = unit_plans

    def _load(self, i: int) -> Unit:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        up = self._plans[i]
        tensors = _SlicedTensors(self._ck, {t.entry["name"]: t for t in up.tensors})
        entries = list(self.unit_entries[i]["tensors"])
        unit = Unit(self.rank, up.index, up.name, up.layer, self._ck.root, entries, tensors)
        self._cache[i] = unit
        while len(self._cache) > 2:
            self._cache.popitem(last=False)
        return unit


class _SlicedTensors(dict):
    """A planned unit's tensors by physical name, each cut from the source when asked
    for and not kept: memory follows what the runtime holds (one expert at a time), not
    the unit. Unsplit parts are zero-copy views of the source mapping."""

    def __init__(self, ck, plans: dict):
        super().__init__()
        self._plans = plans
        self._src = SourceMaps(ck)

    def __missing__(self, name: str) -> torch.Tensor:
        tp = self._plans[name]
        e = tp.entry
        dtype = ST_DTYPES[e["dtype"]][0]
        mv = tensor_bytes(self._src, tp)
        if not len(mv):
            return torch.empty(e["shape"], dtype=dtype)
        with warnings.catch_warnings():  # read-only mapping: the runtime never writes
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mv, dtype=torch.uint8)
        t = flat.view(dtype) if dtype != torch.uint8 else flat
        return t.reshape(e["shape"])

    def __contains__(self, name) -> bool:
        return name in self._plans


def planned_ranks(
    ck,
    layout: Layout,
    *,
    pp_layers=None,
    expert_load=None,
    redundant_experts: int = 0,
) -> RankSet:
    """Every rank of ``layout`` over checkpoint ``ck``, by the shard planner's split rules."""
    plan = build_plan(
        ck,
        layout,
        pp_layers=pp_layers,
        expert_load=expert_load,
        redundant_experts=redundant_experts,
    )
    ranks = []
    plans: dict[int, list] = {}
    for r in range(layout.world):
        ups = plan.rank_units(r)
        plans[r] = ups
        units = [
            {"index": up.index, "name": up.name, "layer": up.layer, "file": up.file,
             "tensors": [t.entry for t in up.tensors]}
            for up in ups
        ]  # fmt: skip
        ranks.append({"rank": r, **layout.coords(r), "units": units})
    manifest = {
        "model": plan.model,
        "layout": {
            **layout.to_json(),
            "world": layout.world,
            "stages": plan.stages,
            "experts": plan.experts,
        },
        "ranks": ranks,
    }
    ps = _PlannedStream(ck.root, manifest, ck.config)
    readers = {r: PlannedRankReader(ps, r, ck, plans[r]) for r in range(layout.world)}
    return RankSet(
        config=ck.config, manifest=manifest, root=ck.root, readers=readers, kind="planned",
        where=str(ck.root),
    )  # fmt: skip

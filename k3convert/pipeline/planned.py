"""The quantized checkpoint ``convert`` streams from without writing it:
:class:`PlannedCheckpoint` answers the shard writer's reads by quantizing the tensors
then (kept tensors mapped from the source, bit for bit), caching a tensor several units
read within a byte budget."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from pathlib import Path

import torch

from ..checkpoint import Checkpoint
from ..checkpoint.output import group_by_size, shard_names
from ..checkpoint.reader import PartMeta, QuantConfig, group_parts, quant_config_of
from ..quant.writer import (
    DEFAULT_SHARD_SIZE,
    check_kept_plain,
    check_stored,
    output_entries,
    row_tensors,
)

#: computed tensors kept for their later readers at most (then recomputed on demand)
DEFAULT_CACHE_BYTES = 2 << 30
#: where a planned tensor "lives" (messages only: it is never a file)
_PLANNED = "<planned quantized checkpoint>"


class PlannedCheckpoint(Checkpoint):
    """The compressed-tensors checkpoint ``quantize`` would write from ``prepared``
    (:class:`k3convert.pipeline.quantize.Prepared`), as a :class:`Checkpoint` whose tensors are
    produced when read: ``part_tensor(logical, part)`` quantizes the row on first use.

    ``expect(units)`` tells it which unit tensors will be read (the units this process
    writes), so a produced row is dropped right after its last reader."""

    values_stored = False

    def __init__(self, prepared, cache_bytes: int = DEFAULT_CACHE_BYTES):
        ck = prepared.ckpt
        self.prepared = prepared
        self.config_doc = prepared.output_config()
        raw: dict[str, PartMeta] = {}
        self._row_of: dict[str, object] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        self._extra = dict(prepared.kv_tensors or {})
        # each part "lives" in the file quantize would write it to (write_shards' split):
        # an engine writer's file order (which member of a fused layer vLLM reads last)
        # is the written checkpoint's
        rows = prepared.plan.rows
        shards = group_by_size(rows, lambda r: r.out_bytes, DEFAULT_SHARD_SIZE)
        names = shard_names(len(shards) + (1 if self._extra else 0))
        where = Path(ck.root) / _PLANNED
        file_of = {r.name: where / names[i] for i, group in enumerate(shards) for r in group}
        for r in rows:
            for name, dt, shape in output_entries(r):
                nbytes = torch.Size(shape).numel() * dt.itemsize
                raw[name] = PartMeta(name, file_of[r.name], dt, tuple(shape), nbytes, None)
                self._row_of[name] = r
            if not r.kept or r.as_stored:
                shapes[r.name] = tuple(r.shape)
        for name, t in self._extra.items():
            raw[name] = PartMeta(name, where / names[-1], t.dtype, tuple(t.shape),
                                 t.numel() * t.itemsize)  # fmt: skip
        self._shapes = shapes
        metas = group_parts(raw, QuantConfig(quant_config_of(self.config_doc)), None, shapes)
        super().__init__(Path(ck.root), self.config_doc, metas, [])
        self.source = ck
        self.__dict__["aux_files"] = list(ck.aux_files)  # the source's (cached_property)
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, dict] = OrderedDict()  # row name -> outputs
        self._held = 0
        self._busy: dict[str, threading.Event] = {}
        self._refs: Counter[str] = Counter()
        self.produced = 0  # rows computed (recomputations included)
        #: mapped-as-stored rows whose values were checked (NaN / Inf, E8M0 255) once
        self._checked: set[str] = set()
        #: row name -> its loss against the release (:mod:`.quant.fidelity`), once per row
        self.losses: dict[str, object] = {}

    def layout_doc(self) -> dict:
        """Its tensors as a file would list them (name, dtype, shape) and the logical
        shapes its packed weights would store: what :func:`described_checkpoint` makes a
        metadata-only :class:`Checkpoint` of again (``verify`` of files written from it,
        with no checkpoint on disk)."""
        return {
            "tensors": [[pm.name, str(pm.dtype).removeprefix("torch."), list(pm.shape)]
                        for m in self._metas.values() for pm in m.parts.values()],
            "shapes": {n: list(s) for n, s in self._shapes.items()},
        }  # fmt: skip

    def _reads(self, units) -> Counter[str]:
        refs: Counter[str] = Counter()
        for up in units:
            for tp in up.tensors:
                if tp.slice.contents == "local_shape":
                    continue
                pm = self.meta(tp.src_logical).parts[tp.slice.part]
                r = self._row_of.get(pm.name)
                if r is not None:
                    refs[r.name] += 1
        return refs

    def expect(self, units) -> None:
        """Count the reads ``units`` will make, per row."""
        refs = self._reads(units)
        with self._lock:
            self._refs = refs

    def _part_reads(self, parts) -> Counter[str]:
        refs: Counter[str] = Counter()
        for logical, part in parts:
            r = self._row_of.get(self.meta(logical).parts[part].name)
            if r is not None:
                refs[r.name] += 1
        return refs

    def expect_parts(self, parts) -> None:
        """Count the reads to come as ``(logical, part)`` pairs, one per
        :meth:`part_tensor` call (an engine writer's pieces)."""
        refs = self._part_reads(parts)
        with self._lock:
            self._refs = refs

    def skip(self, unit) -> None:
        """``unit`` will not be written (a rerun found it intact): its reads are not
        coming, so rows it shares are not held for it."""
        self._forget(self._reads([unit]))

    def drop_parts(self, parts) -> None:
        """:meth:`skip` for reads counted by :meth:`expect_parts`."""
        self._forget(self._part_reads(parts))

    def _forget(self, refs: Counter[str]) -> None:
        with self._lock:
            for name, k in refs.items():
                self._refs[name] -= k
                if self._refs[name] <= 0 and name in self._cache:
                    self._held -= _nbytes(self._cache.pop(name))

    def get_parts(self, name: str) -> dict[str, torch.Tensor]:
        return {k: self.part_tensor(name, k) for k in self.meta(name).parts}

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A plain tensor as produced (an engine writer's whole tensors); an encoded one
        is read by parts."""
        m = self.meta(name)
        if m.encoding != "plain":
            raise NotImplementedError(f"'{name}' is {m.encoding}: read it by parts")
        t = self.part_tensor(name, "weight")
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def part_tensor(self, logical: str, part: str) -> torch.Tensor:
        pm = self.meta(logical).parts[part]
        if pm.name in self._extra:
            return self._extra[pm.name]
        r = self._row_of[pm.name]
        return self._outputs(r)[pm.name]

    def source_part(self, logical: str, part: str) -> PartMeta | None:
        """The source's part that this output part is byte for byte (an as-stored row's
        part, a kept row's stored weight), its row checked as a first read checks it
        (:func:`check_stored`, :func:`check_kept_plain`), once; None for a part that is
        computed. The shard writer copies such a part from the source's file mapping."""
        pm = self.meta(logical).parts[part]
        r = self._row_of.get(pm.name)
        if r is None or not self._cheap(r):
            return None
        if r.name not in self._checked:
            if r.as_stored:
                check_stored(self.source, r)
            elif not check_kept_plain(self.source, r):
                raise AssertionError(f"{r.name}: planned as a stored weight, not one")
            with self._lock:
                self._checked.add(r.name)
        parts = self.source.meta(r.name).parts
        return parts[pm.name[len(r.module) + 1 :]] if r.as_stored else parts["weight"]

    def _cheap(self, r) -> bool:
        """Whether row ``r``'s outputs are its source parts as stored (not a tensor
        calibration's smoothing changed)."""
        p = self.prepared
        smoothed = p.calibrated is not None and r.name in p.calibrated.kept_rows
        return r.as_stored or (r.kept and not r.encoded and not smoothed and self._stored_plain(r))

    def _outputs(self, r) -> dict[str, torch.Tensor]:
        p = self.prepared
        cheap = self._cheap(r)
        if cheap and r.name in self._checked:  # mapped again; checked by its first read
            parts = p.ckpt.get_parts(r.name)
            if r.as_stored:
                return {f"{r.module}.{k}": v for k, v in parts.items()}
            return {r.name: parts["weight"]}
        while True:
            with self._lock:
                hit = self._cache.get(r.name)
                if hit is not None:
                    self._release(r.name)
                    return hit
                ev = self._busy.get(r.name)
                if ev is None:
                    ev = self._busy[r.name] = threading.Event()
                    break
            ev.wait()  # another unit is producing this row: take its result
        losses: list = []
        try:
            out = row_tensors(p.ckpt, r, p.input_scales, p.shared, p.calibrated, losses)
        except BaseException:
            with self._lock:
                self._busy.pop(r.name).set()
            raise
        with self._lock:
            self.produced += 1
            self.losses.update((e.name, e) for e in losses)
            if cheap:
                self._checked.add(r.name)
            if not cheap and self._refs[r.name] > 1:
                self._cache[r.name] = out
                self._held += _nbytes(out)
                self._release(r.name)
                self._evict()
            else:
                self._refs[r.name] -= 1
            self._busy.pop(r.name).set()
        return out

    def _stored_plain(self, r) -> bool:
        main = self.source.meta(r.name).parts.get("weight")
        return main is not None and main.raw is not None

    def _release(self, name: str) -> None:
        """One read of a cached row done (lock held); drop it after its last."""
        self._refs[name] -= 1
        if self._refs[name] <= 0 and name in self._cache:
            self._held -= _nbytes(self._cache.pop(name))

    def _evict(self) -> None:
        while self._held > self.cache_bytes and len(self._cache) > 1:
            _, out = self._cache.popitem(last=False)
            self._held -= _nbytes(out)

    @property
    def held_bytes(self) -> int:
        return self._held


def _nbytes(out: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in out.values())

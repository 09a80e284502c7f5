"""Where the runtime's weights come from, and how they are staged one unit at a time.

The runtime asks a :class:`WeightSource` for tensors by name (one exception, below); the
checkpoint reader is one today, the streaming-format reader plugs in later. A source is
three things: the raw ``config.json`` dict, the tensor names it holds, and
``get(name, dtype)`` returning one tensor, dequantized when stored encoded.

:class:`UnitLoader` groups those names into execution units (``embed``, ``vision``,
``layer.N``, ``head``) through the architecture table, loads one unit when the runtime
asks for it, keeps it until another unit is asked for, and loads the next unit of the
execution order on a background thread meanwhile. So at most two units of weights are
alive at once (the current one and the prefetched one), whatever the model size.

The exception: over a safetensors :class:`~k3convert.checkpoint.Checkpoint` the plain
(unencoded) tensors of a unit are mapped here, from the checkpoint's validated header
offsets, one file mapping per run of adjacent tensors (:func:`plain_runs`,
:func:`map_runs`), instead of one ``get`` (an open and an mmap) per tensor; mapping,
faulting and unmapping ~60 small mappings a layer cost about as much as the layer's
attention. The views are the ones ``get`` returns. Routed experts stored in the compute
dtype are then used in place (zero copy: their stored bytes, mapped with the unit);
experts that need a conversion or dequantization stay :class:`Lazy`, made one at a time
when they run. A unit all of whose tensors are mapped so costs ~0.3 ms to load and is
"prefetched" on the calling thread (see :meth:`UnitLoader.get`).
"""

from __future__ import annotations

import functools
import mmap
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..arch import Role
from ..arch.base import Match
from ..checkpoint.reader import Checkpoint
from ..errors import CheckpointError


@runtime_checkable
class WeightSource(Protocol):
    """What the runtime needs from a checkpoint or a stream.

    ``config``: the raw config.json dict. ``names()``: every tensor name the source holds
    (logical names: a quantized weight is one ``...weight`` name). ``get(name, dtype)``:
    that tensor, dequantized if stored encoded; ``dtype=None`` keeps a plain tensor's
    stored dtype (encoded tensors then come back as float32).
    """

    config: dict

    def names(self) -> Iterable[str]: ...

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Entry:
    """One tensor of a unit: its name in the source and its key inside the unit.

    key: ``component.kind`` from the architecture role, with the expert index inserted
    for routed experts (``routed_experts.3.gate_proj``) and the block index prefixed for
    vision blocks (``blocks.0.vision.wqkv``); spelling differences between checkpoints
    (``block_sparse_moe.experts.E.w1`` vs ``mlp.experts.E.gate_proj``) vanish here.
    """

    name: str
    key: str
    role: Role


def entry_key(role: Role, canonical: str) -> str:
    kind = role.kind
    if canonical.endswith(".bias") and not kind.endswith("_bias"):
        kind += "_bias"  # norm rows share one kind for weight and bias
    key = f"{role.component}.{kind}"
    if role.expert is not None:
        key = f"{role.component}.{role.expert}.{kind}"
    if role.block is not None:
        key = f"blocks.{role.block}.{key}"
    return key


@dataclass
class Plan:
    """The units of one source, in execution order, with their entries."""

    units: dict[str, dict[str, Entry]]
    order: list[str]

    def next_unit(self, unit: str) -> str | None:
        try:
            i = self.order.index(unit)
        except ValueError:
            return None
        return self.order[i + 1] if i + 1 < len(self.order) else None


def make_plan(cfg: Any, matched: Mapping[str, Match], *, tied: bool, where: str) -> Plan:
    """Group the matched names (``Arch.validate``) into units; MTP layers are left out
    (the forward never runs them)."""
    units: dict[str, dict[str, Entry]] = {}
    for n in matched:
        role = matched[n].role
        if role.mtp:
            continue
        key = entry_key(role, matched[n].canonical)
        unit = units.setdefault(role.unit, {})
        if key in unit:
            raise CheckpointError(
                f"{where}: tensors '{unit[key].name}' and '{n}' are the same weight "
                f"({key}) spelled two ways; remove one of them."
            )
        unit[key] = Entry(n, key, role)
    if tied:
        emb = units.get("embed", {}).get("embeddings.embed_tokens")
        if emb is not None:
            units.setdefault("head", {})["head.lm_head"] = emb
    order = ["embed"]
    if "vision" in units:
        order.append("vision")
    order += [f"layer.{i}" for i in range(cfg.num_layers)]
    order.append("head")
    return Plan(units, order)


class Lazy:
    """A tensor made when it is used (a routed expert, dequantized on use): a Kimi-K2 MoE
    layer is ~17 B parameters, so a unit's experts are never dequantized all at once."""

    __slots__ = ("make",)

    def __init__(self, make):
        self.make = make


class Weights(dict):
    """A loaded unit: key -> tensor, plus key -> source name for hooks and messages.

    Values may be :class:`Lazy`: ``need`` / ``get`` / ``[]`` make them on every use and
    keep nothing, so one expert at a time exists in the compute dtype. ``splits``: key ->
    the manifest entry of the tensor's weight part on a tensor-parallel rank (split_dim,
    offset, pad, logical_shape); empty for an unsharded source.
    """

    def __init__(
        self,
        unit: str,
        tensors: dict[str, torch.Tensor],
        names: dict[str, str],
        splits: dict[str, dict] | None = None,
    ):
        super().__init__(tensors)
        self.unit = unit
        self.names = names
        self.splits = splits or {}

    def __getitem__(self, key: str) -> torch.Tensor:
        v = dict.__getitem__(self, key)
        return v.make() if isinstance(v, Lazy) else v

    def get(self, key: str, default=None):
        # no try/except: absent keys are the common case (``<linear>_bias``, per call)
        return self[key] if dict.__contains__(self, key) else default

    def need(self, key: str) -> torch.Tensor:
        try:
            return self[key]
        except KeyError:
            raise CheckpointError(
                f"unit '{self.unit}': the checkpoint has no tensor for '{key}' (it holds "
                f"{', '.join(sorted(self)) or 'nothing'}); the weights are incomplete."
            ) from None


#: keys kept in float32 whatever the compute dtype (routers, as the reference does)
FP32_KINDS = ("router.router", "router.e_score_correction_bias")


class UnitLoader:
    """Loads units on demand, keeps the current one, prefetches the next.

    resident=True keeps every unit once loaded (for repeated forwards of a small model).
    input_scales: weight names whose static activation parameters (the ``input_scale``
    / ``input_zero_point`` parts, shape [1]) are loaded with them, under the unit keys
    ``<key>_input_scale`` / ``<key>_input_zero_point``; the scale in the compute dtype
    (compressed-tensors keeps it in the module's dtype).
    """

    def __init__(
        self,
        source: WeightSource,
        plan: Plan,
        *,
        dtype: torch.dtype,
        device: torch.device,
        prefetch: bool = True,
        resident: bool = False,
        input_scales: frozenset[str] = frozenset(),
    ):
        self.source = source
        self.plan = plan
        self.input_scales = input_scales
        self.dtype = dtype
        self.device = device
        self.resident = resident
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="k3-prefetch") if prefetch else None
        self._pending: tuple[str, Future] | None = None
        self._current: Weights | None = None
        self._cache: dict[str, Weights] = {}
        self._runs: dict[str, tuple[list[Run], bool]] = {}  # unit -> (runs, cheap)
        self._lock = threading.Lock()
        self.loads = 0  # units loaded from the source (tests check streaming behaviour)

    def has(self, unit: str) -> bool:
        return unit in self.plan.units

    def get(self, unit: str) -> Weights:
        with self._lock:
            w = self._take(unit)
            self._current = w
            if self.resident:
                self._cache[unit] = w
            nxt = self.plan.next_unit(unit)
            if self._pool is not None and nxt is not None and not self._ready(nxt):
                if self._runs_of(nxt)[1]:
                    # nothing to compute: mapping the unit here (~0.3 ms) beats waking the
                    # prefetch thread, whose Python would hold the GIL that this thread
                    # needs between its ops; the kernel's readahead overlaps the I/O
                    fut: Future = Future()
                    try:
                        fut.set_result(self._load(nxt, True))
                    except Exception as e:  # raised when the unit is asked for, as before
                        fut.set_exception(e)
                else:
                    fut = self._pool.submit(self._load, nxt, True)
                self._pending = (nxt, fut)
        return w

    def release(self) -> None:
        """Drop the current unit (and any prefetch) unless resident."""
        with self._lock:
            self._current = None
            if self._pending is not None:
                self._pending[1].cancel()
                self._pending = None

    def close(self) -> None:
        self.release()
        self._cache.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _ready(self, unit: str) -> bool:
        return unit in self._cache or (self._pending is not None and self._pending[0] == unit)

    def _take(self, unit: str) -> Weights:
        if unit in self._cache:
            return self._cache[unit]
        if self._current is not None and self._current.unit == unit:
            return self._current
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == unit:
            return pending[1].result()
        if pending is not None:
            pending[1].cancel()
        self._current = None  # let the old unit go before loading the new one
        return self._load(unit)

    def _load(self, unit: str, touch: bool = False) -> Weights:
        """Read one unit. touch (prefetch thread): start the unit's I/O now so that it
        overlaps compute; synchronous loads leave that to first use, which costs the same.
        Tensors mapped with the unit (:func:`map_runs`) are only advised to the kernel
        (readahead, no CPU spent here: page faults taken on this thread would stall the
        compute threads on a machine with no spare core); others are faulted in.
        Routed experts not usable in place stay :class:`Lazy` (dequantized and converted
        when they run, one at a time)."""
        entries = self.plan.units.get(unit, {})
        mapped = map_runs(self._runs_of(unit)[0], advise=touch)
        tensors: dict[str, torch.Tensor | Lazy] = {}
        for key, e in entries.items():
            t = mapped.get(e.name)
            expert = e.role.expert is not None
            if t is None:
                if expert:
                    tensors[key] = Lazy(functools.partial(self._tensor, key, e.name, False))
                else:
                    tensors[key] = self._tensor(key, e.name, touch)
            elif expert and not in_place(t.dtype, key, self.dtype, self.device):
                make = functools.partial(to_compute, t, key, e.name, self.dtype, self.device, False)
                tensors[key] = Lazy(make)
            else:
                tensors[key] = to_compute(t, key, e.name, self.dtype, self.device, False)
        for key, e in entries.items():
            if e.name in self.input_scales:
                tensors.update(self._activation_params(key, e.name))
        self.loads += 1
        return Weights(unit, tensors, {k: e.name for k, e in entries.items()})

    def _runs_of(self, unit: str) -> tuple[list[Run], bool]:
        """The unit's :func:`plain_runs` (read from the metadata once), and whether
        loading it is cheap: every tensor mapped, and used in place or a :class:`Lazy`
        expert (nothing converted, dequantized or read part by part at load)."""
        if unit not in self._runs:
            entries = self.plan.units.get(unit, {})
            runs = plain_runs(self.source, [e.name for e in entries.values()])
            dtypes = {t.name: t.dtype for r in runs for t in r.tensors}
            cheap = all(
                e.name in dtypes
                and e.name not in self.input_scales
                and (e.role.expert is not None or in_place(dtypes[e.name], key, self.dtype,
                                                             self.device))
                for key, e in entries.items()
            )  # fmt: skip
            self._runs[unit] = (runs, cheap)
        return self._runs[unit]

    def _tensor(self, key: str, name: str, touch: bool) -> torch.Tensor:
        return to_compute(self.source.get(name, None), key, name, self.dtype, self.device, touch)

    def _activation_params(self, key: str, name: str) -> dict[str, torch.Tensor]:
        get_parts = getattr(self.source, "get_parts", None)
        if get_parts is None:
            return {}
        return activation_params(get_parts(name), key, self.dtype, self.device)


def activation_params(parts: dict, key: str, dtype, device) -> dict[str, torch.Tensor]:
    """A Linear's static activation parameters as unit entries ``<key>_input_scale`` (in
    the compute dtype, as compressed-tensors keeps it) / ``<key>_input_zero_point``."""
    out = {}
    if "input_scale" in parts:
        out[key + "_input_scale"] = parts["input_scale"].to(device, dtype)
    if "input_zero_point" in parts:
        out[key + "_input_zero_point"] = parts["input_zero_point"].to(device)
    return out


def in_place(stored: torch.dtype, key: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`to_compute` hands a ``stored`` tensor back as it is (no copy)."""
    want = torch.float32 if key in FP32_KINDS else dtype
    return device.type == "cpu" and (stored == want or key == "embeddings.embed_tokens")


def to_compute(
    t: torch.Tensor, key: str, name: str, dtype: torch.dtype, device: torch.device, touch: bool
) -> torch.Tensor:
    """A loaded tensor in the compute dtype on the device; zero-copy when it already is."""
    if not t.is_floating_point():
        raise CheckpointError(
            f"tensor '{name}' comes back as {t.dtype}, not a float tensor; the "
            f"weight source must dequantize encoded tensors in get()."
        )
    if in_place(t.dtype, key, dtype, device):
        # zero copy: a file-mapped tensor is used in place (the source's mapping is released
        # when the unit is dropped). The embedding table is gathered row by row as stored:
        # converting it whole would copy the largest tensor of the model for a few rows.
        return _touch(t) if touch else t
    dtype = torch.float32 if key in FP32_KINDS else dtype
    out = torch.empty(t.shape, dtype=dtype, device=device)
    out.copy_(t)  # one pass: convert (and move)
    return out


#: tensors of a unit at most this far apart in a file share one mapping; a larger gap
#: starts another, so a mapping never spans much that the unit does not use
RUN_GAP = 1 << 20


@dataclass(frozen=True)
class RunTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the run's mapping

    @property
    def strides(self) -> tuple[int, ...]:  # row-major, as stored
        out, step = [], 1
        for d in reversed(self.shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))


@dataclass(frozen=True)
class Run:
    """Tensors lying close together in one file, mapped together: ``[start, end)`` of
    ``path`` (start aligned for mmap)."""

    path: Any
    start: int
    end: int
    tensors: tuple[RunTensor, ...]


def plain_runs(source, names: Iterable[str]) -> list[Run]:
    """The plain floating-point safetensors tensors among ``names`` of a
    :class:`~k3convert.checkpoint.Checkpoint` (none for other sources), grouped in runs
    of tensors lying within :data:`RUN_GAP` of each other in one file. Metadata only.

    Only the exact ``Checkpoint`` type qualifies: a wrapper or subclass may change what
    ``get`` returns. Encoded, non-float, empty and ``.bin`` tensors are left to ``get``.
    """
    if type(source) is not Checkpoint:
        return []
    by_file: dict = {}
    for n in dict.fromkeys(names):  # a tied lm_head names the embedding a second time
        m = source.meta(n)
        raw = m.main.raw if m.encoding == "plain" else None
        if raw is None or raw.nbytes == 0 or not raw.dtype.is_floating_point:
            continue
        by_file.setdefault(m.main.file, []).append((n, raw))
    runs: list[Run] = []
    for path, items in by_file.items():
        items.sort(key=lambda x: x[1].start)
        group = [items[0]]
        for it in items[1:]:
            if it[1].start - group[-1][1].end > RUN_GAP:
                runs.append(_run(path, group))
                group = []
            group.append(it)
        runs.append(_run(path, group))
    return runs


def _run(path, group: list) -> Run:
    start = group[0][1].start - group[0][1].start % mmap.ALLOCATIONGRANULARITY
    end = max(raw.end for _, raw in group)
    ts = tuple(RunTensor(n, raw.dtype, tuple(raw.shape), raw.start - start) for n, raw in group)
    return Run(path, start, end, ts)


def map_runs(runs: list[Run], advise: bool = False) -> dict[str, torch.Tensor]:
    """name -> zero-copy view: the views ``source.get(name)`` returns (copy-on-write
    mappings of the file, released when the last view dies), with one ``mmap`` per run
    instead of an open and an mmap per tensor. advise: ask the kernel to read the runs
    ahead (``MADV_WILLNEED``) without faulting them in."""
    out: dict[str, torch.Tensor] = {}
    for r in runs:
        with open(r.path, "rb") as fh:  # mmap keeps its own descriptor
            mm = mmap.mmap(fh.fileno(), r.end - r.start, offset=r.start, access=mmap.ACCESS_COPY)
        if advise and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_WILLNEED)
        # one flat tensor per dtype (and byte phase, for odd offsets), each tensor a strided
        # view of it: half the per-tensor cost of frombuffer + reshape
        flats: dict[tuple, torch.Tensor] = {}
        for t in r.tensors:
            size = t.dtype.itemsize
            phase = t.offset % size
            flat = flats.get((t.dtype, phase))
            if flat is None:
                count = (r.end - r.start - phase) // size
                flat = flats[t.dtype, phase] = torch.frombuffer(
                    mm, dtype=t.dtype, count=count, offset=phase
                )
            out[t.name] = flat.as_strided(t.shape, t.strides, (t.offset - phase) // size)
    return out


def _touch(t: torch.Tensor) -> torch.Tensor:
    """Read one element per 4 KiB page so a lazily mapped tensor is resident."""
    if t.numel():
        flat = t.reshape(-1)
        flat[:: max(1, 4096 // t.element_size())].sum()
    return t

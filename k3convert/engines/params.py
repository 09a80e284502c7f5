"""Engine-neutral pieces of an engine target: what one rank's file holds.

A :class:`Param` is one parameter of one rank (name, dtype, shape, its value on demand);
its :class:`Piece` records map it back to the checkpoint (``param[dst] == part[src]``),
so the writer's mapping can run backwards (``verify``). :class:`Slicer` cuts a
checkpoint's stored parts (a plain weight, packed codes, scales, zero points) by output
rows or input columns as the format registry's axis maps say (the stream's split rules:
:func:`k3convert.shard.split.part_range`), refusing a cut inside a pack, an FP4 byte or
a quantization group / block. Nothing here knows an engine's names or placement rules
(those are in ``vllm_layers`` / ``vllm_sharded``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..checkpoint import Checkpoint
from ..errors import ConfigError
from ..layout import Layout
from ..shard.plan import Splitter
from ..shard.split import part_range
from ..stream.format import SplitError

ALL: tuple[slice, ...] = ()  # a whole tensor, as a Piece's index


#: the most a strided slice (a row-parallel rank's columns) is copied at once to be written
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class Piece:
    """Where a block of a vLLM parameter comes from: ``param[dst] == part[src]`` of
    checkpoint tensor ``name`` (``part``: a key of its stored parts; None: the plain
    tensor). The writer's mapping, kept so ``verify`` can run it backwards."""

    name: str
    part: str | None
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


@dataclass
class Param:
    """One parameter of one rank: its name, shape and dtype up front, its value on demand,
    and the pieces of the checkpoint it holds (none: a constant vLLM creates)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor] | None
    #: instead of ``make``: the tensor as runs of its rows, one at a time (written without
    #: ever holding it whole)
    stacked: Callable[[], Iterator[torch.Tensor]] | None = None
    pieces: tuple[Piece, ...] = ()


def module_parts(ck: Checkpoint, module: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """part -> (shape, dtype) of a Linear's stored parts (weight, scales, bias)."""
    m = ck.meta(f"{module}.weight")
    parts = {k: (p.shape, p.dtype) for k, p in m.parts.items()}
    bias = f"{module}.bias"
    if bias in ck:
        b = ck.meta(bias).main
        parts["bias"] = (b.shape, b.dtype)
    return parts


def origin(module: str, part: str) -> tuple[str, str | None]:
    """(checkpoint tensor, part) of a Linear's stored part: a bias is its own tensor."""
    return (f"{module}.bias", None) if part == "bias" else (f"{module}.weight", part)


class Slicer:
    """The checkpoint's tensors sliced as one rank of vLLM needs them. ``roles``: each
    tensor's role in its architecture (``validate_source``'s matches): what
    :meth:`span` cuts it by."""

    def __init__(self, ck: Checkpoint, cfg, dtype: torch.dtype, roles: dict):
        self.ck, self.cfg, self.dtype = ck, cfg, dtype
        self.roles = roles
        self._splitters: dict[tuple[int, bool], Splitter] = {}

    def span(self, name: str, tp: int, tp_size: int, ep: bool = False) -> tuple[int, int, int]:
        """``(a, b, full)``: tensor ``name``'s share on tensor-parallel rank ``tp`` of
        ``tp_size``, along the dim its role splits, by the stream's split rules
        (:class:`k3convert.shard.plan.Splitter`: attention heads, KV heads replicated
        once tp passes their count, column- / row-parallel rows and columns; a routed
        expert whole under expert parallelism, ``ep``). A tensor every rank holds whole:
        ``(0, rows, rows)``. Refusals are the stream's, as one ConfigError."""
        meta, role = self.ck.meta(name), self.roles[name]
        key = (tp_size, ep)
        if key not in self._splitters:
            layout = Layout(tp=tp_size, moe_ep=tp_size if ep else 1)
            self._splitters[key] = Splitter(self.cfg, layout)
        try:
            pieces = self._splitters[key].pieces(meta, role)
        except SplitError as e:
            raise ConfigError(str(e)) from None
        if pieces is None or pieces[tp].dim is None:
            d = role.split_dim if role.split_dim is not None else 0
            return 0, meta.shape[d], meta.shape[d]
        p = pieces[tp]
        return p.start, p.start + p.length, meta.shape[p.dim]

    def whole(self, name: str, dtype: torch.dtype | None = None) -> Param:
        meta = self.ck.meta(name)
        if meta.encoding != "plain":
            raise ConfigError(f"'{name}' is {meta.encoding}-encoded where vLLM takes it plain.")
        p = meta.main
        dt = dtype or p.dtype

        def make():
            return self.ck.get(name).to(dt)

        return Param(name, dt, p.shape, make, pieces=(Piece(name, None, ALL, ALL),))

    def column(self, module: str, part: str, a: int, b: int, out: int) -> tuple:
        """Rows [a, b) of ``out`` (output features) of one part: (shape, dtype, thunk,
        the source rows: a slice, or None for the whole part)."""
        shape, dtype = self._stored(module, part)
        if part == "weight_shape" or not shape:  # (a 0-d part: refused by fused)
            return shape, dtype, lambda: self.ck.part_tensor(f"{module}.weight", part), None
        lo, hi = self.cut(module, part, 0, a, b, out) or (0, shape[0])
        new = (hi - lo, *shape[1:])

        def make():
            t = self._part(module, part)
            return t[lo:hi]

        return new, dtype, make, slice(lo, hi)

    def row(self, module: str, part: str, a: int, b: int, inp: int) -> Param:
        """Columns [a, b) of ``inp`` (input features) of one part."""
        shape, dtype = self._stored(module, part)
        name = f"{module}.{part}"
        whole = Piece(*origin(module, part), ALL, ALL)
        got = None if part == "weight_shape" else self.cut(module, part, 1, a, b, inp)
        if got is None:
            # the same on every rank: vLLM's row-parallel bias (added once) and per-channel
            # or per-tensor scales are whole on each; a group scale is split with its groups
            return Param(name, dtype, shape, lambda: self._part(module, part), pieces=(whole,))
        lo, hi = got

        def chunks():  # a few MiB of rows at a time: no copy of the whole slice
            t = self._part(module, part)
            step = max(1, CHUNK_BYTES // max(1, t[:1, lo:hi].numel() * t.element_size()))
            for i in range(0, t.shape[0], step):
                yield t[i : i + step, lo:hi]

        cols = Piece(whole.name, whole.part, (slice(None), slice(lo, hi)), ALL)
        shape = (shape[0], hi - lo, *shape[2:])
        return Param(name, dtype, shape, None, chunks, pieces=(cols,))

    def cut(self, module: str, part: str, d: int, a: int, b: int, full: int):
        """[lo, hi) of a Linear's stored ``part`` along logical dim ``d`` (0: output
        rows, 1: input columns) for the logical [a, b) of ``full``, by the format
        registry's axis map; None when the part does not follow ``d`` (held whole)."""
        tensor, key = origin(module, part)
        m = self.ck.meta(tensor)
        if d >= len(m.shape):  # a bias along the input columns: whole on every rank
            return None
        if m.shape[d] != full:
            raise ConfigError(
                f"'{tensor}' has {m.shape[d]} along dim {d} where the model's config gives "
                f"{full}; the checkpoint does not match its config.json."
            )
        try:
            return part_range(m, key or next(iter(m.parts)), d, a, b)
        except SplitError as e:
            raise ConfigError(f"{module}: {e}") from None

    def _stored(self, module: str, part: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of a Linear's part as written: :meth:`_part`'s dtype (an
        unquantized weight in the model dtype, whatever the file stores it in)."""
        shape, dtype = module_parts(self.ck, module)[part]
        if part != "bias" and self.ck.meta(f"{module}.weight").encoding == "plain":
            dtype = self.dtype
        return shape, dtype

    def _part(self, module: str, part: str) -> torch.Tensor:
        if part == "bias":
            return self.ck.get(f"{module}.bias")
        meta = self.ck.meta(f"{module}.weight")
        t = self.ck.part_tensor(f"{module}.weight", part)
        # an unquantized weight takes the model dtype; a stored code (int8, fp8) stays
        return t.to(self.dtype) if meta.encoding == "plain" else t

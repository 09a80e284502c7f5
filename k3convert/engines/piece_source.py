"""Engine-neutral: the checkpoint an engine target's rank files hold, read back through
the inverse of the writer's mapping (what ``verify`` runs on such a directory).

:class:`PieceSource` is a runtime weight source (``config``, ``names()``, ``meta()``,
``get()``) whose every value comes from the rank files: each checkpoint tensor is
reassembled from the pieces the writer put on each rank (:class:`~.params.Piece`: a KV
head's rows out of a merged projection, an expert's rows out of a stacked parameter, a
rank's vocabulary rows, ...) and dequantized as its compressed-tensors scheme says. The
mapping is the writer's own, recomputed from the source checkpoint's metadata (tensor
names, shapes, parts: no values); the engine's module opens the directory and gives it.

Checked, beyond the target's own check (hashes, keys, shapes, finite values): every
rank file holds exactly the parameters the mapping gives it; the constants the engine
creates are those; a tensor held by several ranks (a KV head at tp > kv, a norm, a
per-channel scale) is the same on each, bit for bit; and every value of every tensor is
on some rank. Memory: one tensor at a time, read by slices.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoint import Checkpoint
from ..checkpoint.encodings import ENCODINGS
from ..stream.format import StreamCorruptError
from .params import Param, Piece


class PieceSource:
    """The checkpoint ``ck`` (metadata) as the rank files under ``root`` hold it:
    ``rank_files`` maps each file's name to the parameters the writer put in it;
    ``carried``: tensors of which the files hold a leading block (name -> that shape);
    ``config``: the directory's config.json."""

    #: the engine and its ``--target`` name, as messages name them
    engine = "the engine"
    target = "?"

    def __init__(self, root: Path, ck: Checkpoint, rank_files: dict[str, list[Param]],
                 carried: dict[str, tuple[int, ...]], config: dict):  # fmt: skip
        self.root, self.ck, self.config = Path(root), ck, config
        self._files: dict[str, object] = {}
        self._pieces: dict[tuple[str, str], list[tuple[str, str, Piece]]] = defaultdict(list)
        for fname, params in rank_files.items():
            self._index_rank(fname, params)
        self.files = len(rank_files)
        self._carried = carried
        self._held = frozenset(name for name, _ in self._pieces)
        self._names = sorted(self._held)

    def _index_rank(self, fname: str, params: list[Param]) -> None:
        f = self._open(fname)
        held = set(f.keys())
        want = {p.name for p in params}
        if held != want:
            extra, missing = sorted(held - want), sorted(want - held)
            raise StreamCorruptError(
                f"{self.root / fname}: holds {len(extra)} parameter(s) the mapping does not "
                f"give this rank ({', '.join(extra[:2]) or '-'}) and lacks {len(missing)} "
                f"({', '.join(missing[:2]) or '-'}); was the source changed since it was "
                f"written? Rewrite it with `k3convert shard --target {self.target}`."
            )
        for p in params:
            if not p.pieces:  # a constant the engine creates: it must be that constant
                got, want_t = f.get_tensor(p.name), p.make()
                if got.dtype != want_t.dtype or not torch.equal(got, want_t):
                    raise StreamCorruptError(
                        f"{self.root / fname}: '{p.name}' is not the constant "
                        f"{self.engine} creates ({want_t.flatten()[:1].tolist()}); rewrite OUT."
                    )
            for pc in p.pieces:  # a plain tensor's one part, by its key
                part = pc.part or next(iter(self.ck.meta(pc.name).parts))
                self._pieces[(pc.name, part)].append((fname, p.name, pc))

    def _open(self, fname: str):
        if fname not in self._files:
            self._files[fname] = safe_open(self.root / fname, "pt")
        return self._files[fname]

    def names(self) -> list[str]:
        return list(self._names)

    def meta(self, name: str):
        """The source's metadata of ``name`` (shape, encoding, parts): the runtime's shape
        checks. Its values are never read from the source."""
        return self.ck.meta(name)

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``name`` reassembled from the ranks, dequantized when stored encoded."""
        meta = self.ck.meta(name)
        if meta.encoding == "plain":
            shape = self._carried.get(name, meta.main.shape)  # (a padded tensor's prefix)
            t = self._assemble(name, next(iter(meta.parts)), shape, meta.shape)
            return t if dtype is None or t.dtype == dtype else t.to(dtype)
        try:
            return ENCODINGS[meta.encoding].dequantize_to(self.get_parts(name), meta.quant, dtype)
        except (RuntimeError, ValueError) as e:  # parts the encoding cannot read
            raise StreamCorruptError(
                f"{self.root}: '{name}' cannot be decoded from the rank files ({e}); rewrite OUT."
            ) from e

    def get_parts(self, name: str) -> dict[str, torch.Tensor]:
        """``name``'s stored parts, each reassembled from the ranks: the runtime reads a
        static input scale here, as vLLM holds it (FusedMoE keeps one for gate and up)."""
        meta = self.ck.meta(name)
        return {k: self._assemble(name, k, pm.shape, meta.shape) for k, pm in meta.parts.items()}

    def _assemble(self, name: str, part: str, shape, logical) -> torch.Tensor:
        try:
            return self._assembled(name, part, shape, logical)
        except (RuntimeError, ValueError, TypeError) as e:  # shapes the files do not hold
            raise StreamCorruptError(
                f"{self.root}: '{name}' ({part}) cannot be reassembled from the rank files "
                f"as the directory describes it ({e}); rewrite OUT."
            ) from e

    def _assembled(self, name: str, part: str, shape, logical) -> torch.Tensor:
        hits = self._pieces.get((name, part))
        if not hits:
            if part == "weight_shape":  # (an engine that keeps one fused member's)
                return torch.tensor(list(logical), dtype=self.ck.meta(name).parts[part].dtype)
            raise StreamCorruptError(f"{self.root}: no rank file holds '{name}' ({part}).")
        full: torch.Tensor | None = None
        seen = torch.zeros(tuple(shape), dtype=torch.bool)
        for fname, pname, pc in hits:
            sl = self._open(fname).get_slice(pname)
            block = sl[pc.dst] if pc.dst else sl[:]
            if full is None:
                full = torch.empty(tuple(shape), dtype=block.dtype)
            view, done = full[pc.src], seen[pc.src]
            block = block.reshape(view.shape)
            if bool(done.all()):  # a replica: equal to the copy already read
                if not torch.equal(view, block):
                    raise StreamCorruptError(
                        f"{self.root / fname}: '{pname}' holds a copy of '{name}' that "
                        f"differs from another rank's; rewrite OUT."
                    )
            elif bool(done.any()):
                raise StreamCorruptError(f"{self.root}: '{name}': overlapping pieces.")
            else:
                view.copy_(block)
                done.fill_(True)
        if not bool(seen.all()):
            raise StreamCorruptError(
                f"{self.root}: {int((~seen).sum())} value(s) of '{name}' are on no rank."
            )
        stored = self.ck.meta(name).parts[part].dtype
        if full.dtype != stored:  # (an engine's float32 router bias / conv, bf16 shapes)
            back = full.to(stored)
            if not torch.equal(back.to(full.dtype), full):
                raise StreamCorruptError(
                    f"{self.root}: '{name}' ({part}) holds {full.dtype} values that its "
                    f"source's {stored} cannot hold (the writer casts losslessly); rewrite OUT."
                )
            full = back
        return full

    def close(self) -> None:
        self._files.clear()


__all__ = ["PieceSource"]

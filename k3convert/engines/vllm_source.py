"""``verify`` of a vLLM sharded_state directory: its rank files read back through the
inverse of the writer's mapping.

:class:`VllmSource` is a runtime weight source (``config``, ``names()``, ``meta()``,
``get()``) whose every value comes from the directory's rank files: each checkpoint
tensor is reassembled from the pieces the writer put on each rank
(:class:`~.params.Piece`: a KV head's rows out of ``qkv_proj``, an expert's rows
out of ``w13_weight``, a rank's vocabulary rows, ...) and dequantized as its
compressed-tensors scheme says. The mapping is recomputed from the metadata of the
source checkpoint the index names (tensor names, shapes, parts: no values).

Checked, beyond ``shard --check`` (hashes, keys, shapes, finite values): every rank file
holds exactly the parameters the mapping gives it; the constants vLLM creates (the
attention's unit scales) are those; a tensor held by several ranks (a KV head at tp >
kv, a norm, a per-channel scale) is the same on each, bit for bit; and every value of
every tensor is on some rank. Memory: one tensor at a time, read by slices.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import torch
import zstandard
from safetensors import safe_open

from ..checkpoint import Checkpoint, load_json, open_checkpoint
from ..checkpoint.encodings import ENCODINGS
from ..checkpoint.reader import described_checkpoint
from ..checkpoint.safetensors_io import open_regular
from ..errors import ConfigError
from ..stream.format import StreamCorruptError
from .params import Param, Piece
from .vllm_index import check_vllm, read_index
from .vllm_layers import Rank
from .vllm_sharded import DESCRIBED, carried_shapes, rank_params

#: the most a described tensor list may hold once decompressed (a 3 T model's is ~100 MB)
_DESCRIBED_MAX = 256 << 20
#: bytes a described list may hold beyond the rank files' (K3's A_log padding, shapes)
_SLACK = 64 << 20


def _described(root: Path, src: Path, index: dict) -> Checkpoint:
    """The metadata-only checkpoint the rank files were cut from, as the directory
    describes it (:data:`~.vllm_sharded.DESCRIBED` and the carried config.json). Its
    tensors may not hold more bytes than the rank files (every value is on some rank;
    vLLM's few constants and a padding it never reads aside): a hostile list cannot
    make ``verify`` allocate what the files do not hold."""
    p = root / DESCRIBED
    try:
        chunks, n = [], 0
        with open_regular(p, StreamCorruptError) as f:
            z = zstandard.ZstdDecompressor().stream_reader(f)
            while chunk := z.read(8 << 20):
                n += len(chunk)
                if n > _DESCRIBED_MAX:
                    raise ValueError(f"more than {_DESCRIBED_MAX >> 20} MiB once decompressed")
                chunks.append(chunk)
        doc = json.loads(b"".join(chunks), parse_constant=_no_constant)
        held = sum(int(f.get("bytes", 0)) for f in index["files"] if isinstance(f, dict))
        return described_checkpoint(src, load_json(root / "config.json"), doc, DESCRIBED,
                                    max_bytes=held + _SLACK)  # fmt: skip
    except (OSError, ValueError, TypeError, zstandard.ZstdError, RecursionError) as e:
        raise StreamCorruptError(
            f"{p}: the tensor list the rank files are mapped back with is unreadable "
            f"({e}); rewrite OUT."
        ) from e


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class VllmSource:
    """The checkpoint a vLLM sharded_state directory holds, tensor by tensor."""

    def __init__(self, path: str | os.PathLike, *, check: bool = True):
        self.root = Path(path)
        if check:
            check_vllm(self.root)
        index = read_index(self.root)
        src = Path(index.get("source") or "")
        if index.get("described") is not None:  # written in one pass: no checkpoint on disk
            self.ck = _described(self.root, src, index)
        elif not (src / "config.json").is_file():
            raise ConfigError(
                f"{self.root}: verify maps the rank files back with the layout of the source "
                f"checkpoint its index names ({src}), which is not there; restore it, or "
                f"verify the source itself."
            )
        else:
            self.ck = open_checkpoint(src)  # metadata only: every value is read from the ranks
        self.source = src
        lay = index["layout"]
        tp, pp, ep = int(lay["tp"]), int(lay["pp"]), int(lay.get("ep", 1))
        self.layout = {"tp": tp, "pp": pp, "ep": ep}
        ranks = [Rank(t, p, tp, pp, ep > 1) for p in range(pp) for t in range(tp)]
        self._files: dict[str, object] = {}
        self._pieces: dict[tuple[str, str], list[tuple[str, str, Piece]]] = defaultdict(list)
        for r, params in rank_params(self.ck, ranks).items():
            self._index_rank(r.file(), params)
        self.files = len(ranks)
        self._carried = carried_shapes(self.ck)
        self.config = load_json(self.root / "config.json")
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
                f"written? Rewrite it with `k3convert shard --target vllm`."
            )
        for p in params:
            if not p.pieces:  # a constant vLLM creates: it must be that constant
                got, want_t = f.get_tensor(p.name), p.make()
                if got.dtype != want_t.dtype or not torch.equal(got, want_t):
                    raise StreamCorruptError(
                        f"{self.root / fname}: '{p.name}' is not the constant vLLM creates "
                        f"({want_t.flatten()[:1].tolist()}); rewrite OUT."
                    )
            for pc in p.pieces:  # a plain tensor's one part, by its key
                part = pc.part or next(iter(self.ck.meta(pc.name).parts))
                self._pieces[(pc.name, part)].append((fname, p.name, pc))

    def describe(self) -> str:
        lay = self.layout
        return (
            f"vLLM sharded_state (tp {lay['tp']}, pp {lay['pp']}, ep {lay['ep']}): "
            f"{len(self._names)} tensors reassembled from {self.files} rank file(s) "
            f"(replicas and vLLM's constants checked), run in one process"
        )

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
            if part == "weight_shape":  # vLLM keeps only the last fused member's
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
        if full.dtype != stored:  # vLLM's float32 router bias / conv, its bf16 expert shapes
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


__all__ = ["VllmSource"]

"""``verify`` of a vLLM sharded_state directory: its rank files read back through the
inverse of the writer's mapping (:class:`~.piece_source.PieceSource`).

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
from pathlib import Path

import zstandard

from ..checkpoint import Checkpoint, load_json, open_checkpoint
from ..checkpoint.reader import described_checkpoint
from ..checkpoint.safetensors_io import open_regular
from ..errors import ConfigError
from ..stream.format import StreamCorruptError
from .piece_source import PieceSource
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


class VllmSource(PieceSource):
    """The checkpoint a vLLM sharded_state directory holds, tensor by tensor."""

    engine, target = "vLLM", "vllm"

    def __init__(self, path: str | os.PathLike, *, check: bool = True):
        root = Path(path)
        if check:
            check_vllm(root)
        index = read_index(root)
        src = Path(index.get("source") or "")
        if index.get("described") is not None:  # written in one pass: no checkpoint on disk
            ck = _described(root, src, index)
        elif not (src / "config.json").is_file():
            raise ConfigError(
                f"{root}: verify maps the rank files back with the layout of the source "
                f"checkpoint its index names ({src}), which is not there; restore it, or "
                f"verify the source itself."
            )
        else:
            ck = open_checkpoint(src)  # metadata only: every value is read from the ranks
        self.source = src
        lay = index["layout"]
        tp, pp, ep = int(lay["tp"]), int(lay["pp"]), int(lay.get("ep", 1))
        self.layout = {"tp": tp, "pp": pp, "ep": ep}
        ranks = [Rank(t, p, tp, pp, ep > 1) for p in range(pp) for t in range(tp)]
        files = {r.file(): params for r, params in rank_params(ck, ranks).items()}
        super().__init__(root, ck, files, carried_shapes(ck), load_json(root / "config.json"))

    def describe(self) -> str:
        lay = self.layout
        return (
            f"vLLM sharded_state (tp {lay['tp']}, pp {lay['pp']}, ep {lay['ep']}): "
            f"{len(self._names)} tensors reassembled from {self.files} rank file(s) "
            f"(replicas and vLLM's constants checked), run in one process"
        )


__all__ = ["VllmSource"]

"""Reading back a directory ``shard --target vllm`` wrote: whether a path is one, the
``LLM(...)`` call that loads it, and ``shard --check`` (the index, every rank file's
hash, and its tensors against the index)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..stream.format import StreamCorruptError
from ..stream.hashing import file_digest
from .vllm_sharded import FORMAT, HASH, INDEX, Rank


def llm_call(out: str | os.PathLike) -> str:
    """The ``LLM(...)`` call that loads a written directory, from its index.

    - A float32 checkpoint adds ``dtype='float32'``: vLLM's ``dtype="auto"`` builds a
      float32 config's model in bfloat16 (``_get_and_verify_dtype``), and
      ``ShardedStateLoader`` would round our float32 files into it without a word.
    - Kimi K3 adds ``kda_decode_backend="triton"``: vLLM 0.32's other KDA decode paths keep
      float32 copies of ``conv1d`` / ``o_norm`` that only its HF weight loader fills,
      which ``sharded_state`` never calls (they would hold uninitialised memory)."""
    index = json.loads((Path(out) / INDEX).read_text())
    lay = index["layout"]
    args = [f"model='{out}'", "load_format='sharded_state'", f"tensor_parallel_size={lay['tp']}"]
    if lay["pp"] > 1:
        args.append(f"pipeline_parallel_size={lay['pp']}")
    if lay.get("ep", 1) > 1:
        args.append("enable_expert_parallel=True")
    if index.get("dtype") == "float32":
        args.append("dtype='float32'")
    if index.get("model_type") == "kimi_k3":
        args.append("additional_config={'kda_decode_backend': 'triton'}")
    return f"LLM({', '.join(args)})"


def is_vllm_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / INDEX).is_file()


def check_vllm(path: str | os.PathLike) -> str:
    """``shard --check`` of a sharded_state directory: the index (one file per rank of
    its layout), every file's hash, and every file's tensors against the index (each key
    once, shapes, dtypes, finite values). Raises StreamCorruptError naming the first
    problem; returns a summary."""
    d = Path(path)
    try:
        index = json.loads((d / INDEX).read_text())
    except (OSError, ValueError) as e:
        raise StreamCorruptError(f"{d / INDEX}: unreadable ({e}); rewrite OUT.") from e
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise StreamCorruptError(f"{d / INDEX}: not a {FORMAT} index; rewrite OUT.")
    try:
        return _check_files(d, index)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a malformed entry
        raise StreamCorruptError(f"{d / INDEX}: malformed ({e!r}); rewrite OUT.") from e


def _check_files(d: Path, index: dict) -> str:
    from safetensors import safe_open

    lay = index["layout"]
    tp, pp = int(lay["tp"]), int(lay["pp"])
    want = {Rank(t, p, tp, pp).file() for p in range(pp) for t in range(tp)}
    names = [f["name"] for f in index["files"]]
    if sorted(names) != sorted(want):
        raise StreamCorruptError(
            f"{d / INDEX}: lists {len(names)} rank file(s), not the {len(want)} of tp {tp} x "
            f"pp {pp}; rewrite OUT."
        )
    n = 0
    for f in index["files"]:
        p = d / f["name"]
        if not p.is_file():
            raise StreamCorruptError(f"{p}: missing (listed in {INDEX}); rewrite OUT.")
        if p.stat().st_size != f["bytes"] or file_digest(p, HASH) != f["hash"]:
            raise StreamCorruptError(f"{p}: size or {HASH} hash differs from {INDEX}.")
        with safe_open(p, "pt") as sf:
            keys = list(sf.keys())
            if sorted(keys) != sorted(f["tensors"]):
                raise StreamCorruptError(f"{p}: its tensors differ from those {INDEX} lists.")
            for k in keys:
                t = sf.get_tensor(k)
                want = f["tensors"][k]
                dt = str(t.dtype).removeprefix("torch.")
                if list(t.shape) != want["shape"] or dt != want["dtype"]:
                    raise StreamCorruptError(f"{p}: '{k}' is not {want['dtype']} {want['shape']}.")
                if t.is_floating_point() and t.element_size() == 1:  # fp8: no isfinite
                    t = t.float()
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise StreamCorruptError(f"{p}: '{k}' holds NaN / inf.")
                n += 1
    return (
        f"{d}: vLLM sharded_state intact: {len(index['files'])} rank file(s) (tp "
        f"{lay['tp']}, pp {lay['pp']}), {n} tensors, hashes match (vLLM {index['vllm']} layout)"
    )

"""Reading back a directory ``shard --target vllm`` wrote: whether a path is one, the
``LLM(...)`` call that loads it, and ``shard --check`` (the index, bounded and strict;
the directory holding exactly what it lists; every rank and carried file's hash; the
rank files' tensors against the index)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..checkpoint.bounded import read_json
from ..checkpoint.output import refuse_partial
from ..stream.format import StreamCorruptError
from ..stream.hashing import file_digest
from .rank_files import SEAL, seal
from .vllm_layers import Rank
from .vllm_sharded import DESCRIBED, FORMAT, HASH, INDEX, INDEX_VERSION, MAX_WORLD

#: files k3convert's own steps add after the commit (``convert``'s report), which no
#: loader reads: allowed unlisted, as regular files
CONVERT_REPORT = "convert_report.json"
#: convert's loss report of a one-pass write (:mod:`k3convert.quant.fidelity`'s file)
LOSS_REPORT = "transcode_report.json"
REPORTS = frozenset({CONVERT_REPORT, LOSS_REPORT})


def read_index(path: str | os.PathLike) -> dict:
    """The index of a written directory: a regular file under its size cap, strict JSON,
    this format and version, a layout of positive integers within bounds. Raises
    StreamCorruptError (exit 1) naming the problem."""
    p = Path(path) / INDEX
    index = read_json(p, "output index", StreamCorruptError, finite=True)
    if index.get("format") != FORMAT:
        raise StreamCorruptError(f"{p}: not a {FORMAT} index; rewrite OUT.")
    if index.get("version") != INDEX_VERSION:
        raise StreamCorruptError(
            f"{p}: index version {index.get('version')!r}, not {INDEX_VERSION} (written by "
            f"another k3convert: {index.get('generator')!r}); rewrite OUT with this version."
        )
    if index.get(SEAL) != seal(index, HASH):
        raise StreamCorruptError(
            f"{p}: its fields differ from those written (its {SEAL} does not match them): "
            f"the index was edited or damaged; rewrite OUT."
        )
    lay = index.get("layout")
    nums = [lay.get(k, 1 if k == "ep" else None) for k in ("tp", "pp", "ep")] if isinstance(
        lay, dict) else [None]  # fmt: skip
    if not all(type(n) is int and n >= 1 for n in nums) or nums[0] * nums[1] > MAX_WORLD:
        raise StreamCorruptError(
            f"{p}: layout {lay!r} is not tp / pp / ep of positive integers with at most "
            f"{MAX_WORLD} ranks; rewrite OUT."
        )
    if not isinstance(index.get("source"), str) or not index["source"]:
        raise StreamCorruptError(f"{p}: 'source' must name the source directory; rewrite OUT.")
    for key in ("files", "carried", "source_files"):
        if not isinstance(index.get(key), list):
            raise StreamCorruptError(f"{p}: '{key}' must be a list; rewrite OUT.")
    if index.get("described", DESCRIBED) != DESCRIBED or (
            "described" in index and DESCRIBED not in {
                f.get("name") for f in index["carried"] if isinstance(f, dict)}):  # fmt: skip
        raise StreamCorruptError(
            f"{p}: 'described' must name the carried {DESCRIBED}; rewrite OUT."
        )
    return index


def llm_call(out: str | os.PathLike) -> str:
    """The ``LLM(...)`` call that loads a written directory, from its index.

    - A float32 checkpoint adds ``dtype='float32'``: vLLM's ``dtype="auto"`` builds a
      float32 config's model in bfloat16 (``_get_and_verify_dtype``), and
      ``ShardedStateLoader`` would round our float32 files into it without a word.
    - Kimi K3 adds ``kda_decode_backend="triton"``: vLLM 0.32's other KDA decode paths keep
      float32 copies of ``conv1d`` / ``o_norm`` that only its HF weight loader fills,
      which ``sharded_state`` never calls (they would hold uninitialised memory)."""
    index = read_index(out)
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
    refuse_partial(d)  # a stage (interrupted, or refused at its commit) is no output
    index = read_index(d)
    try:
        return _check_files(d, index)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a malformed entry
        raise StreamCorruptError(f"{d / INDEX}: malformed ({e!r}); rewrite OUT.") from e
    except SafetensorError as e:  # a rank file whose listed hash matches, yet is no file
        raise StreamCorruptError(f"{d}: a rank file is not valid safetensors ({e}).") from e


def check_listed(d: Path, index: dict) -> None:
    """The directory holds exactly what the index lists (rank files, carried files, the
    index), each a regular file, and every carried file has its recorded size and hash:
    an added rank file (vLLM would read it by its name), an edited config.json or
    tokenizer, a link, are refused."""
    listed = {f["name"]: f for f in index["carried"]}
    for name in listed:  # plain names, and never a rank file (vLLM loads those by name)
        if (not isinstance(name, str) or name in ("", ".", "..", INDEX) or "/" in name
                or name.endswith(".safetensors")):  # fmt: skip
            raise StreamCorruptError(
                f"{d / INDEX}: carried file {name!r} is not a plain, non-weight file name; "
                f"rewrite OUT."
            )
    names = {f["name"] for f in index["files"]} | set(listed) | {INDEX}
    for e in os.scandir(d):
        if e.name not in names and e.name not in REPORTS:
            raise StreamCorruptError(
                f"{d / e.name}: is not listed in {INDEX} (vLLM's loader would read a rank "
                f"file by its name, and the model's files are bound by the index); remove "
                f"it, or rewrite OUT."
            )
        if not stat.S_ISREG(os.lstat(e.path).st_mode):
            raise StreamCorruptError(f"{d / e.name}: is not a regular file; rewrite OUT.")
    for name, f in listed.items():
        _as_written(d / name, f)


def _as_written(p: Path, f: dict) -> None:
    """File ``p`` has the size and hash its index entry ``f`` records."""
    if not p.is_file():
        raise StreamCorruptError(f"{p}: missing (listed in {INDEX}); rewrite OUT.")
    if p.stat().st_size != f["bytes"] or file_digest(p, HASH) != f["hash"]:
        raise StreamCorruptError(
            f"{p}: size or {HASH} hash differs from the file written ({INDEX} records "
            f"both); restore it, or rewrite OUT."
        )


def _check_files(d: Path, index: dict) -> str:
    from safetensors import safe_open

    lay = index["layout"]
    tp, pp = lay["tp"], lay["pp"]
    names = [f["name"] for f in index["files"]]
    want = {Rank(t, p, tp, pp).file() for p in range(pp) for t in range(tp)}
    if len(names) != tp * pp or sorted(names) != sorted(want):
        raise StreamCorruptError(
            f"{d / INDEX}: lists {len(names)} rank file(s), not the {tp * pp} of tp {tp} x "
            f"pp {pp}; rewrite OUT."
        )
    check_listed(d, index)
    n = 0
    for f in index["files"]:
        p = d / f["name"]
        _as_written(p, f)
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

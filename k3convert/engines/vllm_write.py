"""Writing a vLLM sharded_state directory (``shard --target vllm``): the rank files from
:func:`~.vllm_sharded.rank_params`, the carried files and the index, through the engine-
neutral writer (:mod:`.rank_files`: an owned, locked, resumable stage next to OUT).

What the index binds (``k3convert-vllm.json``, version 3, written last): every rank file
(size, xxh3-128, tensor table), every carried file (config.json, tokenizer, processor:
size and xxh3-128), the source it was written from (the content fingerprint of its
weight files and config.json), and itself (``index_hash``). ``shard --check``,
``verify`` and ``forward`` refuse a directory holding anything unlisted or changed
(:mod:`.vllm_index`).
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import __version__
from ..arch import resolve
from ..checkpoint import Checkpoint, open_checkpoint
from ..errors import ConfigError
from ..parallel import procs
from ..parallel.procs import ProcessGroup
from ..shard.writer import carried_files
from .rank_files import EngineFiles, RankFilesResult, write_rank_files
from .vllm_layers import RANK_FILE_RX, Rank
from .vllm_sharded import (
    DESCRIBED,
    FORMAT,
    HASH,
    INDEX,
    INDEX_VERSION,
    JOURNAL,
    MAX_WORLD,
    VLLM_VERSION,
    dtype_of,
    rank_planner,
)

STAGE = "vllm-partial"  # the stage ``.OUT.vllm-partial``, kept after an interruption
#: the vLLM target's files, as the engine-neutral writer needs them
VLLM_FILES = EngineFiles(
    engine="vLLM", label="vllm", stage=STAGE, index=INDEX, journal=JOURNAL, hash=HASH,
    rank_file=RANK_FILE_RX, resume_key=("generator", "vllm", "layout", "source", "identity"),
)  # fmt: skip


def check_layout(ck: Checkpoint, tp: int, pp: int, ep: int) -> None:
    """The layout's numbers, against vLLM's rules and the model, before anything is
    built: positive integers, at most :data:`MAX_WORLD` ranks, tp dividing the attention
    heads, pp at most the layers, ep 1 or tp."""
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--{name} must be a positive integer, got {v!r}.")
    if tp * pp > MAX_WORLD:
        raise ConfigError(
            f"--tp {tp} x --pp {pp} is {tp * pp} ranks, more than the {MAX_WORLD} a layout "
            f"may have; pick the layout of the cluster that will serve it."
        )
    if ep not in (1, tp):
        raise ConfigError(
            f"--ep {ep}: vLLM's enable_expert_parallel spreads the experts over all {tp} tp "
            f"ranks, and its sharded_state files are named by tp / pp rank only (data-"
            f"parallel replicas would read the same file); use --ep {tp} or --ep 1."
        )
    _, cfg = resolve(ck.config, str(ck.root / "config.json"))
    text = getattr(cfg, "text", cfg)
    heads, layers = text.num_heads, text.num_layers
    if tp > heads or heads % tp:
        raise ConfigError(
            f"--tp {tp}: vLLM splits the {heads} attention heads over the tp ranks, so tp "
            f"must divide {heads}; pick one of "
            f"{', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)}."
        )
    if pp > layers:
        raise ConfigError(
            f"--pp {pp}: more pipeline stages than the model's {layers} layers; use at most "
            f"--pp {layers}."
        )


def shard_target(src, out, *, tp: int, pp: int, ep: int, force: bool, progress: bool,
                 before_write=None) -> str:  # fmt: skip
    """``shard --target vllm`` (:data:`k3convert.targets.TARGETS`): the write
    (``before_write(ck)``: the serving check, before the first byte) and the line that
    says what was written and how vLLM loads it."""
    from .vllm_index import llm_call

    res = write_vllm(src=src, out=out, tp=tp, pp=pp, ep=ep, force=force, progress=progress,
                     before_write=before_write, group=procs.current())  # fmt: skip
    kept = f" ({res.files_resumed} kept from the interrupted run)" if res.files_resumed else ""
    return (
        f"wrote {res.out}: vLLM sharded_state, {res.files} rank file(s){kept}, "
        f"{res.bytes_written / 2**20:.1f} MiB in {res.seconds:.1f} s; load it with "
        + llm_call(res.out)
    )


def write_vllm(
    *, src: str | os.PathLike | Checkpoint, out: str | os.PathLike, tp: int = 1, pp: int = 1,
    ep: int = 1, force: bool = False, progress: bool = False, before_write=None,
    origin: Checkpoint | None = None, identity=None, carry=None, described: bytes | None = None,
    group: ProcessGroup | None = None,
) -> RankFilesResult:  # fmt: skip
    """Write the sharded_state directory: one safetensors file per rank, then the config /
    tokenizer files and ``k3convert-vllm.json``, in a stage directory next to OUT renamed
    to OUT at the end (:class:`~..checkpoint.output.OwnedStage`: owned, locked, lstat-
    checked). An interrupted run leaves the stage; a rerun keeps every rank file it finds
    complete (its journal entry and hash match, and the source's content fingerprint is
    unchanged) and writes the rest. Every refusal (layout, source, scheme) happens
    before a byte is written; a non-finite value met while writing removes the stage.

    before_write: called with the validated source checkpoint before a byte is written
    (the caller's serving check, :func:`k3convert.serving.vllm_check`: it warns, or
    raises and nothing is written).

    ``src`` may be an open checkpoint whose tensors are produced as they are read
    (``convert``'s :class:`~k3convert.pipeline.planned.PlannedCheckpoint`: one pass, no
    quantized checkpoint on disk). Then ``origin`` is the checkpoint on disk it is made
    from (fingerprinted, named as the index's source), ``identity`` what else the bytes
    depend on (a resumed rank file must have been written under the same), ``carry``
    the non-weight files as ``(name, path or bytes)``, and ``described`` its tensor list
    (:meth:`~k3convert.pipeline.planned.PlannedCheckpoint.layout_doc`, zstd JSON),
    carried as :data:`DESCRIBED` for ``verify`` to map the rank files back.

    ``group``: the torchrun job (default: this process alone). The rank files are split
    over the processes by bytes (:func:`~k3convert.parallel.procs.balance`), each written
    by one; process 0 takes the stage and commits it. The bytes are those of one
    process. A tensor several ranks read is produced by each process holding one of
    them (EP places each routed expert on one rank)."""
    ck = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    origin = ck if origin is None else origin
    check_layout(ck, tp, pp, ep)
    ranks = [Rank(t, p, tp, pp, ep > 1) for p in range(pp) for t in range(tp)]
    params_of = rank_planner(ck, ranks)
    carried = list(carried_files(ck) if carry is None else carry)
    if described is not None:
        carried.append((DESCRIBED, described))
    index = {"format": FORMAT, "version": INDEX_VERSION, "generator": f"k3convert {__version__}",
             "vllm": VLLM_VERSION, "model_type": ck.config.get("model_type"),
             "dtype": str(dtype_of(ck)).removeprefix("torch."),
             "layout": {"tp": tp, "pp": pp, "ep": ep},
             "source": str(Path(origin.root).resolve()),
             "source_files": [], "carried": [], "files": []}  # fmt: skip
    if identity is not None:
        index["identity"] = identity
    if described is not None:
        index["described"] = DESCRIBED
    return write_rank_files(
        VLLM_FILES,
        ck=ck,
        origin=origin,
        out=out,
        ranks=ranks,
        params_of=params_of,
        index=index,
        carried=carried,
        force=force,
        progress=progress,
        before_write=before_write,
        group=group,
    )

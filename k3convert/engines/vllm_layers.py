"""vLLM's layer conventions, shared by every family the vLLM target writes: rank file
names, pipeline-stage placement (``get_pp_indices``), merged column-parallel parameters
(``qkv_proj``, ``gate_up_proj``: members in order, per-member global scales, whole FP8
blocks), row-parallel inputs, the padded vocabulary, the attention layer's own scales.
Each states the vLLM 0.32 rule it follows; the family modules compose them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..checkpoint import Checkpoint
from ..errors import ConfigError
from .params import ALL, Param, Piece, Slicer, module_parts, origin

TP_PATTERN = "model-rank-{tp}-part-{part}.safetensors"
PP_PATTERN = "model-pp-{pp}-tp-{tp}-part-{part}.safetensors"
#: any name either pattern gives (a rank file of some layout)
RANK_FILE_RX = re.compile(
    "|".join(re.sub(r"\\\{\w+\\\}", r"\\d+", re.escape(p)) for p in (TP_PATTERN, PP_PATTERN))
)
#: vLLM's merged column-parallel parameters (QKVParallelLinear /
#: MergedColumnParallelLinear) and their members, in the order their rows are stacked.
#: The one statement of which Linears vLLM runs as one GEMM: the writer stacks them, and
#: ``serving.check_plan`` / ``quant.writer`` require one scheme (one NVFP4 global scale)
#: across each set
MERGED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
#: every set of sibling Linears a serving engine runs as one GEMM: vLLM's merged
#: parameters and Mixtral's experts' w1 / w3 (llm-compressor's FUSED_LAYER_NAMES)
FUSED_SETS = (*MERGED.values(), ("w1", "w3"))
#: vLLM's VocabParallelEmbedding / ParallelLMHead pad the vocabulary to a multiple of this
VOCAB_PADDING = 64
#: per-tensor parts a merged (qkv / gate_up) parameter holds once per member (with a
#: tensor-wise weight's ``weight_scale``): NVFP4's global scales, a static FP8 input scale
PER_MEMBER = ("weight_global_scale", "input_global_scale", "input_scale")


@dataclass(frozen=True)
class Rank:
    tp: int
    pp: int
    tp_size: int
    pp_size: int
    ep: bool = False  # vLLM's enable_expert_parallel: EP over the tp ranks

    def file(self, part: int = 0) -> str:
        if self.pp_size > 1:
            return PP_PATTERN.format(pp=self.pp, tp=self.tp, part=part)
        return TP_PATTERN.format(tp=self.tp, part=part)


def pp_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The layers vLLM 0.32 puts on pipeline stage ``pp_rank`` (``get_pp_indices``, with
    no ``VLLM_PP_LAYER_PARTITION``): even blocks, the remainder on the stages before the
    last, from the second-to-last backwards."""
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    start = sum(parts[:pp_rank])
    return range(start, start + parts[pp_rank])


def swiglu(src: Slicer, rank: Rank, module: str, out: str) -> Iterator[Param]:
    """A dense SwiGLU MLP at ``module``, as vLLM's ``gate_up_proj`` / ``down_proj`` under
    ``out``: the rank's rows of gate then up, its input columns of down (as the roles
    split them)."""
    spans = {m: src.span(f"{module}.{m}.weight", rank.tp, rank.tp_size)
             for m in MERGED["gate_up_proj"]}  # fmt: skip
    for p in fused(src, module, "gate_up_proj", spans):
        p.name = p.name.replace(module, out, 1)
        yield p
    a, b, full = src.span(f"{module}.down_proj.weight", rank.tp, rank.tp_size)
    for p in row(src, f"{module}.down_proj", a, b - a, full):
        p.name = p.name.replace(module, out, 1)
        yield p


def vocab_rows(src: Slicer, rank: Rank, name: str, out_name: str) -> Param:
    """This rank's rows of the vocabulary padded to a multiple of 64 (zero past the end)."""
    vocab, tp = src.cfg.vocab_size, rank.tp_size
    padded = math.ceil(vocab / VOCAB_PADDING) * VOCAB_PADDING
    if padded % tp:
        raise ConfigError(
            f"tp={tp} does not divide the vocabulary padded to {padded} rows (vLLM pads "
            f"{vocab} to a multiple of {VOCAB_PADDING} and gives each rank an equal share)."
        )
    per = padded // tp
    lo, hi = rank.tp * per, (rank.tp + 1) * per
    meta = src.ck.meta(name)
    if meta.encoding != "plain":
        raise ConfigError(f"'{name}' is {meta.encoding}-encoded; vLLM's vocab-parallel "
                          f"layers are written from plain weights only for now.")  # fmt: skip

    real = max(0, min(hi, vocab) - lo)

    def rows():  # the real rows (a mapped view), then the zero padding
        if real:
            yield src.ck.get(name)[lo : lo + real].to(src.dtype)
        if per - real:
            yield torch.zeros(per - real, meta.shape[1], dtype=src.dtype)

    piece = Piece(name, None, (slice(lo, lo + real),), (slice(0, real),))
    shape = (per, meta.shape[1])
    if not real:  # all padding: a constant, as verify checks it
        return Param(out_name, src.dtype, shape, lambda: torch.zeros(shape, dtype=src.dtype))
    return Param(out_name, src.dtype, shape, None, rows, pieces=(piece,))


def attention_scales(
    prefix: str, dtype: torch.dtype, quantized: bool, ck: Checkpoint | None = None,
    layer: str = "",
) -> Iterator[Param]:  # fmt: skip
    """The attention layer's own parameters: its unit scales, and under compressed-tensors
    (whose KV-cache method vLLM attaches to every attention layer) its q / k / v scales
    and zero zero points: the checkpoint's calibrated ``self_attn.k_scale`` / ``v_scale``
    (/ ``q_scale``) where it has them (a ``kv_cache_scheme``), else 1.0 as vLLM creates
    them. The same on every rank."""

    def const(value: float, dt: torch.dtype, shape: tuple[int, ...]):
        return lambda: torch.full(shape, value, dtype=dt)

    for s in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
        yield Param(f"{prefix}.{s}", torch.float32, (), const(1.0, torch.float32, ()))
    if quantized:
        for s in ("k", "q", "v"):
            stored = f"{layer}.self_attn.{s}_scale"
            if ck is not None and stored in ck:
                meta = ck.meta(stored)
                if meta.shape not in ((1,), ()) or meta.dtype != torch.float32:
                    raise ConfigError(
                        f"'{stored}' is {meta.dtype} {tuple(meta.shape)}: vLLM loads one "
                        f"float32 KV-cache scale per layer."
                    )
                yield Param(f"{prefix}.{s}_scale", torch.float32, (1,),
                            lambda n=stored: ck.get(n).reshape(1),
                            pieces=(Piece(stored, None, ALL, ALL),))  # fmt: skip
            else:
                yield Param(f"{prefix}.{s}_scale", torch.float32, (1,),
                            const(1.0, torch.float32, (1,)))  # fmt: skip
            yield Param(f"{prefix}.{s}_zero_point", dtype, (1,), const(0.0, dtype, (1,)))


def fused(src: Slicer, prefix: str, merged: str, spans: dict) -> Iterator[Param]:
    """vLLM's merged column-parallel parameter: each part of the members' rows for this
    rank, concatenated in member order (q, k, v / gate, up)."""
    members = list(spans)
    first = module_parts(src.ck, f"{prefix}.{members[0]}")
    parts = list(first)
    for m in members[1:]:
        this = module_parts(src.ck, f"{prefix}.{m}")
        if list(this) != parts or any(this[k][1] != first[k][1] for k in parts):
            raise ConfigError(
                f"{prefix}: {members[0]} and {m} are stored differently; vLLM fuses them into "
                f"one {merged} and needs one scheme for both."
            )
    strategy = src.ck.meta(f"{prefix}.{members[0]}.weight").quant
    per_tensor = strategy is not None and strategy.extra.get("strategy") == "tensor"
    if strategy is not None and strategy.extra.get("strategy") == "block":
        _whole_blocks(prefix, spans, strategy.block[0])
    for part in parts:
        name = f"{prefix}.{merged}.{part}"
        if part == "weight_shape":  # vLLM keeps the last member it loaded, whole
            last = last_loaded(src.ck, [f"{prefix}.{m}" for m in members], part)
            shape, dtype, make, _ = src.column(last, part, 0, 0, 1)
            yield Param(name, dtype, shape, make, pieces=(Piece(*origin(last, part), ALL, ALL),))
            continue
        if part in PER_MEMBER or (part == "weight_scale" and per_tensor):
            # one global / per-tensor scale per member: vLLM's [n_members] vector
            yield _per_member(src, prefix, merged, members, part)
            continue
        got = [src.column(f"{prefix}.{m}", part, a, b, full) for m, (a, b, full) in spans.items()]
        if any(len(g[0]) == 0 for g in got):
            raise ConfigError(f"{prefix}: a per-tensor '{part}' in {merged} is not written yet.")
        shape = (sum(g[0][0] for g in got), *got[0][0][1:])
        pieces, at = [], 0
        for m, (n, *_), rows in ((m, g[0], g[3]) for m, g in zip(members, got, strict=True)):
            pieces.append(Piece(*origin(f"{prefix}.{m}", part), (rows,), (slice(at, at + n),)))
            at += n

        def by_member(got=got):  # written member by member: row slices are mapped views
            for g in got:
                yield g[2]()

        yield Param(name, got[0][1], shape, None, by_member, pieces=tuple(pieces))


def last_loaded(ck: Checkpoint, modules: list[str], part: str) -> str:
    """Which of ``modules`` vLLM's loader reads ``part`` of last (a merged parameter that
    keeps one value for all, as a fused int4 layer's ``weight_shape``): files in natural
    order (``_natural_sort_key``: model-2 before model-10), each file's tensors by name."""

    def order(module: str) -> tuple:
        pm = ck.meta(f"{module}.weight").parts[part]
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", pm.file.name)], pm.name

    return max(modules, key=order)


def whole_fp8_blocks(index: int, members: int, split: bool, expert: bool = False) -> bool:
    """Whether member ``index`` of ``members`` (1: an unmerged Linear) must hold whole FP8
    blocks of output rows on each rank, by vLLM 0.32's ``validate_fp8_block_shape``
    (``_moe`` for experts): every member of a layer split over tp; in a merged layer
    that is not split, every member but the last (which may end in a partial block),
    and every member of a merged expert (gate / up in ``w13``). The writer and
    ``serving.check_plan`` both ask this."""
    return split or (members > 1 and (expert or index < members - 1))


def _whole_blocks(prefix: str, spans: dict, block: int) -> None:
    """vLLM's ``validate_fp8_block_shape`` for a merged FP8-block layer: each member's rows
    on a rank are whole blocks where :func:`whole_fp8_blocks` says so."""
    split = any(b - a < full for a, b, full in spans.values())
    for i, (m, (a, b, _)) in enumerate(spans.items()):
        if whole_fp8_blocks(i, len(spans), split) and (b - a) % block:
            raise ConfigError(
                f"{prefix}.{m}: {b - a} rows per rank are not whole FP8 blocks of {block}, "
                f"and vLLM refuses them in its merged layer; re-quantize with a scheme "
                f"without blocks (fp8-dynamic), or keep {prefix}'s projections unquantized."
            )


def _per_member(src: Slicer, prefix: str, merged: str, members: list[str], part: str) -> Param:
    """A merged parameter's per-tensor part (NVFP4's global scales, a tensor-wise FP8
    weight's scale): vLLM's ``PerTensorScaleParameter`` holds one value per member, in
    member order."""
    modules = [f"{prefix}.{m}" for m in members]
    for m in modules:
        shape, _ = module_parts(src.ck, m)[part]
        if tuple(shape) != (1,):
            raise ConfigError(f"{m}.{part}: shape {tuple(shape)}, expected one value.")
    dtype = module_parts(src.ck, modules[0])[part][1]

    def make():
        return torch.cat([src.ck.part_tensor(f"{m}.weight", part).reshape(1) for m in modules])

    pieces = tuple(
        Piece(f"{m}.weight", part, ALL, (slice(j, j + 1),)) for j, m in enumerate(modules)
    )
    return Param(f"{prefix}.{merged}.{part}", dtype, (len(modules),), make, pieces=pieces)


def input_slice_problem(width: int, strategy: str | None, granule: int | None) -> str | None:
    """vLLM 0.32's rules for a rank's slice of ``width`` input columns of a row-parallel
    Linear: an int group size divides it (``verify_group_size_divides_partition``), and
    so does an FP8 block's width (``validate_fp8_block_shape``'s block_k) - stricter than
    a cut on group / block boundaries only where one group or block spans the whole
    input. The writer (:func:`row`, the routed experts' ``w2``) and
    ``serving.check_plan`` both ask this."""
    if not granule or not width % granule or strategy not in ("group", "block"):
        return None
    if strategy == "group":
        return (
            f"its input slice {width} is not a multiple of the group size {granule} "
            f"(vLLM: group size must divide the partition)"
        )
    return (
        f"its input slice {width} is not a multiple of the block's {granule} columns "
        f"(vLLM: input_size_per_partition not divisible by block_k)"
    )


def input_granule(ck: Checkpoint, module: str) -> tuple[str | None, int | None]:
    """(strategy, columns per group / block) of a Linear stored with group or block
    scales: what :func:`input_slice_problem` takes; (strategy, None) otherwise."""
    q = ck.meta(f"{module}.weight").quant
    strategy = q.extra.get("strategy") if q is not None else None
    if strategy in ("group", "block") and q.block:
        return strategy, q.block[1]
    return strategy, None


def row(src: Slicer, module: str, a: int, n: int, full: int) -> Iterator[Param]:
    """A row-parallel Linear: every stored part's share of input columns [a, a + n)."""
    why = input_slice_problem(n, *input_granule(src.ck, module)) if n < full else None
    if why:
        raise ConfigError(
            f"{module}: {why}; pick a tp whose slice it divides, or re-quantize with "
            f"smaller groups / blocks."
        )
    for part in module_parts(src.ck, module):
        yield src.row(module, part, a, a + n, full)

"""``shard --target vllm``: vLLM's pre-sharded ("sharded_state") files, written offline.

vLLM's ``ShardedStateLoader`` (``load_format="sharded_state"``) skips the checkpoint
loader: each rank opens ``model-rank-{tp}-part-{n}.safetensors`` (pp 1) or
``model-pp-{pp}-tp-{tp}-part-{n}.safetensors`` and copies every tensor into the parameter
of the same name in its ``model.state_dict()`` - the parameters as the model class and
the quantization method's ``create_weights`` made them, before
``process_weights_after_loading`` repacks them for the kernels - and fails on a missing
key. This module writes those files from a Hugging Face / compressed-tensors checkpoint,
on CPU, one parameter at a time: vLLM's fused projections (``qkv_proj`` = the rank's q, k
and v heads; ``gate_up_proj`` = its gate and up rows), the vocab-parallel embedding and
lm_head padded to a multiple of 64 rows, the row-parallel inputs split, the attention's
unit scales, every quantization part sliced the way vLLM's weight loaders slice it.

Checked against vLLM 0.32 itself (``tests/test_vllm.py``): the files equal, bit for bit,
what vLLM's own loader holds on each rank after reading the HF checkpoint, and
``LLM(load_format="sharded_state")`` gives the same prompt logprobs. The layouts are
vLLM's internals, not a public format: see ``docs/vllm-target.md`` for what to do when
vLLM changes them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..arch import resolve, validate_source
from ..checkpoint import Checkpoint
from ..checkpoint.output import STREAM_JOURNAL
from ..errors import ConfigError

#: the vLLM release whose layouts this writes (tests/test_vllm.py checks against it)
VLLM_VERSION = "0.32.0"
TP_PATTERN = "model-rank-{tp}-part-{part}.safetensors"
PP_PATTERN = "model-pp-{pp}-tp-{tp}-part-{part}.safetensors"
#: written last: a directory without it (or with another format in it) is not complete
INDEX = "k3convert-vllm.json"
FORMAT = "k3convert-vllm-sharded-state"
#: 2: the index binds the directory (carried files hashed, the source fingerprinted)
INDEX_VERSION = 2
HASH = "xxh3-128"  # each rank file's, as ``ALGO:HEX`` (stream.hashing)
JOURNAL = STREAM_JOURNAL  # in the stage: one entry per finished rank file
#: vLLM's VocabParallelEmbedding / ParallelLMHead pad the vocabulary to a multiple of this
VOCAB_PADDING = 64
#: families whose vLLM model class this writes (model_type -> vLLM class)
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "kimi_k3": "KimiK3ForConditionalGeneration",
}
#: families whose vLLM model builds the embedding, the final norm and lm_head on every
#: pipeline stage (Qwen3MoeModel: no PPMissingLayer for them), not first / last only
EVERY_STAGE = frozenset({"qwen3_moe"})
#: compressed-tensors formats whose vLLM parameters this writes
FORMATS = (
    "dense",
    "int-quantized",
    "pack-quantized",
    "float-quantized",
    "naive-quantized",
    "nvfp4-pack-quantized",
)
#: per-tensor parts a merged (qkv / gate_up) parameter holds once per member (with a
#: tensor-wise weight's ``weight_scale``): NVFP4's global scales, a static FP8 input scale
PER_MEMBER = ("weight_global_scale", "input_global_scale", "input_scale")
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


def _module_parts(ck: Checkpoint, module: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """part -> (shape, dtype) of a Linear's stored parts (weight, scales, bias)."""
    m = ck.meta(f"{module}.weight")
    parts = {k: (p.shape, p.dtype) for k, p in m.parts.items()}
    bias = f"{module}.bias"
    if bias in ck:
        b = ck.meta(bias).main
        parts["bias"] = (b.shape, b.dtype)
    return parts


def _scaled(size: int, full: int, a: int, b: int, what: str) -> tuple[int, int]:
    """[a, b) of a dim of ``full`` mapped onto a part's dim of ``size`` (packed 8 per
    int32, groups of g, ...); refused when a boundary falls inside a pack or group."""
    lo, hi = a * size, b * size
    if lo % full or hi % full:
        raise ConfigError(
            f"{what}: a tensor-parallel boundary at {a if lo % full else b} of {full} falls "
            f"inside a packed word or a quantization group ({size} per {full}); pick a tp "
            f"that divides it, or re-quantize with smaller groups."
        )
    return lo // full, hi // full


def _origin(module: str, part: str) -> tuple[str, str | None]:
    """(checkpoint tensor, part) of a Linear's stored part: a bias is its own tensor."""
    return (f"{module}.bias", None) if part == "bias" else (f"{module}.weight", part)


class _Source:
    """The checkpoint's tensors sliced as one rank of vLLM needs them."""

    def __init__(self, ck: Checkpoint, cfg, dtype: torch.dtype):
        self.ck, self.cfg, self.dtype = ck, cfg, dtype

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
        if part == "weight_shape" or not shape:  # (a 0-d part: refused by _fused)
            return shape, dtype, lambda: self.ck.get_parts(f"{module}.weight")[part], None
        lo, hi = _scaled(shape[0], out, a, b, f"{module}.{part}")
        new = (hi - lo, *shape[1:])

        def make():
            t = self._part(module, part)
            return t[lo:hi]

        return new, dtype, make, slice(lo, hi)

    def row(self, module: str, part: str, a: int, b: int, inp: int) -> Param:
        """Columns [a, b) of ``inp`` (input features) of one part."""
        shape, dtype = self._stored(module, part)
        grouped = self.ck.meta(f"{module}.weight").quant.extra.get("strategy") == "group"
        name = f"{module}.{part}"
        whole = Piece(*_origin(module, part), ALL, ALL)
        if part in ("bias", "weight_shape") or len(shape) < 2 or (shape[1] == 1 and not grouped):
            # the same on every rank: vLLM's row-parallel bias (added once) and per-channel
            # scales are whole on each; a group scale is split with its groups
            return Param(name, dtype, shape, lambda: self._part(module, part), pieces=(whole,))
        lo, hi = _scaled(shape[1], inp, a, b, name)

        def chunks():  # a few MiB of rows at a time: no copy of the whole slice
            t = self._part(module, part)
            step = max(1, CHUNK_BYTES // max(1, t[:1, lo:hi].numel() * t.element_size()))
            for i in range(0, t.shape[0], step):
                yield t[i : i + step, lo:hi]

        cols = Piece(whole.name, whole.part, (slice(None), slice(lo, hi)), ALL)
        shape = (shape[0], hi - lo, *shape[2:])
        return Param(name, dtype, shape, None, chunks, pieces=(cols,))

    def _stored(self, module: str, part: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of a Linear's part as written: :meth:`_part`'s dtype (an
        unquantized weight in the model dtype, whatever the file stores it in)."""
        shape, dtype = _module_parts(self.ck, module)[part]
        if part != "bias" and self.ck.meta(f"{module}.weight").encoding == "plain":
            dtype = self.dtype
        return shape, dtype

    def _part(self, module: str, part: str) -> torch.Tensor:
        if part == "bias":
            return self.ck.get(f"{module}.bias")
        meta = self.ck.meta(f"{module}.weight")
        t = self.ck.get_parts(f"{module}.weight")[part]
        # an unquantized weight takes the model dtype; a stored code (int8, fp8) stays
        return t.to(self.dtype) if meta.encoding == "plain" else t


def _moe_layer(cfg, i: int) -> bool:
    """Whether layer ``i`` is sparse, by vLLM's rule for the family: Qwen3-MoE's
    ``mlp_only_layers`` / ``decoder_sparse_step``; DeepSeek-V3's ``first_k_dense_replace``
    / ``moe_layer_freq``."""
    n = getattr(cfg, "num_experts", 0) or 0
    if hasattr(cfg, "first_k_dense_replace"):
        return n > 0 and i >= cfg.first_k_dense_replace and i % (cfg.moe_layer_freq or 1) == 0
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return n > 0 and i not in (getattr(cfg, "mlp_only_layers", ()) or ()) and (i + 1) % step == 0


def _decoder_params(src: _Source, rank: Rank) -> Iterator[Param]:
    """Every family here: the embedding, per layer its norms, attention (GQA or MLA) and
    MLP (dense SwiGLU or FusedMoE), the final norm and lm_head."""
    cfg = src.cfg
    mla = hasattr(cfg, "kv_lora_rank")
    layers = pp_layers(cfg.num_layers, rank.pp, rank.pp_size)  # (MTP layers: not loaded)
    first, last = rank.pp == 0, rank.pp == rank.pp_size - 1
    if src.ck.config.get("model_type") in EVERY_STAGE:
        first = last = True
    if cfg.tie_word_embeddings and rank.pp_size > 1:
        raise ConfigError("a tied lm_head with pp > 1 is not written yet; use pp 1.")
    if first and not cfg.tie_word_embeddings:
        yield _vocab_rows(src, rank, "model.embed_tokens.weight", "model.embed_tokens.weight")
    for i in layers:
        pre = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield src.whole(f"{pre}.{norm}.weight", src.dtype)
        yield from (_mla_attention if mla else _gqa_attention)(src, rank, pre)
        if _moe_layer(cfg, i):
            from .vllm_moe import fused_moe

            yield from fused_moe(src, rank, f"{pre}.mlp")
        else:
            yield from _swiglu(src, rank, f"{pre}.mlp", f"{pre}.mlp", cfg.intermediate_size)
    if last:
        yield src.whole("model.norm.weight", src.dtype)
        # tied: one tensor, which vLLM's state dict names lm_head.weight (the smaller key)
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        yield _vocab_rows(src, rank, head, "lm_head.weight")


def _gqa_attention(src: _Source, rank: Rank, pre: str) -> Iterator[Param]:
    """llama / qwen3: ``qkv_proj`` (the rank's q heads, then its KV heads of k and v),
    ``o_proj`` split by input columns, q / k norms whole, the attention's scales."""
    cfg, tp = src.cfg, rank.tp_size
    heads, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if heads % tp or (kv % tp and tp % kv):
        raise ConfigError(
            f"tp={tp} must divide the {heads} attention heads and divide or be a multiple of "
            f"the {kv} KV heads (vLLM replicates KV heads when tp > {kv})."
        )
    q_out, kv_out = heads * hd, kv * hd
    q_per, kv_heads_rank = heads // tp, max(1, kv // tp)
    kv_first = rank.tp * kv // tp * hd  # (tp > kv: tp / kv ranks share each KV head)
    if cfg.qk_norm:
        for n in ("q_norm", "k_norm"):
            yield src.whole(f"{pre}.self_attn.{n}.weight", src.dtype)
    spans = {
        "q_proj": (rank.tp * q_per * hd, (rank.tp + 1) * q_per * hd, q_out),
        "k_proj": (kv_first, kv_first + kv_heads_rank * hd, kv_out),
        "v_proj": (kv_first, kv_first + kv_heads_rank * hd, kv_out),
    }
    yield from _fused(src, f"{pre}.self_attn", "qkv_proj", spans)
    yield from _row(src, f"{pre}.self_attn.o_proj", rank.tp * q_per * hd, q_per * hd, q_out)
    quantized = src.ck.config.get("quantization_config") is not None
    yield from _attention_scales(f"{pre}.self_attn.attn", src.dtype, quantized, src.ck, pre)


def _mla_attention(src: _Source, rank: Rank, pre: str) -> Iterator[Param]:
    """DeepSeek-V3 / Kimi-K2 MLA: ``fused_qkv_a_proj`` (q_a_proj then kv_a_proj_with_mqa,
    replicated), the latent norms whole, ``q_b_proj`` / ``kv_b_proj`` split by heads,
    ``o_proj`` by input columns. vLLM's MLA module holds several of the attention's
    submodules a second time; each is written under the name its state dict keeps (the
    smaller)."""
    cfg, tp = src.cfg, rank.tp_size
    heads = cfg.num_heads
    if heads % tp:
        raise ConfigError(f"tp={tp} must divide the {heads} attention heads.")
    if not cfg.q_lora_rank:
        raise ConfigError("MLA without a q LoRA rank (q_proj) is not written for vLLM yet.")
    at = f"{pre}.self_attn"

    def named(sub: str) -> str:  # the state dict's name: the smaller of the two
        return min(f"{at}.{sub}", f"{at}.mla_attn.{sub}")

    h0, hn = rank.tp * heads // tp, (rank.tp + 1) * heads // tp
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    nv = cfg.qk_nope_head_dim + cfg.v_head_dim
    q_a, kv_a = cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    spans = {"q_a_proj": (0, q_a, q_a), "kv_a_proj_with_mqa": (0, kv_a, kv_a)}
    for p in _fused(src, at, "fused_qkv_a_proj", spans):
        p.name = named(p.name.removeprefix(f"{at}."))
        yield p
    for norm in ("q_a_layernorm", "kv_a_layernorm"):
        p = src.whole(f"{at}.{norm}.weight", src.dtype)
        p.name = named(f"{norm}.weight")
        yield p
    for proj, per in (("q_b_proj", qk), ("kv_b_proj", nv)):
        for p in _fused(src, at, proj, {proj: (h0 * per, hn * per, heads * per)}):
            p.name = named(p.name.removeprefix(f"{at}."))
            yield p
    v = cfg.v_head_dim
    for p in _row(src, f"{at}.o_proj", h0 * v, (hn - h0) * v, heads * v):
        p.name = named(p.name.removeprefix(f"{at}."))
        yield p
    yield from _attention_scales(f"{at}.mla_attn.mla_attn", src.dtype, False)


def _swiglu(src: _Source, rank: Rank, module: str, out: str, inter: int) -> Iterator[Param]:
    """A dense SwiGLU MLP at ``module``, as vLLM's ``gate_up_proj`` / ``down_proj`` under
    ``out``: the rank's rows of gate then up, its input columns of down."""
    tp = rank.tp_size
    if inter % tp:
        raise ConfigError(f"tp={tp} does not divide the MLP width {inter} ({module}).")
    ip = inter // tp
    rows = (rank.tp * ip, (rank.tp + 1) * ip, inter)
    for p in _fused(src, module, "gate_up_proj", {"gate_proj": rows, "up_proj": rows}):
        p.name = p.name.replace(module, out, 1)
        yield p
    for p in _row(src, f"{module}.down_proj", rank.tp * ip, ip, inter):
        p.name = p.name.replace(module, out, 1)
        yield p


def _vocab_rows(src: _Source, rank: Rank, name: str, out_name: str) -> Param:
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


def _attention_scales(
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


def _fused(src: _Source, prefix: str, fused: str, spans: dict) -> Iterator[Param]:
    """vLLM's merged column-parallel parameter: each part of the members' rows for this
    rank, concatenated in member order (q, k, v / gate, up)."""
    members = list(spans)
    first = _module_parts(src.ck, f"{prefix}.{members[0]}")
    parts = list(first)
    for m in members[1:]:
        this = _module_parts(src.ck, f"{prefix}.{m}")
        if list(this) != parts or any(this[k][1] != first[k][1] for k in parts):
            raise ConfigError(
                f"{prefix}: {members[0]} and {m} are stored differently; vLLM fuses them into "
                f"one {fused} and needs one scheme for both."
            )
    strategy = src.ck.meta(f"{prefix}.{members[0]}.weight").quant
    per_tensor = strategy is not None and strategy.extra.get("strategy") == "tensor"
    if strategy is not None and strategy.extra.get("strategy") == "block":
        _whole_blocks(prefix, spans, strategy.block[0])
    for part in parts:
        name = f"{prefix}.{fused}.{part}"
        if part == "weight_shape":  # vLLM keeps the last member it loaded, whole
            last = last_loaded(src.ck, [f"{prefix}.{m}" for m in members], part)
            shape, dtype, make, _ = src.column(last, part, 0, 0, 1)
            yield Param(name, dtype, shape, make, pieces=(Piece(*_origin(last, part), ALL, ALL),))
            continue
        if part in PER_MEMBER or (part == "weight_scale" and per_tensor):
            # one global / per-tensor scale per member: vLLM's [n_members] vector
            yield _per_member(src, prefix, fused, members, part)
            continue
        got = [src.column(f"{prefix}.{m}", part, a, b, full) for m, (a, b, full) in spans.items()]
        if any(len(g[0]) == 0 for g in got):
            raise ConfigError(f"{prefix}: a per-tensor '{part}' in {fused} is not written yet.")
        shape = (sum(g[0][0] for g in got), *got[0][0][1:])
        pieces, at = [], 0
        for m, (n, *_), rows in ((m, g[0], g[3]) for m, g in zip(members, got, strict=True)):
            pieces.append(Piece(*_origin(f"{prefix}.{m}", part), (rows,), (slice(at, at + n),)))
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


def _whole_blocks(prefix: str, spans: dict, block: int) -> None:
    """vLLM's ``validate_fp8_block_shape`` for a merged FP8-block layer: each member's rows
    on a rank are whole blocks (the last member's may end in a partial one when the layer
    is not split over tp)."""
    split = any(b - a < full for a, b, full in spans.values())
    check = list(spans.items()) if split else list(spans.items())[:-1]
    for m, (a, b, _) in check:
        if (b - a) % block:
            raise ConfigError(
                f"{prefix}.{m}: {b - a} rows per rank are not whole FP8 blocks of {block}, "
                f"and vLLM refuses them in its merged layer; re-quantize with a scheme "
                f"without blocks (fp8-dynamic), or keep {prefix}'s projections unquantized."
            )


def _per_member(src: _Source, prefix: str, fused: str, members: list[str], part: str) -> Param:
    """A merged parameter's per-tensor part (NVFP4's global scales, a tensor-wise FP8
    weight's scale): vLLM's ``PerTensorScaleParameter`` holds one value per member, in
    member order."""
    modules = [f"{prefix}.{m}" for m in members]
    for m in modules:
        shape, _ = _module_parts(src.ck, m)[part]
        if tuple(shape) != (1,):
            raise ConfigError(f"{m}.{part}: shape {tuple(shape)}, expected one value.")
    dtype = _module_parts(src.ck, modules[0])[part][1]

    def make():
        return torch.cat([src.ck.get_parts(f"{m}.weight")[part].reshape(1) for m in modules])

    pieces = tuple(
        Piece(f"{m}.weight", part, ALL, (slice(j, j + 1),)) for j, m in enumerate(modules)
    )
    return Param(f"{prefix}.{fused}.{part}", dtype, (len(modules),), make, pieces=pieces)


def _row(src: _Source, module: str, a: int, n: int, full: int) -> Iterator[Param]:
    for part in _module_parts(src.ck, module):
        yield src.row(module, part, a, a + n, full)


def _check_source(ck: Checkpoint) -> tuple:
    """The family and scheme are ones this target writes, and the checkpoint is what its
    config says (``validate_source``: every tensor's name and shape, plain weights in a
    float dtype, the KV-cache scales) - all before a byte is written."""
    arch, cfg = resolve(ck.config, str(ck.root / "config.json"))
    mt = ck.config.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(
            f"{ck.root}: --target vllm writes {', '.join(FAMILIES)} for now, not '{mt}' "
            f"(docs/vllm-target.md lists what is supported); use the default stream target."
        )
    validate_source(arch, cfg, ck, str(ck.root))
    for name in ck.names():
        m = ck.meta(name)
        if m.encoding == "plain" and not m.main.dtype.is_floating_point:
            raise ConfigError(
                f"{m.file}: tensor '{name}' is stored as {m.main.dtype} where the model "
                f"holds floating-point weights; the file is damaged or mislabelled - "
                f"re-download or re-export it."
            )
    if mt == "kimi_k3":
        from .vllm_kimi_k3 import check_k3

        check_k3(ck, cfg)
        return arch, cfg
    qc = ck.config.get("quantization_config")
    if qc is not None:
        fmt = qc.get("format")
        if fmt == "mixed-precision":  # one format per config group: each must be written here
            groups = (qc.get("config_groups") or {}).values()
            fmt = next((g.get("format") for g in groups if g.get("format") not in FORMATS),
                       FORMATS[0])  # fmt: skip
        if qc.get("quant_method") != "compressed-tensors" or fmt not in FORMATS:
            raise ConfigError(
                f"{ck.root}: --target vllm writes compressed-tensors {', '.join(FORMATS)} "
                f"checkpoints, not {qc.get('quant_method')} / {fmt}."
            )
        kv = qc.get("kv_cache_scheme")
        if kv is not None and FAMILIES[mt] == "DeepseekV3ForCausalLM":
            raise ConfigError(
                f"{ck.root}: its KV-cache scales (kv_cache_scheme) would be lost: vLLM 0.32's "
                f"MLA attention loads none (its own load of this checkpoint drops them too, "
                f"and an fp8 KV cache would run with scale 1.0). Quantize without --kv-cache "
                f"for vLLM."
            )
        if kv is not None and (kv.get("type"), kv.get("strategy")) != ("float", "tensor"):
            raise ConfigError(
                f"{ck.root}: KV-cache scales are written for FP8 per tensor only, not "
                f"{kv.get('type')} {kv.get('strategy')}."
            )
        for g in (qc.get("config_groups") or {}).values():
            ia, w = g.get("input_activations") or {}, g.get("weights") or {}
            static_fp8 = (ia.get("type"), ia.get("strategy")) == ("float", "tensor")
            if ia and not ia.get("dynamic") and not static_fp8:
                raise ConfigError(
                    f"{ck.root}: static activation scales are written for vLLM for FP8 per "
                    f"tensor (fp8) only, not {ia.get('type')} {ia.get('strategy')}; use a "
                    f"scheme with dynamic activations (fp8-dynamic, w8a8, fp8-block)."
                )
            if w.get("actorder") == "group":
                raise ConfigError(f"{ck.root}: GPTQ act-order 'group' (g_idx) is not written yet.")
    return arch, cfg


def carried_shapes(ck: Checkpoint) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensors of which vLLM's model holds only a leading block (a release's
    padding it never reads): name -> the shape a vLLM directory carries."""
    if ck.config.get("model_type") != "kimi_k3":
        return {}
    from .vllm_kimi_k3 import carried_shapes as k3

    return k3(ck, _check_source(ck)[1])


def dtype_of(ck: Checkpoint) -> torch.dtype:
    name = str(ck.config.get("torch_dtype") or ck.config.get("dtype") or "bfloat16")
    return {"float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)


def rank_params(ck: Checkpoint, ranks: list[Rank]) -> dict[Rank, list[Param]]:
    """Every parameter vLLM's model holds on each rank, in write order (nothing read
    yet; every refusal happens here, before any byte is written)."""
    _, cfg = _check_source(ck)
    if any(r.ep for r in ranks) and not getattr(getattr(cfg, "text", cfg), "num_experts", 0):
        raise ConfigError(f"{ck.root}: --ep needs a model with routed experts.")
    if ck.config.get("model_type") == "kimi_k3":
        from .vllm_kimi_k3 import k3_params

        return {r: list(k3_params(ck, cfg, dtype_of(ck), r)) for r in ranks}
    src = _Source(ck, cfg, dtype_of(ck))
    return {r: list(_decoder_params(src, r)) for r in ranks}

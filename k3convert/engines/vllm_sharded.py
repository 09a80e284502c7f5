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

from collections.abc import Callable, Iterator

import torch

from ..arch import get_arch, resolve, validate_source
from ..checkpoint import Checkpoint
from ..checkpoint.output import STREAM_JOURNAL
from ..errors import ConfigError
from .params import Param, Slicer
from .vllm_kimi_k3 import carried_shapes as k3_carried_shapes
from .vllm_kimi_k3 import check_k3, k3_params
from .vllm_layers import (
    MERGED,
    Rank,
    attention_scales,
    fused,
    pp_layers,
    row,
    swiglu,
    vocab_rows,
)
from .vllm_moe import fused_moe

#: the vLLM release whose layouts this writes (tests/test_vllm.py checks against it)
VLLM_VERSION = "0.32.0"
#: written last: a directory without it (or with another format in it) is not complete
INDEX = "k3convert-vllm.json"
FORMAT = "k3convert-vllm-sharded-state"
#: 2: the index binds the directory (carried files hashed, the source fingerprinted);
#: 3: and itself (``index_hash``: every other field of it, see ``vllm_index.seal``)
INDEX_VERSION = 3
#: the most ranks (tp x pp) a layout may have: more than any cluster vLLM runs on;
#: checked by the writer before a single rank is built, and by every index read
MAX_WORLD = 4096
#: a directory written in one pass from tensors produced as read (no checkpoint on
#: disk): their names, dtypes and shapes as a file would list them, zstd JSON (carried,
#: so hashed by the index): what ``verify`` maps the rank files back with
DESCRIBED = "k3convert-vllm-tensors.json.zst"
HASH = "xxh3-128"  # each rank file's, as ``ALGO:HEX`` (stream.hashing)
JOURNAL = STREAM_JOURNAL  # in the stage: one entry per finished rank file
#: the dense GQA model types: every one the llama arch reads (llama, qwen2, qwen3,
#: mistral). vLLM's classes for them keep Hugging Face's names and share llama's merged
#: parameters, so the arch's roles decide what is written (q / k norms, q / k / v
#: biases, tied embeddings): a model type added to that arch needs no engine code
DENSE_GQA = (get_arch("llama").name, *get_arch("llama").aliases)
#: families whose vLLM model class this writes (model_type -> vLLM class)
FAMILIES = {
    **{mt: "LlamaForCausalLM-like (Hugging Face names)" for mt in DENSE_GQA},
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


def _decoder_params(src: Slicer, arch, rank: Rank) -> Iterator[Param]:
    """Every family here: the embedding, per layer its norms, attention (the arch's kind
    for the layer: GQA or MLA) and MLP (FusedMoE where the arch's config routes the
    layer, else dense SwiGLU), the final norm and lm_head."""
    cfg = src.cfg
    layers = pp_layers(cfg.num_layers, rank.pp, rank.pp_size)  # (MTP layers: not loaded)
    first, last = rank.pp == 0, rank.pp == rank.pp_size - 1
    if src.ck.config.get("model_type") in EVERY_STAGE:
        first = last = True
    if cfg.tie_word_embeddings and rank.pp_size > 1:
        raise ConfigError("a tied lm_head with pp > 1 is not written yet; use pp 1.")
    if first and not cfg.tie_word_embeddings:
        yield vocab_rows(src, rank, "model.embed_tokens.weight", "model.embed_tokens.weight")
    attention = {"gqa": _gqa_attention, "mla": _mla_attention}
    for i in layers:
        pre = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield src.whole(f"{pre}.{norm}.weight", src.dtype)
        yield from attention[arch.attention_of(cfg, i)](src, rank, pre)
        if arch.router is not None and cfg.is_moe_layer(i):
            yield from fused_moe(src, rank, f"{pre}.mlp")
        else:
            yield from swiglu(src, rank, f"{pre}.mlp", f"{pre}.mlp")
    if last:
        yield src.whole("model.norm.weight", src.dtype)
        # tied: one tensor, which vLLM's state dict names lm_head.weight (the smaller key)
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        yield vocab_rows(src, rank, head, "lm_head.weight")


def _gqa_attention(src: Slicer, rank: Rank, pre: str) -> Iterator[Param]:
    """llama / qwen3: ``qkv_proj`` (the rank's q heads, then its KV heads of k and v, as
    the roles split them: KV heads replicated once tp passes their count), ``o_proj``
    split by input columns, q / k norms whole, the attention's scales."""
    at = f"{pre}.self_attn"
    if src.cfg.qk_norm:
        for n in ("q_norm", "k_norm"):
            yield src.whole(f"{at}.{n}.weight", src.dtype)
    spans = {m: src.span(f"{at}.{m}.weight", rank.tp, rank.tp_size) for m in MERGED["qkv_proj"]}
    yield from fused(src, at, "qkv_proj", spans)
    a, b, full = src.span(f"{at}.o_proj.weight", rank.tp, rank.tp_size)
    yield from row(src, f"{at}.o_proj", a, b - a, full)
    quantized = src.ck.config.get("quantization_config") is not None
    yield from attention_scales(f"{at}.attn", src.dtype, quantized, src.ck, pre)


def _mla_attention(src: Slicer, rank: Rank, pre: str) -> Iterator[Param]:
    """DeepSeek-V3 / Kimi-K2 MLA: ``fused_qkv_a_proj`` (q_a_proj then kv_a_proj_with_mqa,
    replicated), the latent norms whole, ``q_b_proj`` / ``kv_b_proj`` split by heads,
    ``o_proj`` by input columns (as the roles split them). vLLM's MLA module holds
    several of the attention's submodules a second time; each is written under the name
    its state dict keeps (the smaller)."""
    if not src.cfg.q_lora_rank:
        raise ConfigError("MLA without a q LoRA rank (q_proj) is not written for vLLM yet.")
    at = f"{pre}.self_attn"

    def named(sub: str) -> str:  # the state dict's name: the smaller of the two
        return min(f"{at}.{sub}", f"{at}.mla_attn.{sub}")

    def span(module: str) -> tuple[int, int, int]:
        return src.span(f"{at}.{module}.weight", rank.tp, rank.tp_size)

    spans = {m: span(m) for m in MERGED["fused_qkv_a_proj"]}
    for p in fused(src, at, "fused_qkv_a_proj", spans):
        p.name = named(p.name.removeprefix(f"{at}."))
        yield p
    for norm in ("q_a_layernorm", "kv_a_layernorm"):
        p = src.whole(f"{at}.{norm}.weight", src.dtype)
        p.name = named(f"{norm}.weight")
        yield p
    for proj in ("q_b_proj", "kv_b_proj"):
        for p in fused(src, at, proj, {proj: span(proj)}):
            p.name = named(p.name.removeprefix(f"{at}."))
            yield p
    a, b, full = span("o_proj")
    for p in row(src, f"{at}.o_proj", a, b - a, full):
        p.name = named(p.name.removeprefix(f"{at}."))
        yield p
    yield from attention_scales(f"{at}.mla_attn.mla_attn", src.dtype, False)


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
            ia = g.get("input_activations") or {} if isinstance(g, dict) else None
            w = g.get("weights") or {} if isinstance(g, dict) else None
            if not isinstance(ia, dict) or not isinstance(w, dict):
                raise ConfigError(
                    f"{ck.root}: config.json's quantization_config.config_groups hold a "
                    f"group whose weights / input_activations are not objects; the config is "
                    f"damaged - re-export it."
                )
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
    return k3_carried_shapes(ck, _check_source(ck)[1])


def dtype_of(ck: Checkpoint) -> torch.dtype:
    name = str(ck.config.get("torch_dtype") or ck.config.get("dtype") or "bfloat16")
    return {"float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)


def rank_params(ck: Checkpoint, ranks: list[Rank]) -> dict[Rank, list[Param]]:
    """Every parameter vLLM's model holds on each rank, in write order (nothing read
    yet; every refusal happens here, before any byte is written)."""
    params_of = rank_planner(ck, ranks)
    return {r: params_of(r) for r in ranks}


def rank_planner(ck: Checkpoint, ranks: list[Rank]) -> Callable[[Rank], list[Param]]:
    """``params_of(rank)``: :func:`rank_params` one rank at a time (a writer holds the
    records of the rank it writes, not of every rank). The source is checked here; a
    refusal of the layout comes from building a rank's list, so a writer builds every
    rank's once before it writes."""
    arch, cfg = _check_source(ck)
    if any(r.ep for r in ranks) and not getattr(getattr(cfg, "text", cfg), "num_experts", 0):
        raise ConfigError(f"{ck.root}: --ep needs a model with routed experts.")
    # (validated once per source: _check_source's matches, memoised)
    roles = {n: m.role for n, m in validate_source(arch, cfg, ck, str(ck.root)).items()}
    if ck.config.get("model_type") == "kimi_k3":
        return lambda r: list(k3_params(ck, cfg, dtype_of(ck), r, roles))
    src = Slicer(ck, cfg, dtype_of(ck), roles)
    return lambda r: list(_decoder_params(src, arch, r))

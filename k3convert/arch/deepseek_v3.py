"""DeepSeek-V3 / Kimi-K2: MLA attention + sigmoid-routed MoE with shared experts.

MLA: ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or a plain ``q_proj`` when
``q_lora_rank`` is null), ``kv_a_proj_with_mqa`` [kv_lora_rank + rope_dim, H] ->
``kv_a_layernorm`` -> ``kv_b_proj`` [heads * (nope + v), kv_lora_rank]. The low-rank
parts are replicated under TP, the per-head parts split by heads.
The first ``first_k_dense_replace`` layers are dense; the rest route with a sigmoid
router plus ``e_score_correction_bias`` (group-limited top-k). Multi-token-prediction
layers (``num_nextn_predict_layers``) follow the last layer as ``model.layers.{N+k}``
with extra ``enorm / hnorm / eh_proj / shared_head`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Arch, check_routing, count, finite, positive, register, req
from .base import TensorSpec as T
from .common import embed_and_head, gated_mlp, kv_scales, layer_norms, router


@dataclass(frozen=True)
class DeepseekV3Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    num_mtp: int
    tie_word_embeddings: bool
    attention_bias: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )


def parse(raw: dict, where: str = "config.json") -> DeepseekV3Config:
    g = lambda k, *alts: req(raw, k, where, *alts)  # noqa: E731
    p = lambda k: positive(g(k), k, where)  # noqa: E731
    experts = count(raw.get("n_routed_experts"), "n_routed_experts", where)
    topk = count(raw.get("num_experts_per_tok"), "num_experts_per_tok", where)
    n_group = positive(raw.get("n_group") or 1, "n_group", where)
    topk_group = positive(raw.get("topk_group") or 1, "topk_group", where)
    check_routing(experts, topk, n_group, topk_group, where)
    q_lora = raw.get("q_lora_rank")
    return DeepseekV3Config(
        model_type=raw["model_type"],
        vocab_size=p("vocab_size"),
        hidden_size=p("hidden_size"),
        num_layers=p("num_hidden_layers"),
        num_heads=p("num_attention_heads"),
        q_lora_rank=positive(q_lora, "q_lora_rank", where) if q_lora else None,
        kv_lora_rank=p("kv_lora_rank"),
        qk_nope_head_dim=p("qk_nope_head_dim"),
        qk_rope_head_dim=p("qk_rope_head_dim"),
        v_head_dim=p("v_head_dim"),
        intermediate_size=p("intermediate_size"),
        moe_intermediate_size=positive(
            raw.get("moe_intermediate_size") or raw["intermediate_size"],
            "moe_intermediate_size",
            where,
        ),
        num_experts=experts,
        num_shared_experts=count(raw.get("n_shared_experts"), "n_shared_experts", where),
        num_experts_per_tok=topk,
        first_k_dense_replace=count(
            raw.get("first_k_dense_replace"), "first_k_dense_replace", where
        ),
        moe_layer_freq=positive(raw.get("moe_layer_freq") or 1, "moe_layer_freq", where),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=finite(
            raw.get("routed_scaling_factor"), "routed_scaling_factor", where, 1.0
        ),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        num_mtp=count(raw.get("num_nextn_predict_layers"), "num_nextn_predict_layers", where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
    )


def mla_attention(a: str) -> list[T]:
    H = lambda c: c.hidden_size  # noqa: E731
    lora = lambda c: c.q_lora_rank is not None  # noqa: E731
    bias = lambda c: c.attention_bias  # noqa: E731
    return [
        T(f"{a}q_a_proj.weight", "layer", "attention", "q_a_proj",
          lambda c: (c.q_lora_rank, H(c)), when=lora),
        T(f"{a}q_a_proj.bias", "layer", "attention", "q_a_proj_bias",
          lambda c: (c.q_lora_rank,), when=lambda c: lora(c) and bias(c)),
        T(f"{a}q_a_layernorm.weight", "layer", "norms", "q_a_layernorm",
          lambda c: (c.q_lora_rank,), keep=True, when=lora),
        T(f"{a}q_b_proj.weight", "layer", "attention", "q_b_proj",
          lambda c: (c.num_heads * c.qk_head_dim, c.q_lora_rank), "heads", when=lora),
        T(f"{a}q_proj.weight", "layer", "attention", "q_proj",
          lambda c: (c.num_heads * c.qk_head_dim, H(c)), "heads",
          when=lambda c: not lora(c)),
        T(f"{a}kv_a_proj_with_mqa.weight", "layer", "attention", "kv_a_proj_with_mqa",
          lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, H(c))),
        T(f"{a}kv_a_proj_with_mqa.bias", "layer", "attention", "kv_a_proj_with_mqa_bias",
          lambda c: (c.kv_lora_rank + c.qk_rope_head_dim,), when=bias),
        T(f"{a}kv_a_layernorm.weight", "layer", "norms", "kv_a_layernorm",
          lambda c: (c.kv_lora_rank,), keep=True),
        T(f"{a}kv_b_proj.weight", "layer", "attention", "kv_b_proj",
          lambda c: (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
          "heads"),
        T(f"{a}o_proj.weight", "layer", "attention", "o_proj",
          lambda c: (H(c), c.num_heads * c.v_head_dim), "row"),
        T(f"{a}o_proj.bias", "layer", "attention", "o_proj_bias", lambda c: (H(c),),
          when=bias),
    ]  # fmt: skip


def mtp_rows(L: str) -> list[T]:
    V, H = (lambda c: c.vocab_size), (lambda c: c.hidden_size)
    return [
        T(f"{L}embed_tokens.weight", "mtp", "mtp", "mtp_embed_tokens",
          lambda c: (V(c), H(c)), "vocab", keep=True),
        T(f"{L}enorm.weight", "mtp", "mtp", "mtp_enorm", lambda c: (H(c),), keep=True),
        T(f"{L}hnorm.weight", "mtp", "mtp", "mtp_hnorm", lambda c: (H(c),), keep=True),
        T(f"{L}eh_proj.weight", "mtp", "mtp", "mtp_eh_proj", lambda c: (H(c), 2 * H(c)),
          keep=True),
        T(f"{L}shared_head.norm.weight", "mtp", "mtp", "mtp_head_norm", lambda c: (H(c),),
          keep=True),
        T(f"{L}shared_head.head.weight", "mtp", "mtp", "mtp_head", lambda c: (V(c), H(c)),
          "vocab", keep=True),
    ]  # fmt: skip


def lm_specs(p: str, head: str) -> list[T]:
    """The decoder under name prefix ``p`` ('model.' or 'language_model.model.')."""
    L = p + "layers.{L}."
    return [
        *embed_and_head(p, head),
        *layer_norms(L),
        *mla_attention(L + "self_attn."),
        *kv_scales(L + "self_attn."),
        *gated_mlp(L + "mlp.", "dense_layer", "dense_mlp", lambda c: c.intermediate_size),
        *router(L + "mlp.gate."),
        T(L + "mlp.gate.e_score_correction_bias", "moe_layer", "router",
          "e_score_correction_bias", lambda c: (c.num_experts,), keep=True),
        *gated_mlp(L + "mlp.shared_experts.", "moe_layer", "shared_experts",
                   lambda c: c.moe_intermediate_size * c.num_shared_experts),
        *gated_mlp(L + "mlp.experts.{E}.", "expert", "routed_experts",
                   lambda c: c.moe_intermediate_size),
        *mtp_rows(L),
    ]  # fmt: skip


def specs(c: DeepseekV3Config) -> list[T]:
    rows = lm_specs("model.", "lm_head.weight")
    if not c.num_shared_experts:
        rows = [r for r in rows if r.component != "shared_experts"]
    return rows


DEEPSEEK_V3 = register(
    Arch(
        "deepseek_v3",
        ("kimi_k2",),
        parse,
        specs,
        doc="MLA + sigmoid-routed MoE with shared experts and MTP (DeepSeek-V3 / Kimi-K2)",
        attention="mla",
        router="sigmoid_group",
    )
)

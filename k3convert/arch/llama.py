"""Dense GQA decoders: llama, and the near-identical qwen2 / qwen3 / mistral.

Differences are config flags, not code: qwen2 has q/k/v biases, qwen3 has per-head
q/k RMSNorm, llama's ``attention_bias`` adds biases to all four projections.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Arch, positive, register, req
from .common import embed_and_head, gated_mlp, gqa_attention, kv_scales, layer_norms, mlp_biases


@dataclass(frozen=True)
class GQAConfig:
    """What every GQA decoder family shares (see :func:`gqa_fields`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    intermediate_size: int


@dataclass(frozen=True)
class DenseConfig(GQAConfig):
    mlp_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0

    def is_moe_layer(self, i: int) -> bool:
        return False


def gqa_fields(raw: dict, where: str) -> dict:
    """Fields every GQA family shares, validated."""
    mt = raw["model_type"]
    hidden = positive(req(raw, "hidden_size", where), "hidden_size", where)
    heads = positive(req(raw, "num_attention_heads", where), "num_attention_heads", where)
    # absent or null: the defaults transformers takes; any value given (0 too) is checked
    kv = raw.get("num_key_value_heads")
    kv = heads if kv is None else kv
    positive(kv, "num_key_value_heads", where)
    head_dim = raw.get("head_dim")
    head_dim = hidden // heads if head_dim is None else head_dim
    attn_bias = bool(raw.get("attention_bias", False))
    return dict(
        model_type=mt,
        vocab_size=positive(req(raw, "vocab_size", where), "vocab_size", where),
        hidden_size=hidden,
        num_layers=positive(req(raw, "num_hidden_layers", where), "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=positive(head_dim, "head_dim", where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attn_bias or mt == "qwen2",
        o_bias=attn_bias and mt != "qwen2",
        qk_norm=mt in ("qwen3", "qwen3_moe"),
    )


def parse(raw: dict, where: str = "config.json") -> DenseConfig:
    return DenseConfig(
        **gqa_fields(raw, where),
        intermediate_size=positive(
            req(raw, "intermediate_size", where), "intermediate_size", where
        ),
        mlp_bias=bool(raw.get("mlp_bias", False)),
    )


def specs(c: DenseConfig):
    L = "model.layers.{L}."
    width = lambda c: c.intermediate_size  # noqa: E731
    names = ("gate_proj", "up_proj", "down_proj")
    rows = [
        *embed_and_head("model.", "lm_head.weight"),
        *layer_norms(L),
        *gqa_attention(L + "self_attn."),
        *kv_scales(L + "self_attn."),
        *gated_mlp(L + "mlp.", "layer", "dense_mlp", width),
    ]
    if c.mlp_bias:
        rows += mlp_biases(L + "mlp.", "layer", "dense_mlp", width, names)
    return rows


LLAMA = register(
    Arch(
        "llama",
        ("qwen2", "qwen3", "mistral"),
        parse,
        specs,
        doc="Dense GQA decoder (llama / qwen2 / qwen3 / mistral)",
    )
)

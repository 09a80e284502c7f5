"""Rows shared by the decoder families (embeddings, norms, GQA attention, MLPs).

Each helper returns TensorSpec rows for a name prefix, so a family table reads as a
list of building blocks rather than a wall of near-identical lines.
"""

from __future__ import annotations

from .base import TensorSpec as T


def embed_and_head(p: str, head: str) -> list[T]:
    """Token embedding, final norm, and lm_head (absent when tied)."""
    return [
        T(f"{p}embed_tokens.weight", "global", "embeddings", "embed_tokens",
          lambda c: (c.vocab_size, c.hidden_size), "vocab", keep=True),
        T(f"{p}norm.weight", "global", "norms", "final_norm",
          lambda c: (c.hidden_size,), keep=True),
        T(head, "global", "head", "lm_head", lambda c: (c.vocab_size, c.hidden_size), "vocab",
          keep=True, when=lambda c: not c.tie_word_embeddings),
    ]  # fmt: skip


def layer_norms(p: str) -> list[T]:
    return [
        T(f"{p}input_layernorm.weight", "layer", "norms", "input_layernorm",
          lambda c: (c.hidden_size,), keep=True),
        T(f"{p}post_attention_layernorm.weight", "layer", "norms", "post_attention_layernorm",
          lambda c: (c.hidden_size,), keep=True),
    ]  # fmt: skip


def gqa_attention(a: str) -> list[T]:
    """q/k/v/o projections with optional biases and per-head q/k RMSNorm (qwen3)."""
    q = lambda c: (c.num_heads * c.head_dim, c.hidden_size)  # noqa: E731
    kv = lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size)  # noqa: E731
    return [
        T(f"{a}q_proj.weight", "layer", "attention", "q_proj", q, "heads"),
        T(f"{a}k_proj.weight", "layer", "attention", "k_proj", kv, "kv_heads"),
        T(f"{a}v_proj.weight", "layer", "attention", "v_proj", kv, "kv_heads"),
        T(f"{a}o_proj.weight", "layer", "attention", "o_proj",
          lambda c: (c.hidden_size, c.num_heads * c.head_dim), "row"),
        T(f"{a}q_proj.bias", "layer", "attention", "q_proj_bias",
          lambda c: (c.num_heads * c.head_dim,), "heads", when=lambda c: c.qkv_bias),
        T(f"{a}k_proj.bias", "layer", "attention", "k_proj_bias",
          lambda c: (c.num_kv_heads * c.head_dim,), "kv_heads", when=lambda c: c.qkv_bias),
        T(f"{a}v_proj.bias", "layer", "attention", "v_proj_bias",
          lambda c: (c.num_kv_heads * c.head_dim,), "kv_heads", when=lambda c: c.qkv_bias),
        T(f"{a}o_proj.bias", "layer", "attention", "o_proj_bias",
          lambda c: (c.hidden_size,), when=lambda c: c.o_bias),
        T(f"{a}q_norm.weight", "layer", "norms", "q_norm", lambda c: (c.head_dim,),
          keep=True, when=lambda c: c.qk_norm),
        T(f"{a}k_norm.weight", "layer", "norms", "k_norm", lambda c: (c.head_dim,),
          keep=True, when=lambda c: c.qk_norm),
    ]  # fmt: skip


def gated_mlp(
    p: str, scope: str, component: str, width, names=("gate_proj", "up_proj", "down_proj")
) -> list[T]:
    """SwiGLU MLP: gate/up column-parallel [width, H], down row-parallel [H, width]."""
    g, u, d = names
    return [
        T(f"{p}{g}.weight", scope, component, "gate_proj",
          lambda c: (width(c), c.hidden_size), "col"),
        T(f"{p}{u}.weight", scope, component, "up_proj",
          lambda c: (width(c), c.hidden_size), "col"),
        T(f"{p}{d}.weight", scope, component, "down_proj",
          lambda c: (c.hidden_size, width(c)), "row"),
    ]  # fmt: skip


def mlp_biases(p: str, scope: str, component: str, width, names) -> list[T]:
    g, u, d = names
    return [
        T(f"{p}{g}.bias", scope, component, "gate_proj_bias", lambda c: (width(c),), "col"),
        T(f"{p}{u}.bias", scope, component, "up_proj_bias", lambda c: (width(c),), "col"),
        T(f"{p}{d}.bias", scope, component, "down_proj_bias", lambda c: (c.hidden_size,)),
    ]


def router(p: str, scope: str = "moe_layer") -> list[T]:
    return [
        T(f"{p}weight", scope, "router", "router",
          lambda c: (c.num_experts, c.hidden_size), keep=True),
    ]  # fmt: skip


def kv_scales(a: str, scope: str = "layer") -> list[T]:
    """The calibrated FP8 KV-cache scales of an attention layer (compressed-tensors'
    ``kv_cache_scheme``: per-tensor ``k_scale`` / ``v_scale`` of shape [1] on the
    attention module). Optional rows: only a checkpoint whose quantization_config has a
    kv_cache_scheme holds them (``arch.check_kv_scales``). Kept, replicated under TP."""
    return [
        T(f"{a}{x}_scale", scope, "attention", f"{x}_scale", lambda c: (1,), keep=True,
          optional=True)
        for x in "kv"
    ]  # fmt: skip

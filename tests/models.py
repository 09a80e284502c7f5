"""Tiny random models of the real architectures, built with transformers' own classes.

These are the oracles: transformers wrote the files (``save_pretrained``), so the names,
shapes and layouts are the real ones, not ours. Each builder takes overrides so a test
can pick the variant it needs (tied embeddings, MLA without q_lora_rank, ...).
Builders are deterministic (seeded) and return the saved directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from pathlib import Path

import torch
import xxhash

VOCAB = 160  # not a multiple of 8 on purpose: exercises vocab padding in sharding


def _dsv3_kwargs(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=256,
        num_nextn_predict_layers=0,
    )
    base.update(kw)
    return base


def _kimi_linear_kwargs(**kw):
    """transformers' KimiLinearConfig, tiny: 4 layers (KDA 1, 2, 4 and MLA 3, 1-based as
    the release lists them), layer 0 dense, 8 routed experts top-2 in 2 groups."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        linear_attn_config=dict(
            head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 4],
            full_attn_layers=[3],
        ),
        first_k_dense_replace=1,
        max_position_embeddings=256,
        pad_token_id=0,  # (the defaults lie outside the tiny vocabulary)
        bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    base.update(kw)
    return base


_GQA_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
#: family -> (transformers config class, what differs from _GQA_BASE)
_GQA_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(moe_intermediate_size=32, head_dim=16, num_experts=8, num_experts_per_tok=2),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    ),
}


def config_for(family: str, **kw):
    """A transformers config object of ``family`` with tiny dimensions."""
    import transformers as tf

    if family in _GQA_FAMILIES:
        cls, extra = _GQA_FAMILIES[family]
        return getattr(tf, cls)(**{**_GQA_BASE, **extra, **kw})
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**_dsv3_kwargs(**kw))
    if family == "kimi_linear":
        return tf.KimiLinearConfig(**_kimi_linear_kwargs(**kw))
    if family == "kimi_k25":
        text = kw.pop("text_config", {})
        vision = dict(
            patch_size=14,
            num_attention_heads=2,
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            pos_emb_height=8,
            pos_emb_width=8,
        )
        vision.update(kw.pop("vision_config", {}))
        return tf.Kimi_K25Config(
            **{
                **dict(
                    text_config=tf.DeepseekV3Config(**_dsv3_kwargs(**text)).to_dict(),
                    vision_config=vision,
                    projection_hidden_size=32,
                    image_token_id=VOCAB - 4,
                    video_token_id=VOCAB - 3,
                    vision_start_token_id=VOCAB - 2,
                    vision_end_token_id=VOCAB - 1,
                ),
                **kw,
            }
        )
    raise ValueError(family)


MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k25": "Kimi_K25ForConditionalGeneration",
    "kimi_linear": "KimiLinearForCausalLM",
}


def build_model(family: str, seed: int = 0, dtype=torch.float32, **kw):
    """An initialised transformers model (random, seeded) in eval mode."""
    import transformers as tf

    cfg = config_for(family, **kw)
    torch.manual_seed(seed)
    model = getattr(tf, MODEL_CLASSES[family])(cfg).to(dtype).eval()
    # Random-init norms are all ones and biases zero; perturb them so a reader or a
    # runtime that drops or swaps one is caught.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():  # a buffer, not a parameter, in transformers
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def save_model(family: str, out: Path, seed: int = 0, dtype=torch.float32, **kw) -> Path:
    """Build and ``save_pretrained`` a tiny model; returns ``out``."""
    model = build_model(family, seed, dtype, **kw)
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(out)
    return out


def kimi_linear(out: Path, seed: int = 0, dtype=torch.float32, **kw) -> Path:
    """A tiny transformers ``KimiLinearForCausalLM`` (KDA + MLA layers, MoE) saved to
    ``out``. ``save_pretrained`` writes the released names (``self_attn.q_conv1d``,
    ``self_attn.f_a_proj``, ``block_sparse_moe.experts.E.w1`` ...), converting back from
    transformers' fused internal ones. A_log ([1, 1, H, 1]) is FLA's init (log U(1, 16)),
    dt_bias / norms are perturbed by build_model."""
    return save_model("kimi_linear", out, seed, dtype, **kw)


#: tiny models whose every Linear input width is a multiple of 128, so g128 groups and
#: 128x128 FP8 blocks (with their 128-channel activation groups) fit every layer
QUANT_FAMILIES = {
    "llama": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2),
    "qwen3_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "deepseek_v3": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                        kv_lora_rank=128, q_lora_rank=128, v_head_dim=32,
                        qk_nope_head_dim=32, qk_rope_head_dim=16),
}  # fmt: skip
QUANT_SCHEMES = ("fp8-block", "fp8-dynamic", "w8a8", "w4a16")
#: transformers 5.24 / compressed-tensors 0.20 cannot reload these quantized dirs: its
#: fused-expert loader handles FP8 ``weight`` and packed ``weight_packed`` experts only
RELOAD_GAPS = {("qwen3_moe", "w8a8"), ("deepseek_v3", "w8a8")}


def unit_hash(data: bytes, algo: str = "xxh3-128") -> str:
    """A stream unit's hash field (``ALGO:HEX``, spec 3.2), computed with xxhash / hashlib
    directly: independent of k3convert's own hashing code."""
    if algo == "sha256":
        return "sha256:" + hashlib.sha256(data).hexdigest()
    return "xxh3-128:" + xxhash.xxh3_128(data).hexdigest()


def edit_tensors(root: Path, edit) -> None:
    """Rewrite the safetensors files of checkpoint ``root`` whose tensors ``edit(tensors)``
    changed (it gets each file's name -> tensor dict and returns True when it edited it):
    a damaged release, for the tests that refuse one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for f in sorted(Path(root).glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            sd = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
        if edit(sd):
            save_file(sd, f, metadata={"format": "pt"})

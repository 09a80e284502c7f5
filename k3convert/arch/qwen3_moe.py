"""Softmax top-k MoE decoders: qwen3_moe, and mixtral (same math, other names).

qwen3_moe: ``mlp.gate`` router, ``mlp.experts.{E}.{gate,up,down}_proj``, q/k norm, dense
MLP on ``mlp_only_layers`` and off the ``decoder_sparse_step`` grid.
mixtral: ``block_sparse_moe.gate`` router, ``block_sparse_moe.experts.{E}.w1/w3/w2``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from .base import Arch, positive, register, req
from .common import embed_and_head, gated_mlp, gqa_attention, kv_scales, layer_norms, router
from .llama import GQAConfig, gqa_fields


@dataclass(frozen=True)
class MoeConfig(GQAConfig):
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)

    @property
    def mixtral(self) -> bool:
        return self.model_type == "mixtral"

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


def parse(raw: dict, where: str = "config.json") -> MoeConfig:
    mixtral = raw["model_type"] == "mixtral"
    experts = req(raw, "num_experts", where, "num_local_experts")
    inter = positive(req(raw, "intermediate_size", where), "intermediate_size", where)
    moe_inter = inter if mixtral else req(raw, "moe_intermediate_size", where)
    topk = positive(req(raw, "num_experts_per_tok", where), "num_experts_per_tok", where)
    positive(experts, "num_experts", where)
    if topk > experts:
        raise ConfigError(
            f"{where}: num_experts_per_tok={topk} exceeds the {experts} experts; fix the config."
        )
    return MoeConfig(
        **gqa_fields(raw, where),
        intermediate_size=inter,
        moe_intermediate_size=positive(moe_inter, "moe_intermediate_size", where),
        num_experts=experts,
        num_experts_per_tok=topk,
        norm_topk_prob=bool(raw.get("norm_topk_prob", mixtral)),
        decoder_sparse_step=positive(
            raw.get("decoder_sparse_step") or 1, "decoder_sparse_step", where
        ),
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
    )


def specs(c: MoeConfig):
    L = "model.layers.{L}."
    moe = L + ("block_sparse_moe." if c.mixtral else "mlp.")
    expert_names = ("w1", "w3", "w2") if c.mixtral else ("gate_proj", "up_proj", "down_proj")
    return [
        *embed_and_head("model.", "lm_head.weight"),
        *layer_norms(L),
        *gqa_attention(L + "self_attn."),
        *kv_scales(L + "self_attn."),
        *gated_mlp(L + "mlp.", "dense_layer", "dense_mlp", lambda c: c.intermediate_size),
        *router(moe + "gate."),
        *gated_mlp(
            moe + "experts.{E}.",
            "expert",
            "routed_experts",
            lambda c: c.moe_intermediate_size,
            expert_names,
        ),
    ]


QWEN3_MOE = register(
    Arch(
        "qwen3_moe",
        ("mixtral",),
        parse,
        specs,
        doc="Softmax top-k MoE (qwen3_moe / mixtral)",
        router="softmax",
    )
)

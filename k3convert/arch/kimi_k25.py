"""Kimi-K2.5: MoonViT vision tower + patch-merge projector + a DeepSeek-V3 decoder.

Names follow the released checkpoint layout, which is also what transformers'
``Kimi_K25ForConditionalGeneration.save_pretrained`` writes (it converts back from its
internal names): ``vision_tower.*`` (fused ``wqkv``, ``norm0/norm1``, ``mlp.fc0/fc1``),
``mm_projector.*`` and ``language_model.model.*``. transformers spells the decoder
stack ``language_model.model.blocks.N`` and the projector norm
``model.mm_projector.pre_norm``; both spellings are accepted as aliases.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from . import deepseek_v3
from .base import Arch, TextFields, positive, register, req
from .base import TensorSpec as T


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    merge_kernel_size: tuple[int, int]

    @property
    def merged_size(self) -> int:
        return self.hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]


@dataclass(frozen=True)
class KimiK25Config(TextFields):
    text: deepseek_v3.DeepseekV3Config
    vision: VisionConfig
    projection_hidden_size: int
    tie_word_embeddings: bool
    image_token_id: int


def parse(raw: dict, where: str = "config.json") -> KimiK25Config:
    tc = raw.get("text_config")
    vc = raw.get("vision_config")
    if not isinstance(tc, dict) or not isinstance(vc, dict):
        raise ConfigError(f"{where}: kimi_k25 needs 'text_config' and 'vision_config' objects.")
    tc = {**tc, "model_type": tc.get("model_type") or "deepseek_v3"}
    vw = f"{where}: vision_config"
    hidden = positive(req(vc, "hidden_size", vw), "hidden_size", vw)
    heads = positive(req(vc, "num_attention_heads", vw), "num_attention_heads", vw)
    if hidden % heads:
        raise ConfigError(f"{vw}: hidden_size {hidden} not divisible by {heads} heads.")
    merge = vc.get("merge_kernel_size") or (2, 2)
    if not isinstance(merge, list | tuple) or len(merge) != 2:
        raise ConfigError(f"{vw}: 'merge_kernel_size' must be two integers, got {merge!r:.60}.")
    vision = VisionConfig(
        hidden_size=hidden,
        num_layers=positive(req(vc, "num_hidden_layers", vw), "num_hidden_layers", vw),
        num_heads=heads,
        intermediate_size=positive(req(vc, "intermediate_size", vw), "intermediate_size", vw),
        patch_size=positive(vc.get("patch_size") or 14, "patch_size", vw),
        pos_emb_height=positive(vc.get("pos_emb_height") or 64, "pos_emb_height", vw),
        pos_emb_width=positive(vc.get("pos_emb_width") or 64, "pos_emb_width", vw),
        merge_kernel_size=tuple(positive(m, "merge_kernel_size", vw) for m in merge),
    )
    tie = bool(raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", False)))
    text = deepseek_v3.parse({**tc, "tie_word_embeddings": tie}, f"{where}: text_config")
    return KimiK25Config(
        text=text,
        vision=vision,
        projection_hidden_size=raw.get("projection_hidden_size") or hidden,
        tie_word_embeddings=tie,
        image_token_id=int(raw.get("image_token_id", 163605)),
    )


def vision_rows() -> list[T]:
    D = lambda c: c.vision.hidden_size  # noqa: E731
    I = lambda c: c.vision.intermediate_size  # noqa: E731, E741
    M = lambda c: c.vision.merged_size  # noqa: E731
    B = "vision_tower.encoder.blocks.{B}."

    def linear(name, kind, out, inp, scope="vision_block", comp="vision", keep=False, al=()):
        return [
            T(f"{name}.weight", scope, comp, kind, lambda c: (out(c), inp(c)), keep=keep,
              aliases=tuple(f"{a}.weight" for a in al)),
            T(f"{name}.bias", scope, comp, f"{kind}_bias", lambda c: (out(c),), keep=keep,
              aliases=tuple(f"{a}.bias" for a in al)),
        ]  # fmt: skip

    def norm(name, kind, dim, scope="vision_block", comp="vision", al=()):
        return [
            T(f"{name}.{w}", scope, comp, kind, lambda c: (dim(c),), keep=True,
              aliases=tuple(f"{a}.{w}" for a in al))
            for w in ("weight", "bias")
        ]  # fmt: skip

    return [
        T("vision_tower.encoder.patch_embed.proj.weight", "global", "vision", "patch_embed",
          lambda c: (D(c), 3, c.vision.patch_size, c.vision.patch_size), keep=True,
          aliases=("vision_tower.patch_embed.proj.weight",)),
        T("vision_tower.encoder.patch_embed.proj.bias", "global", "vision", "patch_embed_bias",
          lambda c: (D(c),), keep=True, aliases=("vision_tower.patch_embed.proj.bias",)),
        T("vision_tower.patch_embed.pos_emb.weight", "global", "vision", "pos_emb",
          lambda c: (c.vision.pos_emb_height, c.vision.pos_emb_width, D(c)), keep=True),
        *norm(B + "norm0", "norm0", D),
        *norm(B + "norm1", "norm1", D),
        *linear(B + "wqkv", "wqkv", lambda c: 3 * D(c), D),
        *linear(B + "wo", "wo", D, D),
        *linear(B + "mlp.fc0", "fc0", I, D),
        *linear(B + "mlp.fc1", "fc1", D, I),
        *norm("vision_tower.encoder.final_layernorm", "final_layernorm", D, "global"),
        *norm("mm_projector.pre_norm", "pre_norm", lambda c: c.projection_hidden_size,
              "global", "projector", al=("model.mm_projector.pre_norm",)),
        *linear("mm_projector.proj.0", "proj_in", M, M, "global", "projector"),
        *linear("mm_projector.proj.2", "proj_out", lambda c: c.text.hidden_size, M,
                "global", "projector"),
    ]  # fmt: skip


def specs(c: KimiK25Config) -> list[T]:
    lm = deepseek_v3.lm_specs("language_model.model.", "language_model.lm_head.weight")
    if not c.text.num_shared_experts:
        lm = [r for r in lm if r.component != "shared_experts"]
    word = "language_model.model.layers."
    lm = [
        replace(r, aliases=(r.pattern.replace(word, "language_model.model.blocks."),))
        if r.pattern.startswith(word)
        else r
        for r in lm
    ]
    return [*vision_rows(), *lm]


KIMI_K25 = register(
    Arch(
        "kimi_k25",
        (),
        parse,
        specs,
        doc="MoonViT + projector + DeepSeek-V3 decoder (Kimi-K2.5)",
        attention="mla",
        router="sigmoid_group",
        text_key="text_config",
        attention_prefix="language_model.model.layers.{L}.self_attn.",
        vision="moonvit",
    )
)

"""Kimi K3: MoonViT3d vision tower + patch-merger projector + a Kimi-Linear decoder.

Top level ``model_type: kimi_k3`` with ``text_config`` (``model_type: kimi_linear``: KDA +
MLA layers, latent MoE, attention residuals, SiTU; see kimi_linear.py) and
``vision_config`` (see kimi_k3_vision.py). Tensors: ``language_model.model.*``,
``language_model.lm_head.weight``, ``vision_tower.*``, ``mm_projector.*``. The release's
``quantization_config`` (routed experts in ``mxfp4-pack-quantized``) sits inside
``text_config``; the reader decides each tensor's encoding from what is stored. A
text-only export (no ``vision_config``) has no vision rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError
from . import kimi_linear
from .base import Arch, TextFields, register
from .base import TensorSpec as T
from .kimi_k3_vision import parse_vision, vision_rows

#: Moonshot's media placeholder token (images and video chunks)
MEDIA_TOKEN_ID = 163605


@dataclass(frozen=True)
class KimiK3Config(TextFields):
    text: kimi_linear.KimiLinearConfig
    vision: Any  # kimi_k3_vision.K3VisionConfig, None for a text-only export
    tie_word_embeddings: bool
    image_token_id: int


def parse(raw: dict, where: str = "config.json") -> KimiK3Config:
    tc = raw.get("text_config")
    vc = raw.get("vision_config")
    if not isinstance(tc, dict):
        raise ConfigError(f"{where}: kimi_k3 needs a 'text_config' object.")
    if vc is not None and not isinstance(vc, dict):
        raise ConfigError(f"{where}: 'vision_config' must be an object (or absent).")
    tie = bool(raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", False)))
    text = kimi_linear.parse(
        {**tc, "tie_word_embeddings": tie}, f"{where}: text_config", family="kimi_k3"
    )
    vision = parse_vision(vc, text.hidden_size, f"{where}: vision_config") if vc else None
    token = raw.get("media_placeholder_token_id", (vc or {}).get("media_placeholder_token_id"))
    return KimiK3Config(
        text=text,
        vision=vision,
        tie_word_embeddings=tie,
        image_token_id=int(token if token is not None else MEDIA_TOKEN_ID),
    )


def specs(c: KimiK3Config) -> list[T]:
    lm = kimi_linear.lm_specs("language_model.model.", "language_model.lm_head.weight")
    # default keeps: the vision tower and the projector stay in high precision (the
    # release keeps them bf16; they are 0.02 % of the parameters)
    vision = [replace(r, keep=True) for r in vision_rows()] if c.vision is not None else []
    return [*vision, *lm]


KIMI_K3 = register(
    Arch(
        "kimi_k3",
        (),
        parse,
        specs,
        doc="MoonViT3d + projector + KDA/MLA hybrid decoder with latent MoE (Kimi K3)",
        attention="mla",
        router="sigmoid_group",
        hybrid=True,
        text_key="text_config",
        attention_prefix="language_model.model.layers.{L}.self_attn.",
        vision="moonvit3d",
        reference="moonshot",
    )
)

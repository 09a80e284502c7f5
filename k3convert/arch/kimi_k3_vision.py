"""Kimi K3's vision side: MoonViT3d encoder, temporal-pooling patch merge, patchmergerv2.

The config is the released ``vision_config`` object (keys ``vt_hidden_size``,
``vt_num_hidden_layers``, ``qkv_hidden_size``, ``init_pos_emb_*``, ``merge_type``,
``mm_projector_type`` ...); absent keys take the defaults of Moonshot's
``KimiK3VisionConfig``. Tensor names are those of Moonshot's modules:
``vision_tower.patch_embed.{proj,pos_emb}``, ``vision_tower.encoder.blocks.N.{norm0,
norm1,wqkv,wo,mlp.fc0,mlp.fc1}``, ``vision_tower.encoder.final_layernorm`` and
``mm_projector.{proj.0,proj.2,post_norm}``. The temporal sin-cos table of the position
embedding is fixed (computed, not stored); only the 2-D grid is a weight.

Only what Moonshot's code can build is accepted: ``pos_emb_type`` 'divided_fixed',
``merge_type`` 'sd2_tpool', ``mlp_type`` 'mlp2', ``mm_projector_type`` 'patchmergerv2',
``norm_type`` 'rmsnorm' or 'layernorm'. Its encoder MLP always applies tanh-GELU and its
projector erf-GELU, whatever ``activation_func`` / ``projector_hidden_act`` say, so a
config naming another activation is refused rather than silently run otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, short_repr
from .base import TensorSpec as T
from .base import finite, positive

#: the 2-D rotary table of Moonshot's encoder covers grids of at most this many patches
#: per side
ROPE_MAX_SIDE = 512
NORM_TYPES = ("rmsnorm", "layernorm")
INTERPOLATION_MODES = ("bilinear", "bicubic")
ENCODER_ACTS = ("gelu_pytorch_tanh", "gelu_tanh")
PROJECTOR_ACTS = ("gelu",)


@dataclass(frozen=True)
class K3VisionConfig:
    hidden_size: int  # vt_hidden_size
    num_layers: int  # vt_num_hidden_layers
    num_heads: int
    qkv_hidden_size: int  # width of q, k and v each (num_heads * head_dim)
    intermediate_size: int
    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    pos_emb_time: int  # frames the fixed temporal table covers
    pos_emb_type: str
    pos_emb_interpolation: str
    merge_kernel_size: tuple[int, int]
    merge_type: str
    norm_type: str
    mlp_type: str
    attn_bias: bool
    linear_bias: bool
    patch_embed_bias: bool
    projector_type: str
    mm_hidden_size: int
    projector_eps: float
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """Width of one merged token (kh * kw patches side by side): the projector input."""
        return self.mm_hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def projector_hidden_size(self) -> int:
        return self.merged_size

    @property
    def projector_out_size(self) -> int:
        return self.text_hidden_size

    @property
    def has_norm_bias(self) -> bool:
        return self.norm_type == "layernorm"


def _choice(vc: dict, key: str, default: str, allowed: tuple[str, ...], where: str) -> str:
    v = vc.get(key)
    if v is None:
        return default
    if v not in allowed:
        raise ConfigError(
            f"{where}: '{key}' = {short_repr(v)} is not supported (Moonshot's Kimi K3 code "
            f"builds {', '.join(repr(a) for a in allowed)})."
        )
    return v


def _flag(vc: dict, key: str, default: bool, where: str) -> bool:
    v = vc.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: '{key}' must be true or false, got {short_repr(v)}.")
    return v


def _int(vc: dict, key: str, default: int, where: str, *, limit: int | None = None) -> int:
    v = vc.get(key)
    return positive(default if v is None else v, key, where, limit=limit)


def parse_vision(raw_vision: dict, text_hidden: int, where: str) -> K3VisionConfig:
    """The released ``vision_config`` dict -> :class:`K3VisionConfig`.

    ``text_hidden``: the decoder's hidden size (the projector's output width);
    ``where``: names the config in messages (``'config.json'`` or
    ``'config.json: vision_config'``).
    """
    w = where if where.endswith("vision_config") else f"{where}: vision_config"
    if not isinstance(raw_vision, dict):
        raise ConfigError(f"{w} must be an object, got {short_repr(raw_vision)}.")
    vc = raw_vision
    text_hidden = positive(text_hidden, "text hidden_size", w)
    hidden = _int(vc, "vt_hidden_size", 1024, w)
    heads = _int(vc, "vt_num_attention_heads", 12, w, limit=16384)
    # absent: KimiK3VisionConfig's 1536; null: Moonshot's encoder falls back to the hidden size
    qkv = _int(vc, "qkv_hidden_size", hidden, w) if "qkv_hidden_size" in vc else 1536
    if qkv % heads:
        raise ConfigError(
            f"{w}: qkv_hidden_size {qkv} is not divisible by vt_num_attention_heads {heads}."
        )
    if (qkv // heads) % 4:
        raise ConfigError(
            f"{w}: the vision head dim (qkv_hidden_size / vt_num_attention_heads = "
            f"{qkv // heads}) must be a multiple of 4 for the 2-D rotary embedding."
        )
    merge = vc.get("merge_kernel_size")
    merge = [2, 2] if merge is None else merge
    if not isinstance(merge, list | tuple) or len(merge) != 2:
        raise ConfigError(
            f"{w}: 'merge_kernel_size' must be two integers, got {short_repr(merge)}."
        )
    merge = tuple(positive(m, "merge_kernel_size", w) for m in merge)
    mm_hidden = _int(vc, "mm_hidden_size", hidden, w)
    if mm_hidden != hidden:
        raise ConfigError(
            f"{w}: mm_hidden_size {mm_hidden} differs from vt_hidden_size {hidden}; the "
            f"projector takes the encoder's tokens, so the two must be equal."
        )
    stated = vc.get("text_hidden_size")
    if stated is not None and stated != text_hidden:
        raise ConfigError(
            f"{w}: text_hidden_size {short_repr(stated)} differs from the text model's "
            f"hidden_size {text_hidden}; the projector would not feed the decoder."
        )
    _choice(vc, "activation_func", ENCODER_ACTS[0], ENCODER_ACTS, w)
    _choice(vc, "projector_hidden_act", PROJECTOR_ACTS[0], PROJECTOR_ACTS, w)
    return K3VisionConfig(
        hidden_size=hidden,
        num_layers=_int(vc, "vt_num_hidden_layers", 27, w, limit=4096),
        num_heads=heads,
        qkv_hidden_size=qkv,
        intermediate_size=_int(vc, "vt_intermediate_size", 4096, w),
        patch_size=_int(vc, "patch_size", 14, w, limit=4096),
        pos_emb_height=_int(vc, "init_pos_emb_height", 64, w, limit=65536),
        pos_emb_width=_int(vc, "init_pos_emb_width", 64, w, limit=65536),
        pos_emb_time=_int(vc, "init_pos_emb_time", 4, w, limit=65536),
        pos_emb_type=_choice(vc, "pos_emb_type", "divided_fixed", ("divided_fixed",), w),
        pos_emb_interpolation=_choice(
            vc, "pos_emb_interpolation_mode", "bilinear", INTERPOLATION_MODES, w
        ),
        merge_kernel_size=merge,
        merge_type=_choice(vc, "merge_type", "sd2_tpool", ("sd2_tpool",), w),
        norm_type=_choice(vc, "norm_type", "rmsnorm", NORM_TYPES, w),
        mlp_type=_choice(vc, "mlp_type", "mlp2", ("mlp2",), w),
        attn_bias=_flag(vc, "attn_bias", False, w),
        linear_bias=_flag(vc, "linear_bias", False, w),
        patch_embed_bias=_flag(vc, "patch_embed_proj_bias", False, w),
        projector_type=_choice(vc, "mm_projector_type", "patchmergerv2", ("patchmergerv2",), w),
        mm_hidden_size=mm_hidden,
        projector_eps=finite(vc.get("projector_ln_eps"), "projector_ln_eps", w, 1e-5),
        text_hidden_size=text_hidden,
    )


def vision_rows() -> list[T]:
    """Every ``vision_tower.*`` / ``mm_projector.*`` tensor of Moonshot's state dict.

    Rows read ``c.vision`` (a :class:`K3VisionConfig`) and ``c.text.hidden_size``.
    Unit keys (``runtime.source.entry_key``): ``vision.{patch_embed,pos_emb,
    final_layernorm}``, ``blocks.{B}.vision.{norm0,norm1,wqkv,wo,fc0,fc1}``,
    ``projector.{proj_in,proj_out,post_norm}``; biases add ``_bias``.
    """
    D = lambda c: c.vision.hidden_size  # noqa: E731
    Q = lambda c: c.vision.qkv_hidden_size  # noqa: E731
    I = lambda c: c.vision.intermediate_size  # noqa: E731, E741
    M = lambda c: c.vision.merged_size  # noqa: E731
    H = lambda c: c.text.hidden_size  # noqa: E731
    B = "vision_tower.encoder.blocks.{B}."
    norm_bias = lambda c: c.vision.has_norm_bias  # noqa: E731

    def linear(name, kind, out, inp, bias=None, scope="vision_block", comp="vision"):
        rows = [T(f"{name}.weight", scope, comp, kind, lambda c: (out(c), inp(c)))]
        if bias is not None:
            rows.append(
                T(f"{name}.bias", scope, comp, f"{kind}_bias", lambda c: (out(c),), when=bias)
            )
        return rows

    def norm(name, kind, dim, scope="vision_block", comp="vision", bias=norm_bias):
        rows = [T(f"{name}.weight", scope, comp, kind, lambda c: (dim(c),), keep=True)]
        if bias is not None:
            rows.append(T(f"{name}.bias", scope, comp, kind, lambda c: (dim(c),), keep=True,
                          when=bias))  # fmt: skip
        return rows

    attn_bias = lambda c: c.vision.attn_bias  # noqa: E731
    mlp_bias = lambda c: c.vision.linear_bias  # noqa: E731
    return [
        T("vision_tower.patch_embed.proj.weight", "global", "vision", "patch_embed",
          lambda c: (D(c), 3, c.vision.patch_size, c.vision.patch_size), keep=True),
        T("vision_tower.patch_embed.proj.bias", "global", "vision", "patch_embed_bias",
          lambda c: (D(c),), keep=True, when=lambda c: c.vision.patch_embed_bias),
        T("vision_tower.patch_embed.pos_emb.weight", "global", "vision", "pos_emb",
          lambda c: (c.vision.pos_emb_height, c.vision.pos_emb_width, D(c)), keep=True),
        *norm(B + "norm0", "norm0", D),
        *norm(B + "norm1", "norm1", D),
        *linear(B + "wqkv", "wqkv", lambda c: 3 * Q(c), D, attn_bias),
        *linear(B + "wo", "wo", D, Q, attn_bias),
        *linear(B + "mlp.fc0", "fc0", I, D, mlp_bias),
        *linear(B + "mlp.fc1", "fc1", D, I, mlp_bias),
        *norm("vision_tower.encoder.final_layernorm", "final_layernorm", D, "global"),
        *linear("mm_projector.proj.0", "proj_in", M, M, None, "global", "projector"),
        *linear("mm_projector.proj.2", "proj_out", H, M, None, "global", "projector"),
        *norm("mm_projector.post_norm", "post_norm", H, "global", "projector", None),
    ]  # fmt: skip

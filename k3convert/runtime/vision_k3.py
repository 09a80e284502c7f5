"""Kimi K3 image / video path: MoonViT3d encoder, temporal-pooling 2x2 merge, patchmergerv2.

Inputs follow Moonshot's K3 processor: ``pixel_values`` [num_patches, 3, p, p] (also
accepted flat as [num_patches, 3 * p * p]): the patches of every image or clip
concatenated, each in frame-major, then row-major, then column-major order; and
``grid_thws`` [num_media, 3] integers (frames, patch rows, patch columns). A still image
has t = 1; a clip of t frames holds t * h * w patches and gives h * w / (kh * kw) tokens
(its frames are averaged after the encoder).

Numerics follow Moonshot's modules in the compute dtype: the encoder's RMSNorms take
torch's default eps, the machine epsilon of the compute dtype (float32: 1.2e-7,
bfloat16: 2^-7), while the projector's post-norm takes ``projector_ln_eps``. The 2-D
grid of position embeddings is resampled to each image (``pos_emb_interpolation_mode``);
clips of t > 1 frames add a fixed sin-cos term of the frame index (frame 0 included),
still images add none. The rotary embedding rotates interleaved (even, odd) pairs of
each head: pair 2i by the patch column, pair 2i + 1 by the patch row, both at frequency
10000^(-4i / head_dim); ``wqkv`` is used as stored, so linear hooks see it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..arch.kimi_k3_vision import ROPE_MAX_SIDE, K3VisionConfig, parse_vision
from ..errors import ConfigError
from .ops import layer_norm, rms_norm
from .source import Weights

ROPE_THETA = 10000.0
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, what Moonshot's layernorm variant uses
TIME_THETA = 10000.0


@dataclass(frozen=True)
class VisionSettingsK3:
    hidden_size: int
    num_heads: int
    head_dim: int
    num_layers: int
    patch_size: int
    merge: tuple[int, int]
    pos_emb_hw: tuple[int, int]
    pos_emb_time: int
    interpolation: str
    norm_type: str
    proj_eps: float
    image_token_id: int
    video_token_id: int | None = None


def vision_settings_k3(raw: dict, cfg, where: str) -> VisionSettingsK3:
    """Settings from config.json (``raw``) and the parsed config (``cfg.vision``)."""
    v = getattr(cfg, "vision", None)
    if not isinstance(v, K3VisionConfig):
        text = getattr(cfg, "text", cfg)
        v = parse_vision(raw.get("vision_config"), text.hidden_size, where)
    tok = getattr(cfg, "image_token_id", None)
    if tok is None:
        tok = raw.get("media_placeholder_token_id", 163605)
    if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
        raise ConfigError(
            f"{where}: 'media_placeholder_token_id' must be a token id, got {tok!r:.60}."
        )
    return VisionSettingsK3(
        hidden_size=v.hidden_size,
        num_heads=v.num_heads,
        head_dim=v.head_dim,
        num_layers=v.num_layers,
        patch_size=v.patch_size,
        merge=v.merge_kernel_size,
        pos_emb_hw=(v.pos_emb_height, v.pos_emb_width),
        pos_emb_time=v.pos_emb_time,
        interpolation=v.pos_emb_interpolation,
        norm_type=v.norm_type,
        proj_eps=v.projector_eps,
        image_token_id=tok,
        video_token_id=None,
    )


def check_grid_k3(
    vs: VisionSettingsK3, pixel_values: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    """-> pixel_values as [N, 3, p, p]; errors say what does not add up and what to do."""
    p = vs.patch_size
    if not isinstance(grid, torch.Tensor) or grid.ndim != 2 or grid.shape[1] != 3:
        shape = tuple(grid.shape) if isinstance(grid, torch.Tensor) else type(grid).__name__
        raise ConfigError(
            f"grid_thws (image_grid_thw) must be [num_images, 3] (frames, patch rows, patch "
            f"columns), got {shape}."
        )
    if grid.dtype.is_floating_point or grid.dtype.is_complex or grid.dtype == torch.bool:
        raise ConfigError(f"grid_thws must hold integers, got {grid.dtype}.")
    if grid.numel() == 0:
        raise ConfigError("grid_thws describes no image; pass at least one row (t, h, w).")
    if bool((grid < 1).any()):
        bad = grid[(grid < 1).any(-1)][0].tolist()
        raise ConfigError(
            f"grid_thws entries must be positive (frames, rows, cols >= 1), got {bad}."
        )
    if not isinstance(pixel_values, torch.Tensor) or not pixel_values.dtype.is_floating_point:
        what = pixel_values.dtype if isinstance(pixel_values, torch.Tensor) else type(pixel_values)
        raise ConfigError(f"pixel_values must be a floating-point tensor, got {what}.")
    if pixel_values.ndim == 2 and pixel_values.shape[1] == 3 * p * p:
        pixel_values = pixel_values.reshape(-1, 3, p, p)
    elif pixel_values.ndim == 4 and tuple(pixel_values.shape[1:]) == (3, p, p):
        pass
    else:
        raise ConfigError(
            f"pixel_values must be [num_patches, 3, {p}, {p}] (patch_size {p}), got "
            f"{tuple(pixel_values.shape)}."
        )
    total = int(grid.prod(-1).sum())
    if total != pixel_values.shape[0]:
        raise ConfigError(
            f"grid_thws describes {total} patches but pixel_values holds "
            f"{pixel_values.shape[0]}; pass the processor's pixel_values and grid_thws together."
        )
    kh, kw = vs.merge
    for t, h, w in grid.tolist():
        if h % kh or w % kw:
            raise ConfigError(
                f"image grid {[t, h, w]} is not divisible by the merge kernel {kh}x{kw}; "
                f"resize images to a multiple of {kh * p}x{kw * p} pixels."
            )
        if t > vs.pos_emb_time:
            raise ConfigError(
                f"a clip of {t} frames (grid {[t, h, w]}) exceeds init_pos_emb_time = "
                f"{vs.pos_emb_time}, the frames the position embedding covers; split the clip."
            )
        if h > ROPE_MAX_SIDE or w > ROPE_MAX_SIDE:
            raise ConfigError(
                f"image grid {[t, h, w]} has more than {ROPE_MAX_SIDE} patches on a side, "
                f"beyond the encoder's rotary table; resize the image to at most "
                f"{ROPE_MAX_SIDE * p} pixels per side."
            )
    if not bool(torch.isfinite(pixel_values).all()):
        raise ConfigError("pixel_values hold NaN or infinite values; check the image pipeline.")
    return pixel_values


def _time_table(dim: int, frames: int) -> torch.Tensor:
    """[frames, dim]: sin of frame * 10000^(-2j/dim) in the first half, cos in the second."""
    j = torch.arange(dim // 2, dtype=torch.float64)
    ang = torch.arange(frames, dtype=torch.float64)[:, None] * TIME_THETA ** (-2.0 * j / dim)
    return torch.cat((ang.sin(), ang.cos()), dim=1).float()


def _position_embedding(vs: VisionSettingsK3, table: torch.Tensor, grid: list) -> torch.Tensor:
    """Learned [H0, W0, D] grid resampled to each image, plus the frame term of clips."""
    out = []
    src = None
    for t, h, w in grid:
        if (h, w) == tuple(table.shape[:2]):
            pe = table.reshape(h * w, -1).float()
        else:
            if src is None:
                src = table.float().permute(2, 0, 1)[None]  # [1, D, H0, W0]
            pe = F.interpolate(src, size=(h, w), mode=vs.interpolation)[0]
            pe = pe.flatten(1).transpose(0, 1)  # [h*w, D]
        if t > 1:
            time = _time_table(table.shape[-1], t).to(pe.device)
            pe = (pe[None] + time[:, None, :]).reshape(t * h * w, -1)
        out.append(pe)
    return torch.cat(out)


def _rotary(vs: VisionSettingsK3, grid: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [N, head_dim / 2], one angle per interleaved pair of a head."""
    quarter = vs.head_dim // 4
    freq = ROPE_THETA ** (-torch.arange(quarter, dtype=torch.float32) * 4 / vs.head_dim)
    parts = []
    for t, h, w in grid:
        rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)
        cols = torch.arange(w, dtype=torch.float32).repeat(h)
        ang = torch.stack((cols[:, None] * freq, rows[:, None] * freq), dim=-1)  # [hw, q, 2]
        parts.append(ang.reshape(h * w, 2 * quarter).repeat(t, 1))
    ang = torch.cat(parts).to(device)
    return ang.cos(), ang.sin()


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d]: rotate each (even, odd) pair by its angle; float32 math."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)


def _norm(vs: VisionSettingsK3, w: Weights, key: str, x: torch.Tensor) -> torch.Tensor:
    if vs.norm_type == "layernorm":
        return layer_norm(x, w.need(key), w.need(key + "_bias"), LAYER_NORM_EPS)
    return rms_norm(x, w.need(key), torch.finfo(x.dtype).eps)


def _merge(vs: VisionSettingsK3, x: torch.Tensor, grid: list) -> torch.Tensor:
    """kh x kw neighbourhoods -> one token of kh*kw*D each, frames averaged: [M, kh*kw*D]."""
    kh, kw = vs.merge
    out = []
    for part, (t, h, w) in zip(x.split([t * h * w for t, h, w in grid]), grid, strict=True):
        g = part.view(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5)
        g = g.float().mean(0) if t > 1 else g[0]
        out.append(g.reshape((h // kh) * (w // kw), -1).to(x.dtype))
    return torch.cat(out)


def encode_images_k3(vs: VisionSettingsK3, lin, w: Weights, pixel_values, grid_thw, dtype):
    """-> image / clip token embeddings [num_merged_tokens, text_hidden] in ``dtype``, the
    tokens of each grid_thw row in order (h * w / (kh * kw) per row).

    ``lin(w, key, x)`` runs every Linear (``blocks.{B}.vision.{wqkv,wo,fc0,fc1}``,
    ``projector.{proj_in,proj_out}``)."""
    patch = w.need("vision.patch_embed")
    pv = check_grid_k3(vs, pixel_values, grid_thw).to(device=patch.device, dtype=dtype)
    grid = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
    x = F.conv2d(pv, patch, w.get("vision.patch_embed_bias"), stride=vs.patch_size).flatten(1)
    x = (x.float() + _position_embedding(vs, w.need("vision.pos_emb"), grid)).to(dtype)
    cos, sin = _rotary(vs, grid, x.device)
    lengths = [t * h * ww for t, h, ww in grid]
    nh, hd = vs.num_heads, vs.head_dim
    for b in range(vs.num_layers):
        p = f"blocks.{b}.vision."
        qkv = lin(w, p + "wqkv", _norm(vs, w, p + "norm0", x)).view(-1, 3, nh, hd)
        q, k, v = _rotate_pairs(qkv[:, 0], cos, sin), _rotate_pairs(qkv[:, 1], cos, sin), qkv[:, 2]
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]
            )
            outs.append(o[0].transpose(0, 1).reshape(-1, nh * hd))
        x = x + lin(w, p + "wo", torch.cat(outs))
        h = lin(w, p + "fc0", _norm(vs, w, p + "norm1", x))
        x = x + lin(w, p + "fc1", F.gelu(h, approximate="tanh"))
    x = _norm(vs, w, "vision.final_layernorm", x)
    merged = _merge(vs, x, grid)
    y = lin(w, "projector.proj_out", F.gelu(lin(w, "projector.proj_in", merged)))
    return rms_norm(y, w.need("projector.post_norm"), vs.proj_eps)

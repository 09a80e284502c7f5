"""Kimi-K2.5 image path: MoonViT encoder, 2x2 patch merge, mm_projector.

Inputs follow the Kimi-K2.5 processor: ``pixel_values`` [num_patches, 3, p, p] (patches
of all images concatenated, each image in raster order) and ``image_grid_thw``
[num_images, 3] (frames, patch rows, patch columns).

The fused ``wqkv`` is stored as the original checkpoint has it: q and k rows interleave
the two members of each rotary pair per head. Instead of permuting the weight, the q / k
outputs are de-interleaved after the (hooked) linear, which gives the rotate-half layout
the 2-D rotary below is written for; hooks therefore see ``wqkv`` exactly as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..arch.base import finite, positive
from ..errors import ConfigError
from .ops import activation, layer_norm
from .source import Weights

VISION_NORM_EPS = 1e-5


@dataclass(frozen=True)
class VisionSettings:
    hidden_size: int
    num_heads: int
    num_layers: int
    patch_size: int
    merge: tuple[int, int]
    pos_emb_time: int
    rope_theta: float
    act: object
    proj_eps: float
    image_token_id: int
    video_token_id: int | None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def vision_settings(raw: dict, cfg, where: str) -> VisionSettings:
    vc = raw.get("vision_config") or {}
    rp = vc.get("rope_parameters") or {}
    rt = rp.get("rope_type") or rp.get("type") or "axial"
    if rt not in ("axial", "default"):
        raise ConfigError(f"{where}: vision_config rope type '{rt}' is not supported (axial).")
    v = cfg.vision
    if (v.hidden_size // v.num_heads) % 4:
        raise ConfigError(
            f"{where}: vision head dim {v.hidden_size // v.num_heads} must be a multiple of 4 "
            f"for 2-D rotary embeddings."
        )
    return VisionSettings(
        hidden_size=v.hidden_size,
        num_heads=v.num_heads,
        num_layers=v.num_layers,
        patch_size=v.patch_size,
        merge=v.merge_kernel_size,
        pos_emb_time=positive(vc.get("pos_emb_time") or 4, "pos_emb_time", f"{where}: vision"),
        rope_theta=finite(
            rp.get("rope_theta", vc.get("rope_theta")), "rope_theta", f"{where}: vision", 1e4
        ),
        act=activation(vc.get("hidden_act") or "gelu_pytorch_tanh", f"{where}: vision_config"),
        proj_eps=finite(
            raw.get("projection_layer_norm_eps"), "projection_layer_norm_eps", where, 1e-5
        ),
        image_token_id=cfg.image_token_id,
        video_token_id=raw.get("video_token_id"),
    )


def check_grid(vs: VisionSettings, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """pixel_values as [N, 3, p, p]; errors say what does not add up."""
    p = vs.patch_size
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise ConfigError(
            f"image_grid_thw must be [num_images, 3] (frames, rows, cols), got {tuple(grid.shape)}."
        )
    if grid.dtype.is_floating_point or grid.dtype == torch.bool or grid.numel() == 0:
        raise ConfigError(
            f"image_grid_thw must hold integers for at least one image, got {grid.dtype} "
            f"{tuple(grid.shape)}."
        )
    if bool((grid < 1).any()):
        bad = grid[(grid < 1).any(-1)][0].tolist()
        raise ConfigError(
            f"image_grid_thw entries must be positive (frames, rows, cols >= 1), got {bad}."
        )
    if pixel_values.ndim == 2 and pixel_values.shape[1] == 3 * p * p:
        pixel_values = pixel_values.view(-1, 3, p, p)
    elif pixel_values.ndim >= 4 and tuple(pixel_values.shape[-3:]) == (3, p, p):
        pixel_values = pixel_values.reshape(-1, 3, p, p)
    else:
        raise ConfigError(
            f"pixel_values must be [num_patches, 3, {p}, {p}] (patch_size {p}), got "
            f"{tuple(pixel_values.shape)}."
        )
    if not bool(torch.isfinite(pixel_values).all()):
        raise ConfigError("pixel_values hold NaN or infinite values; check the image pipeline.")
    total = int(grid.prod(-1).sum())
    if total != pixel_values.shape[0]:
        raise ConfigError(
            f"image_grid_thw describes {total} patches but pixel_values holds "
            f"{pixel_values.shape[0]}; pass the processor's pixel_values and grid together."
        )
    kh, kw = vs.merge
    bad = [g for g in grid.tolist() if g[1] % kh or g[2] % kw]
    if bad:
        raise ConfigError(
            f"image grid {bad[0]} is not divisible by the merge kernel {kh}x{kw}; "
            f"resize images to a multiple of {kh * p}x{kw * p} pixels."
        )
    return pixel_values


def _time_table(vs: VisionSettings) -> torch.Tensor:
    """Sinusoidal per-frame table with a zero row 0 (single frames get no offset)."""
    d = vs.hidden_size
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    f = torch.outer(torch.arange(vs.pos_emb_time, dtype=torch.float32), inv)
    return torch.cat([torch.zeros(1, d), torch.cat([f.sin(), f.cos()], dim=1)])


def _position_embedding(vs: VisionSettings, table: torch.Tensor, grid: list) -> torch.Tensor:
    """Learned [H0, W0, D] grid, bicubic-resampled to each image; plus the frame term."""
    out = []
    time = _time_table(vs).to(table.device)
    src = table.float().permute(2, 0, 1)[None]  # [1, D, H0, W0]
    for t, h, w in grid:
        if (h, w) == tuple(table.shape[:2]):
            pe = table.float()
        else:
            pe = F.interpolate(src, size=(h, w), mode="bicubic", align_corners=False)[0]
            pe = pe.permute(1, 2, 0)
        pe = pe.reshape(1, h * w, -1).expand(t, -1, -1)
        frames = torch.arange(t, device=table.device) + int(t > 1)
        if t > vs.pos_emb_time:
            raise ConfigError(f"a clip of {t} frames exceeds pos_emb_time={vs.pos_emb_time}.")
        out.append((pe + time[frames][:, None, :]).reshape(t * h * w, -1))
    return torch.cat(out)


def _rotary(vs: VisionSettings, grid: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D rotary tables [N, head_dim]: frequency i rotates by column and row in turn."""
    quarter = vs.head_dim // 4
    inv = 1.0 / (vs.rope_theta ** (torch.arange(0, 2 * quarter, 2).float() / (2 * quarter)))
    parts = []
    for t, h, w in grid:
        rows = torch.arange(h).repeat_interleave(w)
        cols = torch.arange(w).repeat(h)
        ang = torch.stack((cols[:, None] * inv, rows[:, None] * inv), dim=-1)  # [hw, q, 2]
        parts.append(ang.flatten(1).repeat(t, 1))
    ang = torch.cat(parts).to(device)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos(), ang.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, d]; rotate halves with cos/sin [N, d]."""
    xf = x.float()
    h = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).to(x.dtype)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[N, heads, d] pairs (x0, x1), (x2, x3)... -> (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def encode_images(vs: VisionSettings, lin, w: Weights, pixel_values, grid_thw, dtype):
    """-> image token embeddings [num_merged_tokens, text_hidden] and their count per image."""
    pv = check_grid(vs, pixel_values, grid_thw).to(device=w.need("vision.patch_embed").device)
    grid = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
    x = F.conv2d(
        pv.to(dtype),
        w.need("vision.patch_embed"),
        w.get("vision.patch_embed_bias"),
        stride=vs.patch_size,
    ).flatten(1)
    x = (x.float() + _position_embedding(vs, w.need("vision.pos_emb"), grid)).to(dtype)
    cos, sin = _rotary(vs, grid, x.device)
    lengths = [t * h * ww for t, h, ww in grid]
    nh, hd = vs.num_heads, vs.head_dim
    for b in range(vs.num_layers):
        p = f"blocks.{b}.vision."
        h = layer_norm(x, w.need(p + "norm0"), w.need(p + "norm0_bias"), VISION_NORM_EPS)
        qkv = lin(w, p + "wqkv", h).view(-1, 3, nh, hd)
        q, k, v = _deinterleave(qkv[:, 0]), _deinterleave(qkv[:, 1]), qkv[:, 2]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]
            )
            outs.append(o[0].transpose(0, 1).reshape(-1, nh * hd))
        x = x + lin(w, p + "wo", torch.cat(outs))
        h = layer_norm(x, w.need(p + "norm1"), w.need(p + "norm1_bias"), VISION_NORM_EPS)
        x = x + lin(w, p + "fc1", vs.act(lin(w, p + "fc0", h)))
    x = layer_norm(
        x, w.need("vision.final_layernorm"), w.need("vision.final_layernorm_bias"), VISION_NORM_EPS
    )
    merged = _merge(vs, x, grid)  # [M, kh*kw, D]
    merged = layer_norm(
        merged, w.need("projector.pre_norm"), w.need("projector.pre_norm_bias"), vs.proj_eps
    )
    merged = merged.reshape(merged.shape[0], -1)
    y = lin(w, "projector.proj_out", F.gelu(lin(w, "projector.proj_in", merged)))
    counts = [h * ww // (vs.merge[0] * vs.merge[1]) for _, h, ww in grid]
    return y, counts


def _merge(vs: VisionSettings, x: torch.Tensor, grid: list) -> torch.Tensor:
    """kh x kw neighbourhoods of each frame -> one token each; frames averaged."""
    kh, kw = vs.merge
    out = []
    for part, (t, h, w) in zip(x.split([t * h * w for t, h, w in grid]), grid, strict=True):
        g = part.float().view(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5)
        g = g.reshape(t, (h // kh) * (w // kw), kh * kw, -1).mean(0)
        out.append(g.to(x.dtype))
    return torch.cat(out)

"""Rotary position embeddings: frequency tables for every scaling type the families use.

Types: ``default``, ``linear`` (positions divided by ``factor``), ``dynamic`` (NTK base
growth once a sequence passes ``max_position_embeddings``), ``yarn`` (per-frequency blend
of interpolation and extrapolation plus an attention factor on cos/sin; DeepSeek's
``mscale`` / ``mscale_all_dim`` form included) and ``llama3`` (wavelength-banded
scaling). Settings are read from the raw config: ``rope_parameters`` (transformers 5) or
``rope_scaling`` + ``rope_theta`` (older files).

cos / sin are computed in float32 and rotation happens in float32, whatever the compute
dtype; the result is cast back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..arch.base import count, finite
from ..errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    dim: int  # rotated dimensions per head
    max_position_embeddings: int
    params: dict

    def get(self, key: str, default=None):
        v = self.params.get(key)
        return default if v is None else v


def rope_config(raw: dict, dim: int, where: str = "config.json") -> RopeConfig:
    """The rope settings of a (text) config dict."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: 'rope_parameters' must be an object, got {params!r}.")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(
            f"{where}: per-layer-type rope_parameters ({', '.join(params)}) are not "
            f"supported by the runtime; use one rope setting for all layers."
        )
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: rope type '{rope_type}' is not supported by the runtime; supported: "
            f"{', '.join(ROPE_TYPES)}."
        )
    theta = finite(params.get("rope_theta", raw.get("rope_theta")), "rope_theta", where, 1e4)
    for k in ("factor", "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
        if params.get(k) is not None:  # mscale 0 means "off" to DeepSeek's configs
            finite(params[k], f"rope_parameters.{k}", where, 1.0, zero=k.startswith("mscale"))
    prf = params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0
    if prf != 1.0:
        raise ConfigError(
            f"{where}: partial_rotary_factor={prf} is not supported by the runtime for "
            f"{raw.get('model_type')}."
        )
    max_pos = count(raw.get("max_position_embeddings"), "max_position_embeddings", where)
    params = dict(params)
    if rope_type in ("yarn", "llama3"):
        omax = raw.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings"
        )
        params["original_max_position_embeddings"] = omax or max_pos
        if not params["original_max_position_embeddings"]:
            raise ConfigError(
                f"{where}: rope type {rope_type} needs original_max_position_embeddings "
                f"or max_position_embeddings."
            )
    if rope_type in ("linear", "dynamic", "llama3") and params.get("factor") is None:
        raise ConfigError(f"{where}: rope type {rope_type} needs rope_parameters.factor.")
    if rope_type == "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            if params.get(k) is None:
                raise ConfigError(f"{where}: rope type llama3 needs rope_parameters.{k}.")
    if rope_type == "dynamic" and not max_pos:
        raise ConfigError(f"{where}: rope type dynamic needs max_position_embeddings.")
    return RopeConfig(rope_type, float(theta), int(dim), max_pos, params)


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exps)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rc: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, theta = rc.dim, rc.theta
    omax = rc.params["original_max_position_embeddings"]
    factor = rc.get("factor") or rc.max_position_embeddings / omax
    attn = rc.get("attention_factor")
    if attn is None:
        m, m_all = rc.get("mscale"), rc.get("mscale_all_dim")
        attn = (
            yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
            if m and m_all
            else yarn_mscale(factor)
        )
    beta_fast, beta_slow = rc.get("beta_fast", 32), rc.get("beta_slow", 1)

    def dim_for(rotations: float) -> float:  # dimension index completing `rotations` turns
        return dim * math.log(omax / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_for(beta_fast), dim_for(beta_slow)
    if rc.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra, inter = 1.0 / pos, 1.0 / (factor * pos)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return inter * (1 - keep) + extra * keep, float(attn)


def _llama3(rc: RopeConfig) -> torch.Tensor:
    inv = _base_inv_freq(rc.theta, rc.dim)
    factor = rc.params["factor"]
    lo_f, hi_f = rc.params["low_freq_factor"], rc.params["high_freq_factor"]
    old = rc.params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo_f, inv / factor, inv)
    smooth = (old / wavelen - lo_f) / (hi_f - lo_f)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi_f) & (wavelen <= old / lo_f)
    return torch.where(medium, blended, scaled)


class Rotary:
    """cos / sin tables for positions; ``attention_scaling`` multiplies both."""

    def __init__(self, rc: RopeConfig):
        self.rc = rc
        self.attention_scaling = 1.0
        t = rc.rope_type
        if t == "yarn":
            self.inv_freq, self.attention_scaling = _yarn(rc)
        elif t == "llama3":
            self.inv_freq = _llama3(rc)
        else:
            self.inv_freq = _base_inv_freq(rc.theta, rc.dim)
            if t == "linear":
                self.inv_freq = self.inv_freq / rc.params["factor"]

    def _inv_freq_for(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.rc.rope_type != "dynamic":
            return self.inv_freq
        seq_len = int(position_ids.max()) + 1
        mp = self.rc.max_position_embeddings
        if seq_len <= mp:
            return self.inv_freq
        d, f = self.rc.dim, self.rc.params["factor"]
        base = self.rc.theta * ((f * seq_len / mp) - (f - 1)) ** (d / (d - 2))
        return _base_inv_freq(base, d)

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: [B, S] -> cos, sin: [B, S, dim] float32 (frequencies repeated twice)."""
        inv = self._inv_freq_for(position_ids).to(position_ids.device)
        freqs = position_ids.to(torch.float32)[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves. x: [B, heads, S, D]; cos/sin: [B, S, D]."""
    xf = x.float()
    c, s = cos[:, None], sin[:, None]
    return (xf * c + _rotate_half(xf) * s).to(x.dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek's layout).

    The result is laid out de-interleaved (all first members, then all second members);
    queries and keys both get this layout, so their dot products are unchanged.
    """
    xf = x.float()
    h = cos.shape[-1] // 2
    c, s = cos[:, None, :, :h], sin[:, None, :, :h]
    a, b = xf[..., 0::2], xf[..., 1::2]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)

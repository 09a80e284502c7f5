"""Calibrated FP8 KV-cache scales, as compressed-tensors stores them.

A checkpoint with a quantized KV cache carries, in its ``quantization_config``, a
``kv_cache_scheme`` (a compressed-tensors ``QuantizationArgs``: here FP8 e4m3, one
static symmetric scale per tensor) and, on every attention module that caches keys and
values, two tensors ``<attn>.k_scale`` and ``<attn>.v_scale`` of shape [1] (what
compressed-tensors' ``initialize_qparams`` registers for the ``tensor`` strategy). Serving
engines (vLLM, SGLang) load them as the scales of their FP8 KV cache; verify's runtime
fake-quantizes what enters the cache with them.

What each scale covers:

- GQA: ``k_scale`` the keys after k_norm and rope, ``v_scale`` the values;
- MLA: the cache entry is the normed latent (``kv_a_proj_with_mqa``'s first
  ``kv_lora_rank`` outputs after ``kv_a_layernorm``) joined to the roped shared key,
  quantized as ONE tensor with ``k_scale`` (vLLM's MLA writes its cache with
  ``concat_and_cache_mla(..., scale=k_scale)``); ``v_scale`` is stored equal to it;
- KDA (linear attention) layers keep a recurrent state, no KV cache, and no scale.

scale = max(absmax, TINY) / 448, with 448 the largest e4m3 value. The writer calls
:func:`kv_cache_scheme` and :func:`kv_scale_tensors`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..arch import get_arch, resolve
from ..errors import ArchError, ConfigError
from ..formats import FP8_MAX

#: the smallest absmax a scale is computed from: compressed-tensors clamps scales at
#: float32's eps, so an all-zero observation gives that scale, never 0
TINY = FP8_MAX * float(torch.finfo(torch.float32).eps)
#: what each attention kind observes (Runtime.add_kv_hook kinds)
KINDS = {"gqa": ("k", "v"), "mla": ("latent", "k_rot")}


def kv_cache_scheme() -> dict[str, Any]:
    """The ``quantization_config.kv_cache_scheme`` entry: compressed-tensors'
    serialization of ``QuantizationArgs(num_bits=8, type="float", strategy="tensor",
    dynamic=False, symmetric=True)`` (``model_dump`` as ``QuantizationConfig.to_dict``
    writes it)."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": "tensor",
        "dynamic": False,
    }


def check_scheme(scheme: Any, where: str) -> None:
    """The one kv_cache_scheme the runtime applies: FP8 (8-bit float), per tensor,
    static, symmetric; anything else is refused, naming what differs."""
    if not isinstance(scheme, Mapping):
        raise ConfigError(
            f"{where}: quantization_config.kv_cache_scheme must be an object, got "
            f"{type(scheme).__name__}."
        )
    want = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
            "symmetric": True}  # fmt: skip
    defaults = {"symmetric": True, "dynamic": False}
    bad = [
        f"{k}={scheme.get(k, defaults.get(k))!r} (need {v!r})"
        for k, v in want.items()
        if scheme.get(k, defaults.get(k)) != v
    ]
    if bad:
        raise ConfigError(
            f"{where}: quantization_config.kv_cache_scheme {', '.join(bad)}: only an FP8 "
            f"e4m3 cache with one static symmetric scale per tensor (the scheme "
            f"`quantize --kv-cache fp8` writes) is supported."
        )


def _layout(settings_or_config: Any) -> tuple[str, int, Any]:
    """(family, num_layers, attention_of) of a TextSettings, a Runtime or a config.json."""
    ts = getattr(settings_or_config, "text", settings_or_config)
    if isinstance(settings_or_config, Mapping):
        arch, cfg = resolve(dict(settings_or_config), "config.json")
        return arch.name, cfg_layers(cfg), functools.partial(arch.attention_of, cfg)
    if not hasattr(ts, "attention_of") or not hasattr(ts, "family"):
        raise TypeError(
            "kv_scale_tensors needs the model's TextSettings, a Runtime or a config.json "
            f"dict, not {type(settings_or_config).__name__}"
        )
    return ts.family, len(ts.windows), ts.attention_of


def cfg_layers(cfg: Any) -> int:
    return getattr(cfg, "text", cfg).num_layers


def scale_of(absmax: float, what: str) -> float:
    """max(absmax, TINY) / 448, for a finite non-negative absmax."""
    try:
        a = float(absmax)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: absmax must be a number, got {absmax!r}.") from None
    if not math.isfinite(a) or a < 0:
        raise ConfigError(
            f"{what}: the observed absmax is {a}; a KV-cache scale needs a finite, "
            f"non-negative absmax (non-finite activations reached the cache: check the "
            f"calibration data and the model)."
        )
    return max(a, TINY) / FP8_MAX


def kv_scale_tensors(
    absmax: Mapping[int, Mapping[str, float]],
    settings_or_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The named scale tensors ([1], ``dtype``) from the per-layer observed absmax.

    absmax: ``{layer: {"k": a, "v": a}}`` for GQA layers, ``{layer: {"latent": a,
    "k_rot": a}}`` for MLA layers (MLA: k_scale = v_scale = scale of the max of the two);
    every attention layer must be given, KDA layers must not. settings_or_config: the
    model's :class:`~k3convert.runtime.decoder.TextSettings`, a Runtime, or its
    config.json dict. dtype: compressed-tensors stores the scales in the attention
    module's dtype; float32 keeps them exact (vLLM and the runtime accept any float)."""
    family, n, attention_of = _layout(settings_or_config)
    try:
        prefix = get_arch(family).attention_prefix  # where the family's attention lives
    except ArchError:
        raise ConfigError(
            f"KV-cache scales: no attention naming known for family '{family}'."
        ) from None
    need = [i for i in range(n) if attention_of(i) != "kda"]
    extra = sorted(set(absmax) - set(need))
    if extra:
        kinds = {i: attention_of(i) if 0 <= i < n else "absent" for i in extra}
        raise ConfigError(
            f"KV-cache scales: observations given for layer(s) "
            f"{', '.join(f'{i} ({k})' for i, k in kinds.items())}, which keep no KV cache "
            f"(a model of {n} layers; KDA layers have a recurrent state instead)."
        )
    missing = [i for i in need if i not in absmax]
    if missing:
        raise ConfigError(
            f"KV-cache scales: no observation for attention layer(s) "
            f"{', '.join(map(str, missing[:8]))}; every layer that caches K / V needs one "
            f"(did the calibration run reach them?)."
        )
    out: dict[str, torch.Tensor] = {}
    for i in need:
        kind = attention_of(i)
        seen = absmax[i]
        want = KINDS[kind]
        if set(seen) != set(want):
            raise ConfigError(
                f"KV-cache scales: layer {i} ({kind.upper()}) observes {', '.join(want)}, "
                f"got {', '.join(sorted(seen)) or 'nothing'}."
            )
        p = prefix.format(L=i)
        where = f"layer {i}"
        if kind == "gqa":
            k = scale_of(seen["k"], f"{where} k")
            v = scale_of(seen["v"], f"{where} v")
        else:
            scale_of(seen["latent"], f"{where} latent")
            scale_of(seen["k_rot"], f"{where} k_rot")
            k = v = scale_of(max(float(seen["latent"]), float(seen["k_rot"])), where)
        out[p + "k_scale"] = torch.tensor([k], dtype=dtype)
        out[p + "v_scale"] = torch.tensor([v], dtype=dtype)
    return out


__all__ = ["FP8_MAX", "TINY", "check_scheme", "kv_cache_scheme", "kv_scale_tensors", "scale_of"]

"""Architecture registry: ``model_type`` -> table of tensor roles (see base.py).

Families: ``llama`` (qwen2, qwen3, mistral), ``qwen3_moe`` (mixtral),
``deepseek_v3`` (kimi_k2), ``kimi_k25``, ``kimi_linear``, ``kimi_k3``.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from ..checkpoint import load_json
from ..errors import ConfigError
from . import deepseek_v3, kimi_k3, kimi_k25, kimi_linear, llama, qwen3_moe  # noqa: F401  (registration)
from .base import (
    COMPONENTS,
    SPLITS,
    Arch,
    Instance,
    Role,
    TensorSpec,
    arch_for_config,
    get_arch,
    known_model_types,
)

#: layers x routed experts a config may imply (Kimi K3: 93 x 896 = 83 k)
MAX_LAYER_EXPERTS = 1 << 22


def load_config(path: str | Path) -> dict:
    """config.json from a model directory or the file itself."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"{p}: no config.json found; point at a model directory or its config.")
    return load_json(f)


def resolve(raw: dict, where: str = "config.json") -> tuple[Arch, Any]:
    """(arch, parsed config) for a raw config.json dict."""
    arch = arch_for_config(raw, where)
    cfg = arch.parse_config(raw, where)
    text = getattr(cfg, "text", cfg)
    layers = text.num_layers + getattr(text, "num_mtp", 0)
    if layers * max(getattr(text, "num_experts", 0), 1) > MAX_LAYER_EXPERTS:
        raise ConfigError(
            f"{where}: {layers} layers x {text.num_experts} experts is beyond any real model "
            f"(at most {MAX_LAYER_EXPERTS} expert instances); the config is damaged."
        )
    return arch, cfg


def validate_source(arch: Arch, cfg: Any, source, where: str, *, complete: bool = True):
    """``arch.validate`` over a weight source (a Checkpoint, a Stream, or anything with
    ``names()``; shapes are checked when it also has ``meta(name)``): name -> Match.
    The KV-cache scales must agree with the config's kv_cache_scheme
    (:func:`check_kv_scales`; only a missing scale is let through when not ``complete``)."""
    key = (arch.name, cfg, complete)  # a parsed config compares by value
    try:
        memo = _VALIDATED.setdefault(source, {})
        hit = memo.get(key)
    except TypeError:  # a source or config that cannot be a key: validated every time
        memo, hit = None, None
    if hit is not None:
        return dict(hit)
    meta = getattr(source, "meta", None)
    matched = arch.validate(
        cfg,
        source.names(),
        where,
        shape_of=(lambda n: meta(n).shape) if meta is not None else None,
        file_of=(lambda n: getattr(meta(n), "file", where)) if meta is not None else None,
        complete=complete,
    )
    check_kv_scales(cfg, getattr(source, "config", None), matched, where, complete=complete)
    if memo is not None:
        memo[key] = matched
    return dict(matched)


#: source -> {(arch, config, complete): the names matched}: a source (its names
#: and shapes fixed when it was opened) validated again in one process (``convert``
#: plans, calibrates and writes from the same checkpoint) is not matched again
_VALIDATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: kinds of the KV-cache scale rows (arch.common.kv_scales)
KV_SCALE_KINDS = ("k_scale", "v_scale")


def kv_cache_scheme_of(raw: dict | None) -> dict | None:
    """The ``quantization_config.kv_cache_scheme`` of a config.json dict (top level, or
    inside ``text_config`` as Kimi K3 keeps it), or None."""
    if not isinstance(raw, dict):
        return None
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    if not isinstance(qc, dict):
        return None
    return qc.get("kv_cache_scheme")


def check_kv_scales(
    cfg: Any, raw: dict | None, matched: dict, where: str, *, complete: bool = True
) -> dict[int, dict[str, str]]:
    """KV-cache scales against the config: ``{layer: {"k_scale": name, "v_scale": name}}``.

    A scale needs a ``kv_cache_scheme`` in the quantization_config and the reverse; a
    scheme needs both scales on every attention layer that caches K / V (``complete``);
    the linear-attention (KDA) layers of a hybrid keep no KV cache, so a scale there is
    refused by name. MTP layers may carry scales (serving engines load them); they are
    neither required nor used."""
    text = getattr(cfg, "text", cfg)
    n = text.num_layers
    kda = getattr(text, "is_kda_layer", None)
    scales: dict[int, dict[str, str]] = {}
    for name, m in matched.items():
        if m.role.kind in KV_SCALE_KINDS and m.role.layer is not None:
            scales.setdefault(m.role.layer, {})[m.role.kind] = name
    scheme = kv_cache_scheme_of(raw)
    if scales and scheme is None:
        first = _first(scales)
        raise ConfigError(
            f"{where}: the checkpoint stores {sum(map(len, scales.values()))} KV-cache "
            f"scale tensor(s) ({first}, ...) but config.json's quantization_config has no "
            f"kv_cache_scheme, so nothing says how to use them; add the kv_cache_scheme the "
            f"scales were calibrated for, or remove the scales."
        )
    bad = [scales[i][k] for i in sorted(scales) if kda is not None and i < n and kda(i)
           for k in sorted(scales[i])]  # fmt: skip
    if bad:
        raise ConfigError(
            f"{where}: tensor '{bad[0]}' is a KV-cache scale of layer "
            f"{bad[0].split('layers.')[-1].split('.')[0]}, a linear-attention (KDA) layer that "
            f"keeps no KV cache ({len(bad)} such tensor(s)); remove them."
        )
    if scheme is not None and not isinstance(scheme, dict):
        raise ConfigError(
            f"{where}: quantization_config.kv_cache_scheme must be an object (compressed-"
            f"tensors QuantizationArgs), got {type(scheme).__name__}."
        )
    if scheme is not None and complete:
        want = [i for i in range(n) if kda is None or not kda(i)]
        missing = [f"layer {i} {k}" for i in want for k in KV_SCALE_KINDS
                   if k not in scales.get(i, {})]  # fmt: skip
        if missing:
            more = f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""
            raise ConfigError(
                f"{where}: config.json's quantization_config has a kv_cache_scheme, but the "
                f"checkpoint lacks {len(missing)} of its per-layer scale tensors: "
                f"{', '.join(missing[:4])}{more} (named like "
                f"'model.layers.N.self_attn.k_scale'); re-run quantize with --kv-cache, or "
                f"remove the kv_cache_scheme."
            )
    return scales


def _first(scales: dict[int, dict[str, str]]) -> str:
    i = min(scales)
    return scales[i][min(scales[i])]


__all__ = [
    "COMPONENTS",
    "SPLITS",
    "Arch",
    "Instance",
    "Role",
    "TensorSpec",
    "check_kv_scales",
    "get_arch",
    "known_model_types",
    "kv_cache_scheme_of",
    "load_config",
    "resolve",
    "validate_source",
]

"""Architecture registry: ``model_type`` -> table of tensor roles (see base.py).

Families: ``llama`` (qwen2, qwen3, mistral), ``qwen3_moe`` (mixtral),
``deepseek_v3`` (kimi_k2), ``kimi_k25``, ``kimi_linear``, ``kimi_k3``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    from ..checkpoint import load_json

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
    ``names()``; shapes are checked when it also has ``meta(name)``): name -> Match."""
    meta = getattr(source, "meta", None)
    return arch.validate(
        cfg,
        source.names(),
        where,
        shape_of=(lambda n: meta(n).shape) if meta is not None else None,
        file_of=(lambda n: getattr(meta(n), "file", where)) if meta is not None else None,
        complete=complete,
    )


__all__ = [
    "COMPONENTS",
    "SPLITS",
    "Arch",
    "Instance",
    "Role",
    "TensorSpec",
    "get_arch",
    "known_model_types",
    "load_config",
    "resolve",
    "validate_source",
]

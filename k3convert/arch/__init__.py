"""Architecture registry: ``model_type`` -> table of tensor roles (see base.py).

Families: ``llama`` (qwen2, qwen3, mistral), ``qwen3_moe`` (mixtral),
``deepseek_v3`` (kimi_k2), ``kimi_k25``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import deepseek_v3, kimi_k25, llama, qwen3_moe  # noqa: F401  (registration)
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
    return arch, arch.parse_config(raw, where)


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
]

"""Resolve a device string (cpu, cuda, cuda:1, musa, ...) to a usable torch.device.

The runtime is device-agnostic: it only ever moves tensors with ``.to(device)``. This
module checks up front that the device exists on this machine, importing the backend
plugin that registers it where one is needed (``torch_musa`` for Moore Threads GPUs),
so a wrong or unavailable device is one clear error, not a CUDA assertion mid-forward.
"""

from __future__ import annotations

import importlib

import torch

from .errors import ConfigError

#: out-of-tree backends: device type -> the module whose import registers it
PLUGINS = {"musa": "torch_musa", "npu": "torch_npu"}


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        dev = device
    else:
        kind = str(device).split(":", 1)[0]
        plugin = PLUGINS.get(kind)
        if plugin is not None:
            try:
                importlib.import_module(plugin)
            except ImportError:
                raise ConfigError(
                    f"device '{device}' needs the '{plugin}' package, which is not installed; "
                    f"install it or pick another device (cpu, cuda)."
                ) from None
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ConfigError(
                f"'{device}' is not a torch device; use cpu, cuda, cuda:N, musa, ..."
            ) from None
    if dev.type in ("cpu", "meta"):
        return dev
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ConfigError(
            f"device '{dev}' is not available on this machine (no {dev.type} device, or "
            f"torch {torch.__version__} was built without it); use --device cpu."
        )
    count = getattr(backend, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ConfigError(f"device '{dev}' does not exist: this machine has {count()}.")
    return dev

"""Embedded runtime: our own forward pass, run from any weight source layer by layer.

``Runtime(source, device="cpu", dtype=torch.float32)`` over a checkpoint
(``open_checkpoint``) or, later, a stream reader: ``forward`` for logits, ``embed`` /
``run_layer`` / ``head`` for layer-wise calibration, ``add_hook`` for observers on every
linear. See :mod:`k3convert.runtime.source` for the :class:`WeightSource` protocol.
"""

from .runtime import HookHandle, Runtime, parse_dtype
from .source import UnitLoader, WeightSource

__all__ = ["HookHandle", "Runtime", "UnitLoader", "WeightSource", "parse_dtype"]

"""Parity of a candidate (sharded / quantized) model against a reference: ``k3convert verify``.

The pieces here are model-independent (metrics on logits, thresholds, report, inputs) so
they can be tested exactly without running a model.
"""

from __future__ import annotations

from .metrics import (
    Thresholds,
    check,
    compare_logits,
    default_thresholds,
    locate_divergence,
    rel_l2,
    thresholds_for_quant_config,
)

__all__ = [
    "Thresholds",
    "check",
    "compare_logits",
    "default_thresholds",
    "locate_divergence",
    "rel_l2",
    "thresholds_for_quant_config",
]

"""Quantization: schemes, rules over tensor names / roles, and the streaming writer.

- :mod:`.schemes` - registered schemes (``fp8-block``, ``w4a16``, ...): quantize /
  dequantize one weight into compressed-tensors parts;
- :mod:`.rules` - which tensor gets which scheme (ordered rules, default exceptions),
  the resolved plan and the config_groups / ignore it implies;
- :mod:`.writer` - ``quantize(src=, out=, ...)``: stream a checkpoint into a
  compressed-tensors directory;
- :mod:`.activations` - input-activation fake quantization as compressed-tensors
  computes it, and the spec of a Linear read from a quantization_config;
- :mod:`.packing` - int-N <-> int32 packing (compressed-tensors layout).
"""

from .activations import ActivationSpec, activation_spec_for, fake_quant_activation
from .packing import pack_int32, packed_len, unpack_int32
from .rules import Decision, Plan, Rule, make_rule
from .schemes import (
    FP8Scheme,
    GroupSizeError,
    IntScheme,
    NonFiniteWeightError,
    Scheme,
    UnknownSchemeError,
    WeightRangeError,
    get_scheme,
    known_schemes,
    register,
)

_LAZY = ("QuantizeResult", "plan_quantization", "quantize")


def __getattr__(name: str):
    # the writer imports k3convert.checkpoint, which imports .packing from here: load it
    # on first use so `import k3convert.checkpoint` does not cycle through the writer
    if name in _LAZY:
        from . import writer

        return getattr(writer, name)
    raise AttributeError(f"module 'k3convert.quant' has no attribute '{name}'")


__all__ = [
    "ActivationSpec",
    "Decision",
    "FP8Scheme",
    "GroupSizeError",
    "IntScheme",
    "NonFiniteWeightError",
    "Plan",
    "QuantizeResult",
    "Rule",
    "Scheme",
    "UnknownSchemeError",
    "WeightRangeError",
    "activation_spec_for",
    "fake_quant_activation",
    "get_scheme",
    "known_schemes",
    "make_rule",
    "pack_int32",
    "packed_len",
    "plan_quantization",
    "quantize",
    "register",
    "unpack_int32",
]

"""Quantization: schemes, rules over tensor names / roles, planning and the tensor writer.

- :mod:`.schemes` - registered schemes (``fp8-block``, ``w4a16``, ...): quantize /
  dequantize one weight into compressed-tensors parts;
- :mod:`.rules` - which tensor gets which scheme (ordered rules, default exceptions),
  the resolved plan and the config_groups / ignore it implies;
- :mod:`.planning` - each tensor's decision from the rules and the parts it writes;
- :mod:`.writer` - the tensors of a plan streamed into compressed-tensors shard files
  (the ``quantize`` command around it is :mod:`k3convert.pipeline.quantize`);
- :mod:`.activations` - input-activation fake quantization as compressed-tensors
  computes it, and the spec of a Linear read from a quantization_config.
"""

from .activations import ActivationSpec, activation_spec_for, fake_quant_activation
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

__all__ = [
    "ActivationSpec",
    "Decision",
    "FP8Scheme",
    "GroupSizeError",
    "IntScheme",
    "NonFiniteWeightError",
    "Plan",
    "Rule",
    "Scheme",
    "UnknownSchemeError",
    "WeightRangeError",
    "activation_spec_for",
    "fake_quant_activation",
    "get_scheme",
    "known_schemes",
    "make_rule",
    "register",
]

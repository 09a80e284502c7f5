"""Input-activation quantization, computed exactly the way compressed-tensors does it.

A quantized checkpoint says in ``quantization_config`` how each Linear's input is
quantized at inference: dynamically per token (``fp8-dynamic``, ``w8a8``), dynamically
per group of 128 channels (``fp8-block``), or statically per tensor with a calibrated
``input_scale`` (``fp8``). Parity checks must reproduce what a serving engine does, so
:func:`fake_quant_activation` mirrors ``compressed_tensors.quantization.lifecycle.forward``
(``forward_quantize`` -> ``compute_dynamic_scales_and_zp`` -> ``calculate_qparams`` ->
``_quantize_dequantize``) operation for operation, in the input's own dtype, including
its quirks:

- ``token`` strategy reduces over every dim except the first two, so a 3-D input
  ``[batch, seq, hidden]`` gets one scale per token, but a 2-D input ``[tokens, hidden]``
  (as MoE experts see it) gets ONE scale for the whole tensor;
- min is clamped to <= 0 and max to >= 0 before computing scales (0 stays exact);
- symmetric scale = max|x| / ((q_max - q_min) / 2): amax/448 for FP8, amax/127.5 for int8
  (values are then clamped to [-128, 127]);
- a zero scale is replaced by the eps of the scale dtype.

compressed-tensors is a test dependency only: this module re-implements, and the tests
compare against the library bit for bit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import torch

from ..errors import ConfigError

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0

STRATEGIES = ("token", "tensor", "group")


@dataclass(frozen=True)
class ActivationSpec:
    """How a Linear's input activations are quantized.

    num_bits: 8; type: 'float' (FP8 e4m3) or 'int'; strategy: 'token' | 'tensor' |
    'group'; dynamic: scales computed on the fly from each input (True) or a static
    calibrated ``scale`` (False); group_size: channels per scale for 'group'.
    scale / zero_point: static parameters, shape [1] (``input_scale`` /
    ``input_zero_point`` of the checkpoint); None for dynamic specs.
    """

    num_bits: int = 8
    type: str = "float"
    strategy: str = "token"
    dynamic: bool = True
    symmetric: bool = True
    group_size: int | None = None
    scale: torch.Tensor | None = field(default=None, compare=False, repr=False)
    zero_point: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.type not in ("float", "int"):
            raise ConfigError(f"activation type must be 'float' or 'int', not '{self.type}'.")
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"activation strategy '{self.strategy}' is not supported; use one of "
                f"{', '.join(STRATEGIES)}."
            )
        if self.type == "float" and self.num_bits != 8:
            raise ConfigError("float activations must be 8-bit (FP8 e4m3).")
        if self.strategy == "group" and not self.group_size:
            raise ConfigError("group activation quantization needs a group_size.")
        if not self.dynamic and self.strategy != "tensor":
            raise ConfigError("static activation quantization is per tensor only.")

    def with_scale(
        self, scale: torch.Tensor, zero_point: torch.Tensor | None = None
    ) -> ActivationSpec:
        return replace(self, scale=scale, zero_point=zero_point)

    def ct_args(self) -> dict:
        """The compressed-tensors ``QuantizationArgs`` dict for config.json."""
        return {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "dynamic": self.dynamic,
            "actorder": None,
            "observer": None if self.dynamic else "minmax",
            "observer_kwargs": {},
        }

    @classmethod
    def from_ct_args(cls, args: dict) -> ActivationSpec:
        """From a config.json ``input_activations`` dict (compressed-tensors format)."""
        strategy = args.get("strategy")
        group = args.get("group_size")
        if strategy is None:  # compressed-tensors infers it from group_size
            strategy = "tensor" if group is None else ("group" if group > 0 else "channel")
        dyn = args.get("dynamic", False)
        if isinstance(dyn, str):
            raise ConfigError(f"input_activations.dynamic='{dyn}' (local) is not supported.")
        return cls(
            num_bits=int(args.get("num_bits", 8)),
            type=str(args.get("type", "int")).lower(),
            strategy=str(strategy).lower(),
            dynamic=bool(dyn),
            symmetric=bool(args.get("symmetric", True)),
            group_size=group,
        )

    # -- range -------------------------------------------------------------------------
    def qrange(self) -> tuple[float, float]:
        if self.type == "float":
            return -FP8_MAX, FP8_MAX
        half = 2.0**self.num_bits / 2
        return -half, half - 1


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 1.0


def _qparams(
    min_vals: torch.Tensor, max_vals: torch.Tensor, spec: ActivationSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors ``calculate_qparams`` (no global scale, no scale_dtype)."""
    min_vals = torch.min(min_vals, torch.zeros_like(min_vals))
    max_vals = torch.max(max_vals, torch.zeros_like(max_vals))
    q_min, q_max = spec.qrange()
    bit_range = torch.tensor(q_max - q_min, dtype=torch.float32)
    if spec.symmetric:
        max_pos = torch.max(torch.abs(min_vals), torch.abs(max_vals))
        scales = max_pos / (bit_range.to(max_pos.dtype) / 2)
        zps = torch.zeros(scales.shape, dtype=min_vals.dtype)
    else:
        scales = (max_vals - min_vals) / bit_range.to(max_vals.dtype)
        zps = torch.clamp(q_min - (min_vals / scales), q_min, q_max)
    scales = torch.where(scales == 0, torch.tensor(_eps(scales.dtype), dtype=scales.dtype), scales)
    if spec.type == "float":
        zps = torch.clamp(zps, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        zps = torch.round(torch.clamp(zps, -128, 127)).to(torch.int8)
    if scales.ndim == 0:
        scales, zps = scales.reshape(1), zps.reshape(1)
    return scales, zps


def _qdq(
    x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: ActivationSpec
) -> torch.Tensor:
    """compressed-tensors ``_quantize_dequantize``: stays in x's dtype, no int storage."""
    q_min, q_max = spec.qrange()
    scaled = x / scale
    if zp is not None:
        scaled = scaled + zp.to(x.dtype)
    orig = scaled.dtype
    scaled = torch.clamp(scaled, torch.tensor(q_min), torch.tensor(q_max))
    if spec.type == "float":
        rounded = scaled.to(torch.float8_e4m3fn).to(orig)
    else:
        rounded = torch.round(scaled).to(orig)
    out = rounded.to(scale.dtype)
    if zp is not None:
        out = out - zp.to(scale.dtype)
    return out * scale


def fake_quant_activation(x: torch.Tensor, spec: ActivationSpec | None) -> torch.Tensor:
    """Quantize-dequantize a Linear input as compressed-tensors does at inference.

    x: [..., in_features] (any float dtype; computed in that dtype)
    -> same shape. ``spec=None`` returns x unchanged. Static specs need ``spec.scale``
    (the checkpoint's ``input_scale``, shape [1]).
    """
    if spec is None or x.numel() == 0:
        return x
    if spec.strategy == "group" and x.shape[-1] % spec.group_size:
        # compressed-tensors fails here too (unflatten): there is no reference behaviour
        raise ValueError(
            f"input of {x.shape[-1]} channels is not divisible by the activation group "
            f"size {spec.group_size}"
        )
    if spec.dynamic:
        value = x
        if spec.strategy == "token":
            reduce_dims = tuple(i for i in range(x.ndim) if i not in (0, 1))
            keep = True
        elif spec.strategy == "tensor":
            reduce_dims = ()
            keep = True
        else:  # group
            reduce_dims = -1
            keep = False
            value = x.unflatten(-1, (math.ceil(x.shape[-1] / spec.group_size), spec.group_size))
        if reduce_dims == ():
            mn, mx = torch.aminmax(value)
        else:
            mn = torch.amin(value, dim=reduce_dims, keepdim=keep)
            mx = torch.amax(value, dim=reduce_dims, keepdim=keep)
        scale, zp = _qparams(mn, mx, spec)
    else:
        if spec.scale is None:
            raise ConfigError(
                "static activation quantization needs the checkpoint's input_scale; "
                "pass it with ActivationSpec.with_scale()."
            )
        scale = spec.scale
        zp = spec.zero_point
    if spec.strategy == "group":
        g = spec.group_size
        while scale.ndim < 2:
            scale = scale.unsqueeze(1)
            zp = zp.unsqueeze(1) if zp is not None else None
        xg = x.unflatten(-1, (x.shape[-1] // g, g))
        out = _qdq(xg, scale.unsqueeze(-1), zp.unsqueeze(-1) if zp is not None else None, spec)
        return out.flatten(start_dim=-2).to(x.dtype)
    return _qdq(x, scale, zp, spec)


# -- reading a quantization_config ------------------------------------------------------
def _match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _quant_config(config: dict) -> dict | None:
    if "config_groups" in config or config.get("quant_method") == "compressed-tensors":
        return config
    qc = config.get("quantization_config") or config.get("compression_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    return qc


def activation_spec_for(
    config: dict,
    tensor_name: str,
    input_scale: torch.Tensor | None = None,
    input_zero_point: torch.Tensor | None = None,
) -> ActivationSpec | None:
    """The input-activation spec of the Linear owning ``tensor_name``, or None.

    config: a config.json dict (or its ``quantization_config``) in the compressed-tensors
    format. tensor_name: ``model.layers.0.self_attn.q_proj.weight`` (or the module name).
    Resolution follows compressed-tensors: a module in ``ignore`` is unquantized; among
    the config groups' targets, exact names win over ``re:`` patterns, which win over the
    class target ``Linear`` (the module is assumed to be a Linear); a target listed by
    two groups belongs to the later one. Static specs carry ``input_scale`` when given.
    """
    qc = _quant_config(config)
    if not qc or qc.get("quant_method", "compressed-tensors") != "compressed-tensors":
        return None
    module = tensor_name.removesuffix(".weight")
    if any(_match(module, ig) for ig in qc.get("ignore") or []):
        return None
    target_to_scheme: dict[str, dict] = {}
    for g in (qc.get("config_groups") or {}).values():
        if isinstance(g, dict):
            for t in g.get("targets") or []:
                target_to_scheme[t] = g
    ordered = sorted(target_to_scheme, key=lambda t: ("re:" in t, t))
    hits = [t for t in ordered if _match(module, t)]
    hits += [t for t in ordered if t == "Linear" and t not in hits]
    if not hits:
        return None
    args = target_to_scheme[hits[0]].get("input_activations")
    if not args:
        return None
    spec = ActivationSpec.from_ct_args(args)
    if not spec.dynamic and input_scale is not None:
        spec = spec.with_scale(input_scale, input_zero_point)
    return spec

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

NVFP4 inputs (``tensor_group``, ``dynamic: "local"``): one FP4 E2M1 scale per 16
channels computed on the fly, as ``global_scale * amax / 6`` rounded to e4m3 (zero ->
0.125, the e4m3 eps), with the Linear's static ``input_global_scale``; values are
divided by ``scale / global_scale`` in float32, clamped to [-6, 6] and rounded to E2M1
(ties to even), then multiplied back. The global scale comes from calibration
(llm-compressor's static min/max observer); an uncalibrated checkpoint written by
k3convert stores 1.0, which is also what a spec without one uses (``generate_gparam``'s
own fallback: no global scaling).

compressed-tensors is a test dependency only: this module re-implements, and the tests
compare against the library bit for bit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..errors import ConfigError
from ..formats import FP4_MAX, FP8_MAX, INPUT_GLOBAL_SCALE, INPUT_SCALE, NV_GROUP
from ..formats.fp4 import E2M1, fp4_codes

STRATEGIES = ("token", "tensor", "group", "tensor_group")
_SCALE_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn}


@dataclass(frozen=True)
class ActivationSpec:
    """How a Linear's input activations are quantized.

    num_bits: 8 (4 for NVFP4); type: 'float' (FP8 e4m3 / FP4 e2m1) or 'int'; strategy:
    'token' | 'tensor' | 'group' | 'tensor_group' (NVFP4); dynamic: scales computed on
    the fly from each input (True; "local" for NVFP4: local scales on the fly, a static
    global scale) or a static calibrated ``scale`` (False); group_size: channels per
    scale for 'group' / 'tensor_group'; scale_dtype: the dtype local scales are rounded
    to ("float8_e4m3fn" for NVFP4, None otherwise). scale / zero_point: static
    parameters, shape [1] (``input_scale`` / ``input_zero_point`` of the checkpoint);
    global_scale: NVFP4's ``input_global_scale`` [1]; None where unused or unknown.
    """

    num_bits: int = 8
    type: str = "float"
    strategy: str = "token"
    dynamic: bool | str = True
    symmetric: bool = True
    group_size: int | None = None
    scale_dtype: str | None = None
    scale: torch.Tensor | None = field(default=None, compare=False, repr=False)
    zero_point: torch.Tensor | None = field(default=None, compare=False, repr=False)
    global_scale: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.type not in ("float", "int"):
            raise ConfigError(f"activation type must be 'float' or 'int', not '{self.type}'.")
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"activation strategy '{self.strategy}' is not supported; use one of "
                f"{', '.join(STRATEGIES)}."
            )
        fp4 = self.type == "float" and self.num_bits == 4
        if self.type == "float" and self.num_bits != 8 and not fp4:
            raise ConfigError("float activations must be 8-bit (FP8 e4m3) or NVFP4.")
        if fp4 != (self.strategy == "tensor_group"):
            raise ConfigError(
                "FP4 activations are supported as NVFP4 only (num_bits 4, type float, "
                "strategy tensor_group, dynamic 'local', group_size 16), and tensor_group "
                "only for them."
            )
        if fp4 and (self.dynamic != "local" or self.group_size != NV_GROUP):
            raise ConfigError(
                f"NVFP4 activations need dynamic 'local' and group_size {NV_GROUP}, got "
                f"dynamic {self.dynamic!r}, group_size {self.group_size!r}."
            )
        if self.dynamic == "local" and not fp4:
            raise ConfigError(
                "dynamic 'local' activation quantization is NVFP4 (tensor_group) only."
            )
        if self.dynamic not in (True, False, "local"):
            raise ConfigError(
                f"activation dynamic must be true, false or 'local', not {self.dynamic!r}."
            )
        if self.scale_dtype not in (None, *_SCALE_DTYPES):
            raise ConfigError(f"activation scale_dtype '{self.scale_dtype}' is not supported.")
        if self.strategy in ("group", "tensor_group") and not self.group_size:
            raise ConfigError("group activation quantization needs a group_size.")
        if not self.dynamic and self.strategy != "tensor":
            raise ConfigError("static activation quantization is per tensor only.")

    def with_scale(
        self, scale: torch.Tensor, zero_point: torch.Tensor | None = None
    ) -> ActivationSpec:
        return replace(self, scale=scale, zero_point=zero_point)

    def with_global_scale(self, global_scale: torch.Tensor | float) -> ActivationSpec:
        """The spec with NVFP4's ``input_global_scale`` (the checkpoint's, shape [1])."""
        return replace(self, global_scale=torch.as_tensor(global_scale).reshape(1))

    # -- stored parameters -------------------------------------------------------------
    def param_parts(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(part suffix, dtype, shape) stored with the weight for this input: a static
        spec's ``input_scale``, NVFP4's ``input_global_scale``; none for dynamic specs."""
        if self.strategy == "tensor_group":
            return [(INPUT_GLOBAL_SCALE, torch.float32, (1,))]
        if not self.dynamic:
            return [(INPUT_SCALE, torch.float32, (1,))]
        return []

    def param_values(self, value=None) -> dict[str, torch.Tensor]:
        """The parts of :meth:`param_parts` holding ``value`` (calibration's scale, or
        NVFP4's global scale; None: NVFP4 stores 1.0, no global scaling)."""
        parts = self.param_parts()
        if not parts:
            return {}
        ((name, dtype, shape),) = parts
        if value is None:
            if name != INPUT_GLOBAL_SCALE:
                raise ConfigError(f"the activation spec needs a calibrated {name}.")
            value = 1.0
        return {name: torch.as_tensor(value, dtype=dtype).reshape(shape).clone()}

    def ct_args(self) -> dict:
        """The compressed-tensors ``QuantizationArgs`` dict for config.json."""
        a = {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "dynamic": self.dynamic,
            "actorder": None,
            "observer": None if self.dynamic is True else "minmax",
            "observer_kwargs": {},
        }
        if self.strategy == "tensor_group":
            a["observer"] = "static_minmax"  # how llm-compressor calibrates the global scale
            a["scale_dtype"] = f"torch.{self.scale_dtype}"
        return a

    @classmethod
    def from_ct_args(cls, args: dict) -> ActivationSpec:
        """From a config.json ``input_activations`` dict (compressed-tensors format)."""
        strategy = args.get("strategy")
        group = args.get("group_size")
        if strategy is None:  # compressed-tensors infers it from group_size
            strategy = "tensor" if group is None else ("group" if group > 0 else "channel")
        dyn = args.get("dynamic", False)
        if isinstance(dyn, str):
            if dyn.lower() != "local":
                raise ConfigError(f"input_activations.dynamic='{dyn}' is not supported.")
            dyn = "local"
        sdt = args.get("scale_dtype")
        if isinstance(sdt, str):
            sdt = sdt.removeprefix("torch.")
        return cls(
            num_bits=int(args.get("num_bits", 8)),
            type=str(args.get("type", "int")).lower(),
            strategy=str(strategy).lower(),
            dynamic=dyn if dyn == "local" else bool(dyn),
            symmetric=bool(args.get("symmetric", True)),
            group_size=group,
            scale_dtype=sdt,
        )

    # -- range -------------------------------------------------------------------------
    def qrange(self) -> tuple[float, float]:
        if self.type == "float":
            return (-FP4_MAX, FP4_MAX) if self.num_bits == 4 else (-FP8_MAX, FP8_MAX)
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


#: NVFP4's input global scale is e4m3's max times E2M1's over the Linear's largest |input|
#: (compressed-tensors' ``generate_gparam``, as llm-compressor calibrates it); below this
#: largest |input| it would not be a finite float32
_NV_GLOBAL_NUM = FP8_MAX * FP4_MAX
_NV_MIN_AMAX = _NV_GLOBAL_NUM / float(torch.finfo(torch.float32).max)


def nv_input_global_scale(amax: float) -> float | None:
    """NVFP4's ``input_global_scale`` for inputs whose largest |value| is ``amax`` (float32,
    scalar / tensor as compressed-tensors writes it: torch computes it as the tensor's
    reciprocal times the scalar, the same bits); None where no finite positive value
    follows (no real input)."""
    if not math.isfinite(amax) or amax < _NV_MIN_AMAX:
        return None
    g = float(_NV_GLOBAL_NUM / torch.tensor([amax], dtype=torch.float32))
    return g if math.isfinite(g) and g > 0 else None


def fake_quant_activation(x: torch.Tensor, spec: ActivationSpec | None) -> torch.Tensor:
    """Quantize-dequantize a Linear input as compressed-tensors does at inference.

    x: [..., in_features] (any float dtype; computed in that dtype)
    -> same shape. ``spec=None`` returns x unchanged. Static specs need ``spec.scale``
    (the checkpoint's ``input_scale``, shape [1]).
    """
    if spec is None or x.numel() == 0:
        return x
    if spec.strategy in ("group", "tensor_group") and x.shape[-1] % spec.group_size:
        # compressed-tensors fails here too (unflatten): there is no reference behaviour
        raise ValueError(
            f"input of {x.shape[-1]} channels is not divisible by the activation group "
            f"size {spec.group_size}"
        )
    if spec.strategy == "tensor_group":
        return _fake_quant_nvfp4(x, spec)
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


def _fake_quant_nvfp4(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """compressed-tensors ``forward_quantize`` of an NVFP4 input (see the module doc),
    op for op: group min / max in x's dtype, ``amax / 6`` in x's dtype, times the global
    scale (float32), rounded to e4m3, zero -> 0.125; zero points are fp8 zeros, added and
    subtracted as compressed-tensors does (which turns -0.0 into +0.0)."""
    g = spec.group_size
    gs = spec.global_scale
    gs = torch.ones(1) if gs is None else gs.to(torch.float32).reshape(1)
    xg = x.unflatten(-1, (x.shape[-1] // g, g))
    mn = torch.amin(xg, dim=-1)
    mx = torch.amax(xg, dim=-1)
    mn = torch.min(mn, torch.zeros_like(mn))
    mx = torch.max(mx, torch.zeros_like(mx))
    max_pos = torch.max(torch.abs(mn), torch.abs(mx))
    bit_range = torch.tensor(2 * FP4_MAX, dtype=torch.float32)
    scales = max_pos / (bit_range.to(max_pos.dtype) / 2)
    scales = gs * scales
    sdt = _SCALE_DTYPES.get(spec.scale_dtype or "")
    if sdt is not None:
        fi = torch.finfo(sdt)
        scales = torch.clamp(scales, fi.min, fi.max).to(sdt).to(scales.dtype)
    eps = 0.125 if sdt == torch.float8_e4m3fn else _eps(scales.dtype)
    scales = torch.where(scales == 0, torch.tensor(eps, dtype=scales.dtype), scales)
    zp = torch.zeros(scales.shape, dtype=mn.dtype).to(torch.float8_e4m3fn)
    scale = (scales / gs).unsqueeze(-1)
    zp = zp.unsqueeze(-1)
    scaled = xg / scale
    scaled += zp.to(x.dtype)
    scaled = torch.clamp(scaled, torch.tensor(-FP4_MAX), torch.tensor(FP4_MAX))
    if scaled.dtype != torch.float32:
        raise ValueError(f"NVFP4 activations are computed in float32, not {scaled.dtype}")
    q = E2M1[fp4_codes(scaled).to(torch.int64)]
    out = (q.to(scale.dtype) - zp.to(scale.dtype)) * scale
    return out.flatten(start_dim=-2).to(x.dtype)


# -- reading a quantization_config ------------------------------------------------------
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
    spec = activation_specs(config)(tensor_name)
    if spec is not None and not spec.dynamic and input_scale is not None:
        spec = spec.with_scale(input_scale, input_zero_point)
    return spec


def activation_specs(config: dict) -> Callable[[str], ActivationSpec | None]:
    """:func:`activation_spec_for` without the scale, as a function of the tensor name
    with the config read once (its patterns compiled once: a model has thousands of
    Linears and a config can ignore hundreds of modules)."""
    qc = _quant_config(config)
    if not qc or qc.get("quant_method", "compressed-tensors") != "compressed-tensors":
        return lambda name: None
    ignore = qc.get("ignore") or []
    ignore_exact = {t for t in ignore if not t.startswith("re:")}
    ignore_rx = [re.compile(t[3:]) for t in ignore if t.startswith("re:")]
    target_to_scheme: dict[str, dict] = {}
    for g in (qc.get("config_groups") or {}).values():
        if isinstance(g, dict):
            for t in g.get("targets") or []:
                target_to_scheme[t] = g
    exact = {t for t in target_to_scheme if not t.startswith("re:")}
    patterns = [(t, re.compile(t[3:])) for t in sorted(target_to_scheme) if t.startswith("re:")]
    specs: dict[str, ActivationSpec | None] = {}

    def spec_of(target: str) -> ActivationSpec | None:
        if target not in specs:
            args = target_to_scheme[target].get("input_activations")
            specs[target] = ActivationSpec.from_ct_args(args) if args else None
        return specs[target]

    def resolve(tensor_name: str) -> ActivationSpec | None:
        module = tensor_name.removesuffix(".weight")
        if module in ignore_exact or any(rx.match(module) for rx in ignore_rx):
            return None
        if module in exact:  # exact names sort before patterns
            return spec_of(module)
        for t, rx in patterns:
            if rx.match(module):
                return spec_of(t)
        return spec_of("Linear") if "Linear" in target_to_scheme else None

    return resolve

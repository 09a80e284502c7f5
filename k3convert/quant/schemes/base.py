"""What every scheme shares: the :class:`Scheme` interface, scale helpers and checks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from ...errors import (
    ConfigError,
    GroupSizeError,
    NonFiniteWeightError,
    WeightRangeError,
)
from ...formats.dtypes import FLOAT_DTYPES
from ..activations import ActivationSpec

_F32_MAX = float(torch.finfo(torch.float32).max)


_DTYPES = FLOAT_DTYPES


def _positive_int(v) -> bool:
    """A positive int that is not a bool (True is an int to Python, not to a config)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _one_of(v, choices: tuple[str, ...]) -> bool:
    return isinstance(v, str) and v in choices


def _esize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _nbytes(parts: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) * _esize(d) for _, d, s in parts)


@dataclass(frozen=True)
class Support:
    """What one scheme supports, stated in one place: the modules that act on a scheme
    (serving checks, verify thresholds, calibration, the MXFP4 transcodes, the weight
    observers) ask its :attr:`Scheme.support` instead of testing its class or name. A new
    format touches the format registry, its scheme (this declaration) and its tests.

    kernel: the class of serving kernel it needs (a key of ``serving.KERNELS``, which
    says which engine on which device has one: the engines that load it);
    verify_family: the verify threshold family of its outputs (a key of
    ``verify.metrics.FAMILIES``);
    gptq: how GPTQ rounds one of its columns (``int``, ``fp8``, ``fp4``: the column
    rounder of :mod:`k3convert.calibrate.gptq`), None where GPTQ does not apply;
    observers: the weight observers it takes (``--weight-observer``), ``()`` for none;
    awq_clip: AWQ's clip step searches its group ranges;
    transcodes: released encodings it is produced from straight from their bytes
    (:mod:`k3convert.quant.fp4_requant`);
    holds: released encodings whose every value it holds, so calibration transcodes them
    instead of solving them (unless asked: ``gptq_solve_released``).
    """

    kernel: str
    verify_family: str
    gptq: str | None = None
    observers: tuple[str, ...] = ()
    awq_clip: bool = False
    transcodes: tuple[str, ...] = ()
    holds: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scheme:
    """Base of every weight scheme.

    name: registry name; act: input-activation spec recorded in config.json (None for
    weight-only schemes); needs_input_scale: True when act is static (its per-tensor
    ``input_scale`` comes from calibration).
    """

    name: str = ""
    act: ActivationSpec | None = None

    # -- interface ----------------------------------------------------------------------
    def check(self, tensor: str, shape: tuple[int, ...]) -> None:
        """Raise a K3Error naming ``tensor`` if this scheme cannot quantize ``shape``."""
        if len(shape) != 2:
            raise ConfigError(
                f"scheme '{self.name}' quantizes 2-D Linear weights; '{tensor}' has shape "
                f"{tuple(shape)}. Keep it (--keep '{tensor}')."
            )
        act = self.act
        if act is not None and act.strategy == "group" and shape[1] % act.group_size:
            # compressed-tensors (and so vLLM / transformers) cannot run such a layer:
            # refuse now rather than write a checkpoint nothing can execute
            raise GroupSizeError(
                f"scheme '{self.name}' quantizes input activations in groups of "
                f"{act.group_size} channels, which does not divide the input dimension "
                f"{shape[1]} of '{tensor}' (shape {tuple(shape)}); use a per-token scheme "
                f"such as fp8-dynamic for it, or keep it with --keep '{tensor}'.",
                tensor,
            )

    def parts(self, shape: tuple[int, int]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(part suffix, dtype, shape) of what ``quantize`` returns for ``shape``."""
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, *, name: str = "weight") -> dict[str, torch.Tensor]:
        """w: [out, in] float -> parts; name: the tensor, for error messages."""
        raise NotImplementedError

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def weight_args(self) -> dict:
        """compressed-tensors QuantizationArgs dict of the weights."""
        raise NotImplementedError

    @property
    def support(self) -> Support:
        """What this scheme supports (see :class:`Support`)."""
        raise NotImplementedError

    @property
    def format(self) -> str:
        raise NotImplementedError

    @property
    def needs_input_scale(self) -> bool:
        """Whether the activation parameter must come from calibration (a static spec's
        ``input_scale``); an NVFP4 input's ``input_global_scale`` has a default."""
        return self.act is not None and not self.act.dynamic

    def act_parts(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(part suffix, dtype, shape) of the activation parameters the writer adds to
        ``quantize``'s parts: a static spec's calibrated ``input_scale``. (Parameters
        with a default, NVFP4's ``input_global_scale``, are in :meth:`parts`.)"""
        return self.act.param_parts() if self.act is not None else []

    def act_values(self, value=None) -> dict[str, torch.Tensor]:
        """Every activation parameter this scheme stores, holding ``value`` (from
        calibration; required for static specs) or the spec's default; the writer
        stores these over what ``quantize`` returned."""
        return self.act.param_values(value) if self.act is not None else {}

    # -- derived ------------------------------------------------------------------------
    def nbytes(self, shape: tuple[int, int]) -> int:
        return _nbytes(self.parts(shape)) + _nbytes(self.act_parts())

    def ct_scheme(self, targets: list[str]) -> dict:
        """One config_groups entry of config.json."""
        return {
            "targets": list(targets),
            "weights": self.weight_args(),
            "input_activations": self.act.ct_args() if self.act else None,
            "output_activations": None,
            "format": self.format,
        }

    def describe(self) -> str:
        return self.name

    def options(self) -> dict:
        """Fields a recipe may override (everything but name / act)."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("name", "act")
        }


#: float dtype -> (signed int dtype of its width, mask clearing the sign bit)
_SIGNLESS = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def _finite_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp scales to the smallest normal of ``dtype`` (zero / denormal ranges)."""
    return scale.clamp(min=torch.finfo(dtype).tiny)


def _not_finite(scheme: Scheme, name: str, extreme: torch.Tensor) -> NonFiniteWeightError:
    bad = int((~torch.isfinite(extreme)).sum())
    return NonFiniteWeightError(
        f"scheme '{scheme.name}': tensor '{name}' holds NaN/Inf value(s) ({bad} group(s) "
        f"affected); the source is corrupt - fix or re-download it."
    )


def _out_of_range(scheme: Scheme, name: str, amax: float, what: str, dtype) -> WeightRangeError:
    hint = " or use scale_dtype float32" if dtype != torch.float32 else ""
    return WeightRangeError(
        f"scheme '{scheme.name}' cannot represent tensor '{name}': its largest magnitude "
        f"{amax:.4g} gives a {what} beyond the range of {str(dtype).removeprefix('torch.')} "
        f"(max {torch.finfo(dtype).max:.4g}); keep it (--keep '{name}'){hint}."
    )

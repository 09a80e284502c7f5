"""Calibration options: the flat set that a recipe's ``quantize.calibrate`` section and
``quantize``'s flags write (:class:`SequentialOptions`), and one small dataclass per
algorithm (:class:`GPTQOptions`, :class:`AWQOptions`, :class:`SmoothQuantOptions`,
:class:`ObserverOptions`, :class:`KVCacheOptions`, :class:`AllExpertsOptions`, plus the
calibration set's :class:`DataOptions`) that holds the options its pass reads and
carries their checks: the values' (``check``) and which algorithm / observer an option
needs (``check_given``). :meth:`SequentialOptions.check` and
:meth:`SequentialOptions.check_applicable` run every group's, so the command line and a
recipe are checked by the same code; ``name(key)`` spells a key in the caller's words
(``--gptq-fp-target``, ``quantize.calibrate.gptq_fp_target``)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from .observers import OBSERVERS, check_percentile
from .smooth import SQ_MIN_GAIN, check_alpha

#: the calibration algorithms (``quantize --algorithm``, a recipe's ``calibrate.algorithm``)
ALGORITHMS = ("rtn", "gptq", "static", "awq", "smoothquant", "smoothquant+gptq")
#: algorithms that smooth (scale migration, :mod:`.smooth`) before quantizing
SMOOTHING = {"awq": "awq", "smoothquant": "smoothquant", "smoothquant+gptq": "smoothquant"}
#: algorithms that solve weights with GPTQ
GPTQ_ALGORITHMS = ("gptq", "smoothquant+gptq")

#: how a check spells an option: a flag, a recipe key path
Name = Callable[[str], str]


def option_name(key: str) -> str:
    """The default spelling of an option in a message."""
    return f"calibration option {key}"


def _positive_int(v, key: str, name: Name) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name(key)} must be a positive integer, got {v!r}.")


def _flag(v, key: str, name: Name) -> None:
    if not isinstance(v, bool):
        raise ConfigError(f"{name(key)} must be True or False, got {v!r}.")


class _Group:
    """One algorithm's options: ``KEYS`` maps each field to its key in
    :class:`SequentialOptions` (a recipe's ``quantize.calibrate`` key)."""

    KEYS: ClassVar[dict[str, str]] = {}

    @classmethod
    def of(cls, opts: SequentialOptions):
        return cls(**{f: getattr(opts, k) for f, k in cls.KEYS.items()})

    def check(self, name: Name = option_name) -> None:
        """Refuse a value this group cannot use."""

    def check_given(
        self, opts: SequentialOptions, algorithm: str, given: Collection[str], name: Name
    ) -> None:
        """Refuse a ``given`` option (keys of :class:`SequentialOptions`) that ``algorithm``
        or the other options make meaningless."""


@dataclass(frozen=True)
class DataOptions(_Group):
    """The calibration set and how it runs (:func:`~.data.build_calibration_set`)."""

    dataset: str | os.PathLike
    num_samples: int | None
    seq_len: int | None
    seed: int
    packing: bool
    batch_size: int
    dtype: str
    offload_dir: str | os.PathLike | None

    KEYS: ClassVar = {k: k for k in ("dataset", "num_samples", "seq_len", "seed", "packing",
                                     "batch_size", "dtype", "offload_dir")}  # fmt: skip

    def check(self, name: Name = option_name) -> None:
        _positive_int(self.batch_size, "batch_size", name)


@dataclass(frozen=True)
class GPTQOptions(_Group):
    """GPTQ (:class:`~.passes.GPTQPass`): block size, dampening, act-order, the
    full-precision target's strength (``gptq_fp_target``, 0 = GPTQ's own target), and
    whether tensors released in MXFP4 whose scheme holds them exactly (NVFP4, MXFP4,
    FP8 blocks) are solved too (``gptq_solve_released``; by default they are transcoded
    exactly, :func:`~.passes.transcoded_exactly`)."""

    block_size: int
    dampening: float
    act_order: bool
    fp_target: float
    solve_released: bool

    KEYS: ClassVar = {"block_size": "block_size", "dampening": "dampening",
                      "act_order": "act_order", "fp_target": "gptq_fp_target",
                      "solve_released": "gptq_solve_released"}  # fmt: skip

    def check(self, name: Name = option_name) -> None:
        _positive_int(self.block_size, "block_size", name)
        _flag(self.solve_released, "gptq_solve_released", name)
        d = self.dampening
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
            raise ConfigError(f"{name('dampening')} must be a number >= 0, got {d!r}.")
        a = self.fp_target
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ConfigError(
                f"{name('gptq_fp_target')} must be a number in [0, 1] (0: off, GPTQ's own "
                f"target; 1: the full-precision model's outputs; 0.5 recommended), got {a!r}."
            )

    def check_given(self, opts, algorithm, given, name) -> None:
        for key in ("gptq_fp_target", "gptq_solve_released"):
            if key in given and algorithm not in GPTQ_ALGORITHMS:
                raise ConfigError(
                    f"{name(key)} only applies with {name('algorithm')} gptq or smoothquant+gptq."
                )


@dataclass(frozen=True)
class AWQOptions(_Group):
    """AWQ (:class:`~.passes.SmoothingPass`): the scale search's grid and duo scaling,
    the clip step (:class:`~.passes.ClipPass`), the tokens its statistics keep."""

    grid: int
    duo_scaling: bool
    clip: bool
    tokens: int

    KEYS: ClassVar = {"grid": "awq_grid", "duo_scaling": "awq_duo_scaling",
                      "clip": "awq_clip", "tokens": "smooth_tokens"}  # fmt: skip

    def check(self, name: Name = option_name) -> None:
        _positive_int(self.grid, "awq_grid", name)
        _positive_int(self.tokens, "smooth_tokens", name)
        _flag(self.clip, "awq_clip", name)
        _flag(self.duo_scaling, "awq_duo_scaling", name)

    def check_given(self, opts, algorithm, given, name) -> None:
        if "awq_clip" in given and algorithm != "awq":
            raise ConfigError(f"{name('awq_clip')} only applies with {name('algorithm')} awq.")


@dataclass(frozen=True)
class SmoothQuantOptions(_Group):
    """SmoothQuant (:class:`~.passes.SmoothingPass`): the migration strength, or a search
    over it per mapping, and the local gain a mapping must show to be smoothed
    (``sq_min_gain``, :data:`~.smooth.SQ_MIN_GAIN` by default)."""

    alpha: float
    alpha_search: bool
    min_gain: float

    KEYS: ClassVar = {"alpha": "alpha", "alpha_search": "alpha_search",
                      "min_gain": "sq_min_gain"}  # fmt: skip

    def check(self, name: Name = option_name) -> None:
        check_alpha(self.alpha)
        _flag(self.alpha_search, "alpha_search", name)
        g = self.min_gain
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < 1:
            raise ConfigError(
                f"{name('sq_min_gain')} must be a number in [0, 1) (the fraction of a "
                f"mapping's quantization error smoothing must remove; 0: any gain), got {g!r}."
            )

    def check_given(self, opts, algorithm, given, name) -> None:
        keys = {"alpha", "alpha_search", "sq_min_gain"}
        if (keys & set(given)) and not algorithm.startswith("smoothquant"):
            raise ConfigError(
                f"{name('alpha')} / {name('alpha_search')} / {name('sq_min_gain')} only "
                f"apply with {name('algorithm')} smoothquant[+gptq]."
            )
        if "alpha" in given and self.alpha_search:
            raise ConfigError(f"give {name('alpha')} or {name('alpha_search')}, not both.")


@dataclass(frozen=True)
class ObserverOptions(_Group):
    """Static input scales (:class:`~.passes.ObserverPass`, :mod:`.observers`)."""

    observer: str
    percentile: float

    KEYS: ClassVar = {"observer": "observer", "percentile": "percentile"}

    def check(self, name: Name = option_name) -> None:
        if self.observer not in OBSERVERS:
            raise ConfigError(
                f"calibration observer '{self.observer}' is not known; use one of "
                f"{', '.join(OBSERVERS)}."
            )
        check_percentile(self.percentile)

    def check_given(self, opts, algorithm, given, name) -> None:
        if "percentile" in given and self.observer != "percentile":
            raise ConfigError(
                f"{name('percentile')} only applies with {name('observer')} percentile."
            )


@dataclass(frozen=True)
class KVCacheOptions(_Group):
    """KV-cache scales (:class:`~.passes.KVPass`): ``fp8`` or None (off)."""

    kv_cache: str | None

    KEYS: ClassVar = {"kv_cache": "kv_cache"}

    def check(self, name: Name = option_name) -> None:
        if self.kv_cache not in (None, "fp8"):
            raise ConfigError(f"{name('kv_cache')} must be fp8 or unset, got {self.kv_cache!r}.")


@dataclass(frozen=True)
class AllExpertsOptions(_Group):
    """Every routed expert's statistics over all calibration tokens
    (:mod:`.layer`'s all-experts pass)."""

    moe_all_experts: bool

    KEYS: ClassVar = {"moe_all_experts": "moe_all_experts"}

    def check(self, name: Name = option_name) -> None:
        _flag(self.moe_all_experts, "moe_all_experts", name)


#: the groups, in the order their checks run
GROUPS = (DataOptions, GPTQOptions, AllExpertsOptions, ObserverOptions, SmoothQuantOptions,
          KVCacheOptions, AWQOptions)  # fmt: skip


@dataclass(frozen=True)
class SequentialOptions:
    """Calibration options for :func:`~.sequential.calibrate_sequential` /
    ``quantize(calibrate=)``, flat as a recipe's ``quantize.calibrate`` section writes
    them; each algorithm reads its own group (:meth:`gptq`, :meth:`awq`, ...).

    dataset / num_samples / seq_len / seed / packing: the calibration set
    (:func:`~.data.build_calibration_set`; None: the dataset definition's or 128 / 512);
    batch_size: samples per forward micro-batch; block_size / dampening / act_order: GPTQ;
    offload_dir: keep the hidden states and the journal there instead of in memory and
    ``<out>.calib/``; dtype: compute dtype of the runtime; moe_all_experts: routed experts'
    statistics over all calibration tokens (see :mod:`.sequential`); observer / percentile:
    how static input scales are chosen (:mod:`.observers`: ``minmax``, ``percentile`` of
    |x|, ``mse``-optimal clipping). SmoothQuant: alpha or alpha_search, and sq_min_gain
    (a mapping is smoothed only where that removes at least this fraction of its
    balance Linears' quantization error on the sampled rows; 0.25 by default, see
    :data:`.smooth.SQ_MIN_GAIN`; 0 measured best for W4A4 on a dense model). AWQ:
    awq_grid / awq_duo_scaling its scale search;
    awq_clip (default on, as the original AWQ's ``auto_clip``): after smoothing, each
    group-wise integer Linear's ranges are searched for the smallest output error over the
    calibration tokens (:func:`k3convert.quant.mse_observer.quantize` with the group
    blocks of its inputs' Gram matrix; the scheme's ``mse_grid`` / ``mse_maxshrink``
    set the grid). gptq_fp_target (GPTAQ-style asymmetric calibration, 0 = off): GPTQ
    minimises ``||W (X + a (Xf - X)) - Q X||`` instead of ``||W X - Q X||``, X the
    Linear's inputs from the quantized layers before it, Xf its inputs in the
    full-precision model on the same tokens, ``a`` this value (1: the full-precision
    outputs; 0.5 measured best on the trained fixtures). A second, full-precision stream
    of hidden states is carried beside the quantized one, and each GPTQ Linear
    accumulates the cross term ``(Xf - X) X^T`` beside its Hessian
    (:func:`~.gptq.fp_target_weight`; scales stay the weight's own).
    gptq_solve_released: GPTQ also solves tensors released in MXFP4 under a scheme that
    holds them exactly (NVFP4, MXFP4, FP8 blocks), and smoothing may change them; off,
    they are transcoded exactly and no smoothing mapping touching one is used.
    """

    dataset: str | os.PathLike = "default"
    num_samples: int | None = None
    seq_len: int | None = None
    seed: int = 0
    packing: bool = True
    batch_size: int = 8
    block_size: int = 128
    dampening: float = 0.01
    act_order: bool = True  # llm-compressor's default too (actorder static = weight)
    offload_dir: str | os.PathLike | None = None
    dtype: str = "fp32"
    moe_all_experts: bool = False
    observer: str = "minmax"
    percentile: float = 99.99
    alpha: float = 0.5
    alpha_search: bool = False
    sq_min_gain: float = SQ_MIN_GAIN
    awq_grid: int = 20
    awq_duo_scaling: bool = True
    awq_clip: bool = True
    smooth_tokens: int = 4096
    kv_cache: str | None = None
    gptq_fp_target: float = 0.0
    gptq_solve_released: bool = False

    def data(self) -> DataOptions:
        return DataOptions.of(self)

    def gptq(self) -> GPTQOptions:
        return GPTQOptions.of(self)

    def awq(self) -> AWQOptions:
        return AWQOptions.of(self)

    def smoothquant(self) -> SmoothQuantOptions:
        return SmoothQuantOptions.of(self)

    def observers(self) -> ObserverOptions:
        return ObserverOptions.of(self)

    def check(self, name: Name = option_name) -> None:
        """Every group's value checks."""
        for g in GROUPS:
            g.of(self).check(name)

    def set_options(self) -> set[str]:
        """The options that differ from their defaults: what a recipe section sets, as
        far as its values tell (a key written with its default value is not seen: a
        resolved recipe, ``recipe show``, lists every default and must parse again)."""
        return {f.name for f in dataclasses.fields(SequentialOptions)
                if getattr(self, f.name) != f.default}  # fmt: skip

    def check_applicable(self, algorithm: str, given: Collection[str], name: Name = str) -> None:
        """Refuse options that ``algorithm`` (or the observer) would not use: ``given``
        names the options the user set, ``name(option)`` how the message spells one (a
        flag, a recipe key), ``name("algorithm")`` / ``name("observer")`` included. The
        same checks for the command line and a recipe's ``quantize.calibrate``."""
        for g in GROUPS:
            g.of(self).check_given(self, algorithm, given, name)

    def algorithm_options(self, algorithm: str | None = None) -> dict:
        """The options that change results (the journal's fingerprint, the provenance)."""
        return {"block_size": self.block_size, "dampening": float(self.dampening),
                "act_order": bool(self.act_order), "dtype": self.dtype,
                "batch_size": self.batch_size,
                "moe_all_experts": self.moe_all_experts, "observer": self.observer,
                "percentile": float(self.percentile)
                if self.observer == "percentile" else None,
                "kv_cache": self.kv_cache, **self._gptq_options(algorithm),
                **self._smoothing_options(algorithm)}  # fmt: skip

    def _gptq_options(self, algorithm: str | None) -> dict:
        if algorithm is None or algorithm in GPTQ_ALGORITHMS:
            out = {"gptq_fp_target": float(self.gptq_fp_target)}
            if self.gptq_solve_released:  # (absent when off: earlier records unchanged)
                out["gptq_solve_released"] = True
            return out
        return {}

    def _smoothing_options(self, algorithm: str | None) -> dict:
        kind = SMOOTHING.get(algorithm) if algorithm is not None else "all"
        out = {}
        if kind in ("smoothquant", "all"):
            out["alpha"] = None if self.alpha_search else float(self.alpha)
            out["alpha_search"] = self.alpha_search
            if self.sq_min_gain != SQ_MIN_GAIN:  # (absent at its default: records unchanged)
                out["sq_min_gain"] = float(self.sq_min_gain)
        if kind in ("awq", "all"):
            out.update(awq_grid=self.awq_grid, awq_duo_scaling=self.awq_duo_scaling,
                       awq_clip=self.awq_clip)  # fmt: skip
        if kind is not None:
            out["smooth_tokens"] = self.smooth_tokens
        return out

"""Layer-sequential calibration on the runtime: GPTQ weights and static input scales.

The calibration batch is embedded once (in micro-batches); then, one decoder layer at a
time:

1. layer ``i`` runs on the current hidden states with hooks on its Linears, collecting
   what the algorithm needs: a :class:`~.gptq.HessianAccumulator` per GPTQ Linear
   (padding excluded), the largest |input| of each Linear with a static input scale;
2. its Linears are quantized: GPTQ parts (``gptq_quantize``) or, for ``rtn`` /
   ``static``, the scheme's round-to-nearest ones (the writer recomputes those itself);
   static schemes get ``input_scale = clip / qmax``, clip the observer's (the absmax by
   default; a percentile of |x| or the MSE-optimal clip: :mod:`.observers`);
3. layer ``i`` runs again with the quantized weights (served dequantized by
   :class:`OverlaySource`), and its outputs are layer ``i + 1``'s inputs: each layer is
   calibrated on what the quantized layers before it really produce.

Memory: one layer's weights plus the activations of the calibration set (in memory, or
spilled to ``offload_dir`` as one safetensors file per micro-batch). Routed experts get
the tokens the router sends them (their padding rows excluded); an expert that saw no
real token falls back to round to nearest (static scales: the largest scale of its
sibling experts' same projection) with a warning, and is listed in the result.

Routing counts: per MoE layer, the real (not padding) tokens the router sends each expert
(``SequentialResult.routing_counts``; ``quantize`` writes them to
``OUT/routing_counts.json`` for ``shard --expert-load``). With
``SequentialOptions(moe_all_experts=True)`` every routed expert's statistics (Hessian,
absmax) are also taken over *all* real tokens of the layer (each expert is run on every
token beside the routed pass, its output discarded), so no expert is starved; the layer's
output, and so the next layer's input, stays the routed one, and the routing counts and
``expert_tokens`` stay the routed counts.

Resumable: after every finished layer its results and the hidden states entering the
next layer are written to the journal directory (``<out>.calib/`` or ``offload_dir``)
with a fingerprint of the source (config, file sizes and mtimes), the plan (schemes),
the algorithm options and the calibration set. A rerun with the same fingerprint
continues after the last finished layer (byte-identical results: the saved hidden states
are the exact bits); a different fingerprint starts over.

Activation quantization is not applied during calibration (the runtime runs with
``act_quant=False``): the propagated error is the weights'.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import __version__ as _k3_version
from .. import formats as fmt
from ..errors import ConfigError
from ..formats import FP4_MAX, FP8_MAX
from ..quant import fp4_requant, mse_observer
from ..quant.mse_observer import GroupGram
from ..quant.schemes import FP8Scheme, IntScheme, Scheme
from ..runtime.decoder import ROUTERS, AttnResState, gated_mlp, layer_output
from .data import CalibrationSet
from .gptq import (
    CrossAccumulator,
    GPTQFallbackWarning,
    HessianAccumulator,
    fp_target_weight,
    gptq_quantize,
)
from .observers import OBSERVERS, check_percentile, make_observer
from .smooth import (
    SQ_ALPHAS,
    Smoothing,
    Statistics,
    awq_scales,
    check_alpha,
    layer_mappings,
    smoothquant_search,
)

ALGORITHMS = ("rtn", "gptq", "static", "awq", "smoothquant", "smoothquant+gptq")
#: algorithms that smooth (scale migration, :mod:`.smooth`) before quantizing
SMOOTHING = {"awq": "awq", "smoothquant": "smoothquant", "smoothquant+gptq": "smoothquant"}
GPTQ_ALGORITHMS = ("gptq", "smoothquant+gptq")
_JOURNAL = "journal.json"
_JOURNAL_VERSION = "k3convert-sequential-v2"

#: observer(layer, weight name, input, mask or None): every Linear input the engine feeds
#: to an accumulator (tests recompute Hessians from it; raising aborts the run)
Observer = Callable[[int, str, torch.Tensor, torch.Tensor | None], None]


class ExpertFallbackWarning(UserWarning):
    """A routed expert saw no calibration token: it is rounded to nearest instead."""


@dataclass(frozen=True)
class SequentialOptions:
    """Calibration options for :func:`calibrate_sequential` / ``quantize(calibrate=)``.

    dataset / num_samples / seq_len / seed / packing: the calibration set
    (:func:`~.data.build_calibration_set`; None: the dataset definition's or 128 / 512);
    batch_size: samples per forward micro-batch; block_size / dampening / act_order: GPTQ;
    offload_dir: keep the hidden states and the journal there instead of in memory and
    ``<out>.calib/``; dtype: compute dtype of the runtime; moe_all_experts: routed experts'
    statistics over all calibration tokens (see the module doc); observer / percentile:
    how static input scales are chosen (:mod:`.observers`: ``minmax``, ``percentile`` of
    |x|, ``mse``-optimal clipping). AWQ: awq_grid / awq_duo_scaling its scale search;
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
    awq_grid: int = 20
    awq_duo_scaling: bool = True
    awq_clip: bool = True
    smooth_tokens: int = 4096
    kv_cache: str | None = None
    gptq_fp_target: float = 0.0

    def check(self) -> None:
        for key in ("batch_size", "block_size", "awq_grid", "smooth_tokens"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(
                    f"calibration option {key} must be a positive integer, got {v!r}."
                )
        d = self.dampening
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
            raise ConfigError(f"calibration option dampening must be a number >= 0, got {d!r}.")
        if not isinstance(self.moe_all_experts, bool):
            raise ConfigError(
                f"calibration option moe_all_experts must be True or False, "
                f"got {self.moe_all_experts!r}."
            )
        if self.observer not in OBSERVERS:
            raise ConfigError(
                f"calibration observer '{self.observer}' is not known; use one of "
                f"{', '.join(OBSERVERS)}."
            )
        check_percentile(self.percentile)
        check_alpha(self.alpha)
        if self.kv_cache not in (None, "fp8"):
            raise ConfigError(
                f"calibration option kv_cache must be fp8 or unset, got {self.kv_cache!r}."
            )
        if not isinstance(self.alpha_search, bool):
            raise ConfigError(
                f"calibration option alpha_search must be True or False, got {self.alpha_search!r}."
            )
        if not isinstance(self.awq_clip, bool):
            raise ConfigError(
                f"calibration option awq_clip must be True or False, got {self.awq_clip!r}."
            )
        a = self.gptq_fp_target
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ConfigError(
                f"calibration option gptq_fp_target must be a number in [0, 1] (0: off, "
                f"GPTQ's own target; 1: the full-precision model's outputs; 0.5 "
                f"recommended), got {a!r}."
            )
        if not isinstance(self.awq_duo_scaling, bool):
            raise ConfigError(
                f"calibration option awq_duo_scaling must be True or False, "
                f"got {self.awq_duo_scaling!r}."
            )

    def set_options(self) -> set[str]:
        """The options that differ from their defaults (what a recipe section sets)."""
        return {f.name for f in dataclasses.fields(SequentialOptions)
                if getattr(self, f.name) != f.default}  # fmt: skip

    def check_applicable(
        self, algorithm: str, given: Collection[str], name: Callable[[str], str] = str
    ) -> None:
        """Refuse options that ``algorithm`` (or the observer) would not use: ``given``
        names the options the user set, ``name(option)`` how the message spells one (a
        flag, a recipe key), ``name("algorithm")`` / ``name("observer")`` included. The
        same checks for the command line and a recipe's ``quantize.calibrate``."""
        if "gptq_fp_target" in given and algorithm not in GPTQ_ALGORITHMS:
            raise ConfigError(
                f"{name('gptq_fp_target')} only applies with {name('algorithm')} gptq or "
                f"smoothquant+gptq."
            )
        if "awq_clip" in given and algorithm != "awq":
            raise ConfigError(f"{name('awq_clip')} only applies with {name('algorithm')} awq.")
        if ({"alpha", "alpha_search"} & set(given)) and not algorithm.startswith("smoothquant"):
            raise ConfigError(
                f"{name('alpha')} / {name('alpha_search')} only apply with "
                f"{name('algorithm')} smoothquant[+gptq]."
            )
        if "alpha" in given and self.alpha_search:
            raise ConfigError(f"give {name('alpha')} or {name('alpha_search')}, not both.")
        if "percentile" in given and self.observer != "percentile":
            raise ConfigError(
                f"{name('percentile')} only applies with {name('observer')} percentile."
            )

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
            return {"gptq_fp_target": float(self.gptq_fp_target)}
        return {}

    def _smoothing_options(self, algorithm: str | None) -> dict:
        kind = SMOOTHING.get(algorithm) if algorithm is not None else "all"
        out = {}
        if kind in ("smoothquant", "all"):
            out["alpha"] = None if self.alpha_search else float(self.alpha)
            out["alpha_search"] = self.alpha_search
        if kind in ("awq", "all"):
            out.update(awq_grid=self.awq_grid, awq_duo_scaling=self.awq_duo_scaling,
                       awq_clip=self.awq_clip)  # fmt: skip
        if kind is not None:
            out["smooth_tokens"] = self.smooth_tokens
        return out


@dataclass
class SequentialResult:
    """What calibration produced. ``weight_parts(name)``: the parts calibration chose for
    a weight (GPTQ, or round to nearest of the smoothed weight; read from its layer's file
    in the journal), None for rows left to the writer's round to nearest;
    ``kept_tensor(name)``: a kept tensor smoothing changed, else None."""

    algorithm: str
    journal: Path
    input_scales: dict[str, float] = field(default_factory=dict)
    layer_seconds: list[float] = field(default_factory=list)
    expert_tokens: dict[str, int] = field(default_factory=dict)
    #: MoE layer -> real tokens routed to each expert (the router's top-k choices)
    routing_counts: dict[int, list[int]] = field(default_factory=dict)
    top_k: int | None = None  # experts per token (MoE models)
    fallbacks: list[str] = field(default_factory=list)
    #: weight name -> layer, for the rows whose parts calibration chose (GPTQ, smoothed)
    part_rows: dict[str, int] = field(default_factory=dict)
    #: kept tensor name -> layer, for kept tensors smoothing changed (norms, routers)
    kept_rows: dict[str, int] = field(default_factory=dict)
    #: smoothing: mapping label -> AWQ's chosen ratio (None: no smoothing won) / "alpha"
    smoothing: dict[str, object] = field(default_factory=dict)
    #: kv_cache="fp8": attention layer -> the largest |value| entering its KV cache per
    #: kind (GQA "k" / "v", MLA "latent" / "k_rot"), from the quantized layer's pass
    kv_absmax: dict[int, dict[str, float]] = field(default_factory=dict)
    resumed_from: int = 0  # layers taken from the journal
    #: GPTQ solves each torchrun process did (one entry without torchrun)
    solves_per_process: list[int] = field(default_factory=list)
    calibration: dict = field(default_factory=dict)

    def kept_tensor(self, name: str) -> torch.Tensor | None:
        """A kept tensor's new value (in its source dtype) when smoothing changed it."""
        layer = self.kept_rows.get(name)
        if layer is None:
            return None
        with safe_open(str(self.journal / f"layer-{layer}.safetensors"), "pt") as f:
            return f.get_tensor(name)

    def weight_parts(self, name: str) -> dict[str, torch.Tensor] | None:
        layer = self.part_rows.get(name)
        if layer is None:
            return None
        prefix = name.removesuffix(".weight") + "."
        out = {}
        with safe_open(str(self.journal / f"layer-{layer}.safetensors"), "pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if k.startswith(prefix) and "." not in k[len(prefix) :]:
                    out[k[len(prefix) :]] = f.get_tensor(k)
        return out

    def cleanup(self) -> None:
        """Remove the journal's own files (after the output was written); the directory
        too when that leaves it empty."""
        _wipe(self.journal)
        with _suppress():
            self.journal.rmdir()


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


class OverlaySource:
    """A weight source serving ``overrides`` instead of the wrapped source's tensors;
    everything else is the wrapped source's. An override is a tensor, or a callable that
    makes it (a quantized weight dequantized when the runtime asks for it, so a layer's
    896 experts are held as their compact parts, not dequantized all at once)."""

    def __init__(self, source, overrides: dict | None = None):
        self._src = source
        self.overrides: dict = dict(overrides or {})

    @property
    def config(self):
        return self._src.config

    def names(self):
        return self._src.names()

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.overrides.get(name)
        if t is None:
            return self._src.get(name, dtype)
        if callable(t):
            t = t()
        return t if dtype is None else t.to(dtype)

    def __getattr__(self, item):
        return getattr(self._src, item)


def _dequantized(scheme: Scheme, parts: dict) -> torch.Tensor:
    return scheme.dequantize(parts).to(torch.float32)


def _qmax(scheme: Scheme) -> float:
    act = scheme.act
    if act.type == "float":
        return FP8_MAX if act.num_bits == 8 else FP4_MAX
    return float(2 ** (act.num_bits - 1) - 1)


def gptq_supported(scheme: Scheme) -> bool:
    return isinstance(scheme, (IntScheme, FP8Scheme))


def _group_of(scheme: IntScheme, shape) -> int:
    """Input channels per scale group of an integer scheme on a weight of ``shape``."""
    return int(shape[1]) // scheme._ngroups(int(shape[1]))


def _round_to_nearest(ckpt, name: str, scheme: Scheme, w: torch.Tensor, smoothed: bool):
    """A rounded-to-nearest Linear's parts as the writer will store them: an MXFP4 source
    (not smoothed) through :mod:`..quant.fp4_requant` (the exact NVFP4 / FP8 transcode,
    int4's searched scales), so the layers after it calibrate on the written values;
    else the scheme's own quantize of ``w``. (Its transcode warning is the writer's.)"""
    if not smoothed and ckpt.meta(name).encoding == fmt.MXFP4 and fp4_requant.supported(scheme):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fp4_requant.TranscodeLossWarning)
            parts = fp4_requant.requantize(ckpt.get_parts(name), scheme, name=name)
        if parts is not None:
            return parts
    return scheme.quantize(w, name=name)


def _static(scheme: Scheme) -> bool:
    """A scheme with a calibrated per-Linear input parameter: a static input scale, or
    NVFP4's input global scale (:func:`_nv_input`)."""
    return (scheme.needs_input_scale and scheme.act.strategy == "tensor") or _nv_input(scheme)


def _nv_input(scheme: Scheme) -> bool:
    """NVFP4 activations: local scales on the fly under a static ``input_global_scale``."""
    return scheme.act is not None and scheme.act.strategy == "tensor_group"


#: NVFP4's input global scale is e4m3's max times E2M1's over the Linear's largest |input|
#: (compressed-tensors' ``generate_gparam``, as llm-compressor calibrates it); below this
#: largest |input| it would not be a finite float32
_NV_GLOBAL_NUM = FP8_MAX * FP4_MAX
_NV_MIN_AMAX = _NV_GLOBAL_NUM / float(torch.finfo(torch.float32).max)


def _input_value(scheme: Scheme, clip: float) -> float | None:
    """What calibration stores for a Linear whose inputs' clip value is ``clip``: its
    static input scale (``clip / qmax``), or NVFP4's input global scale (float32, from
    the largest |input|); None where no finite positive value follows (no real input)."""
    if _nv_input(scheme):
        if not math.isfinite(clip) or clip < _NV_MIN_AMAX:
            return None
        # scalar / tensor, as compressed-tensors writes it (torch computes it as the
        # tensor's reciprocal times the scalar: the same float32 bits)
        g = float(_NV_GLOBAL_NUM / torch.tensor([clip], dtype=torch.float32))
        return g if math.isfinite(g) and g > 0 else None
    return max(clip, torch.finfo(torch.float32).tiny) / _qmax(scheme)


def _fingerprint(ckpt, plan, algorithm: str, opts: SequentialOptions, calib) -> str:
    h = hashlib.sha256()
    root = Path(ckpt.root)
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                   for p in root.iterdir() if p.suffix == ".safetensors")  # fmt: skip
    rows = [(r.name, None if r.kept else r.scheme.name,
             None if r.kept else r.scheme.options(), r.as_stored) for r in plan.rows]  # fmt: skip
    media = sorted({(p, os.stat(p).st_size, os.stat(p).st_mtime_ns)
                    for paths in (calib.images or []) for p in paths})  # fmt: skip
    meta = {"v": _JOURNAL_VERSION, "k3": _k3_version, "config": ckpt.config, "files": files,
            "media": media,
            "rows": rows, "algorithm": algorithm, "options": opts.algorithm_options(algorithm),
            "calibration": calib.fingerprint}  # fmt: skip
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return h.hexdigest()


class _Hidden:
    """The hidden states of every micro-batch entering layer ``self.layer`` (tensors, or
    AttnResState), in memory or spilled as ``hidden-L<layer>-<batch>.safetensors`` in the
    journal directory. The next layer's states are written beside them (never over them),
    so a run killed mid-layer resumes from intact files."""

    def __init__(self, n: int, journal: Path, spill: bool, writer: bool = True,
                 prefix: str = "hidden"):  # fmt: skip
        self.n, self.journal, self.spill = n, journal, spill
        self.prefix = prefix  # "fphidden": the full-precision stream (gptq_fp_target)
        #: False on torchrun processes other than 0: they compute the same states and
        #: read process 0's spilled files, but write none
        self.writer = writer
        self.layer = 0
        self._mem: list = [None] * n
        self._next: list = [None] * n

    def path(self, layer: int, b: int) -> Path:
        return self.journal / f"{self.prefix}-L{layer}-{b}.safetensors"

    def _save(self, layer: int, b: int, h) -> None:
        if not self.writer:
            return
        tmp = self.journal / f"{self.prefix}-L{layer}-{b}.tmp"
        save_file(_pack(h), str(tmp))
        os.replace(tmp, self.path(layer, b))

    def _load(self, layer: int, b: int):
        with safe_open(str(self.path(layer, b)), "pt") as f:
            return _unpack({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118

    def get(self, b: int):
        return self._load(self.layer, b) if self.spill else self._mem[b]

    def put_first(self, b: int, h) -> None:
        """Layer 0's input (the embeddings)."""
        if self.spill:
            self._save(0, b, h)
        else:
            self._mem[b] = h

    def put_next(self, b: int, h) -> None:
        if self.spill:
            self._save(self.layer + 1, b, h)
        else:
            self._next[b] = h

    def advance(self, checkpoint: bool) -> None:
        """The next layer's states become current; checkpoint: write them to the journal
        (in-memory mode; spilled ones are there already)."""
        if not self.spill:
            self._mem, self._next = self._next, [None] * self.n
            if checkpoint:
                for b in range(self.n):
                    self._save(self.layer + 1, b, self._mem[b])
        self.layer += 1

    def resume(self, layer: int) -> None:
        self.layer = layer
        if not self.spill:
            self._mem = [self._load(layer, b) for b in range(self.n)]

    def drop(self, layer: int) -> None:
        if not self.writer:
            return
        for b in range(self.n):
            self.path(layer, b).unlink(missing_ok=True)


def _pack(h) -> dict[str, torch.Tensor]:
    if isinstance(h, AttnResState):
        return {"state": h.pack().contiguous()}
    return {"hidden": h.contiguous()}


def _unpack(d: dict[str, torch.Tensor]):
    if "state" in d:
        return AttnResState.unpack(d["state"])
    return d["hidden"]


def token_mask(valid: torch.Tensor, tok: torch.Tensor | None, x: torch.Tensor, what: str):
    """Which rows of a Linear's input ``x`` are real tokens: ``valid`` the micro-batch's
    mask [B, S]; ``tok`` the token rows routed to an expert (None: x covers the batch)."""
    if tok is not None:
        return valid.reshape(-1)[tok.to(valid.device)]
    if valid.numel() == math.prod(x.shape[:-1]):
        return valid.reshape(x.shape[:-1])
    raise ConfigError(
        f"{what} has shape {tuple(x.shape)}, which does not map onto the batch's "
        f"{tuple(valid.shape)} tokens."
    )


def check_algorithm(plan, algorithm: str) -> None:
    """Errors before any work: unknown algorithm, schemes GPTQ cannot handle, nothing for
    ``static`` to calibrate."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(
            f"calibration algorithm '{algorithm}' is not known; use one of {', '.join(ALGORITHMS)}."
        )
    rows = [r for r in plan.quantized if not r.as_stored]
    if algorithm in SMOOTHING:
        bad = sorted({r.scheme.name for r in rows
                      if getattr(r.scheme, "shares_global_scale", False)})  # fmt: skip
        if bad:
            raise ConfigError(
                f"--algorithm {algorithm} does not handle scheme(s) {', '.join(bad)} (their "
                f"fused Linears share one global scale); use --algorithm rtn, or a scheme "
                f"without a global scale (int, fp8, mxfp4)."
            )
    if algorithm in GPTQ_ALGORITHMS:
        bad = sorted({r.scheme.name for r in rows if not gptq_supported(r.scheme)})
        if bad:
            raise ConfigError(
                f"GPTQ handles int and FP8 schemes; scheme(s) {', '.join(bad)} are not "
                f"supported. Use --algorithm rtn (or static) for them, or another scheme."
            )
    if algorithm == "static" and not any(_static(r.scheme) for r in rows):
        names = ", ".join(sorted({r.scheme.name for r in rows})) or "none"
        raise ConfigError(
            f"--algorithm static calibrates static input scales, but no quantized Linear's "
            f"scheme has one (schemes: {names}); use a static scheme such as fp8 or nvfp4, or "
            f"--algorithm gptq."
        )


def calibrate_sequential(
    ckpt,
    plan,
    calib: CalibrationSet,
    *,
    algorithm: str,
    options: SequentialOptions,
    journal: str | os.PathLike,
    observer: Observer | None = None,
    log: Callable[[str], None] | None = None,
    group=None,
) -> SequentialResult:
    """Calibrate every decoder layer of ``ckpt`` in order (see the module doc).

    group: the torchrun job (:class:`k3convert.parallel.procs.ProcessGroup`; default a
    group of one). Every process runs each layer's forward passes (the same inputs, the
    same statistics); the GPTQ solves of a layer - one per Linear, the routed experts
    being most of them - are split over the processes by cost, each writes its parts to
    the journal, and every process reads all of them before the quantized layer runs.
    Process 0 alone writes the journal's state and the hidden-state checkpoints.

    plan: :func:`~k3convert.quant.planning.plan_quantization`'s plan (which rows are
    quantized with which scheme); calib: the calibration set; journal: the directory of
    the resume journal and the per-layer GPTQ parts (also the spill directory of the
    hidden states when ``options.offload_dir`` is set: then pass it as ``journal``).
    """
    from ..runtime.runtime import Runtime

    options.check()
    check_algorithm(plan, algorithm)
    if calib.images:
        _check_media(calib)
    from ..parallel.procs import ProcessGroup

    group = group if group is not None else ProcessGroup()
    log = log or (lambda s: None)
    journal = Path(journal)
    fp = _fingerprint(ckpt, plan, algorithm, options, calib)
    state = _read_journal(journal)
    group.barrier()  # every process has read the state before process 0 may replace it
    if state is not None and state.get("fingerprint") != fp:
        log(f"calibration journal {journal} is for other inputs; starting over.")
        state = None
        if group.leader:
            _wipe(journal)
    if group.leader:
        journal.mkdir(parents=True, exist_ok=True)
    if state is None:
        state = {"fingerprint": fp, "done": 0, "layers": []}
        if group.leader:
            _write_journal(journal, state)
    group.barrier()

    src = OverlaySource(ckpt)
    rt = Runtime(src, dtype=options.dtype, prefetch=False, act_quant=False)
    try:
        return _run(rt, src, ckpt, plan, calib, algorithm, options, journal, state, observer,
                    log, group)  # fmt: skip
    finally:
        rt.close()


def _run(rt, src, ckpt, plan, calib, algorithm, options, journal, state, observer, log, group):
    ids, mask = calib.input_ids, calib.attention_mask
    bs = options.batch_size
    if calib.images:  # one sample a micro-batch, its placeholders widened to its images
        batches, pixels = _media_batches(rt, calib)
    else:
        batches = [(ids[k : k + bs], mask[k : k + bs]) for k in range(0, ids.shape[0], bs)]
        pixels = [None] * len(batches)
    hidden = _Hidden(len(batches), journal, spill=options.offload_dir is not None,
                     writer=group.leader)  # fmt: skip
    fp = None  # gptq_fp_target: the full-precision model's hidden states, beside hidden
    if options.gptq_fp_target and algorithm in GPTQ_ALGORITHMS:
        fp = _Hidden(len(batches), journal, spill=options.offload_dir is not None,
                     writer=group.leader, prefix="fphidden")  # fmt: skip
    pos = [rt.default_positions(b_ids) for b_ids, _ in batches]
    masks = [m.to(torch.bool) for _, m in batches]
    # attention masks as the runtime takes them (None when a batch has no padding)
    amasks = [None if bool(m.all()) else m for m in masks]
    done = int(state["done"])
    rows = {r.name: r for r in plan.rows if not r.kept and not r.as_stored}
    allrows = {r.name: r for r in plan.rows}
    if done == 0:
        for b, (b_ids, _) in enumerate(batches):
            pv, grid = pixels[b] if pixels[b] is not None else (None, None)
            h = rt.embed(b_ids, pixel_values=pv, image_grid_thw=grid)
            hidden.put_first(b, h)
            if fp is not None:
                fp.put_first(b, h)
        group.barrier()  # (spilled: process 0's files are the others' inputs)
    elif done < rt.num_layers:
        hidden.resume(done)
        if fp is not None:
            fp.resume(done)
        log(f"calibration: resuming after layer {done - 1} (journal {journal})")
    else:  # every layer finished (the write after it failed): nothing left to run
        log(f"calibration: every layer already calibrated (journal {journal})")
    res = SequentialResult(algorithm, journal, resumed_from=done, calibration=calib.describe())
    if rt.text.num_experts:
        res.top_k = int(rt.text.top_k)
    for rec in state["layers"]:
        _absorb(res, rec)
    for i in range(done, rt.num_layers):
        t0 = time.perf_counter()
        rec = _layer(rt, src, ckpt, rows, allrows, i, algorithm, options, hidden, pos, masks,
                     amasks, journal, observer, group, fp)  # fmt: skip
        rec["seconds"] = time.perf_counter() - t0
        last = i + 1 == rt.num_layers
        if not last:
            hidden.advance(checkpoint=True)
            if fp is not None:
                fp.advance(checkpoint=True)
        state["layers"].append(rec)
        state["done"] = i + 1
        if group.leader:
            _write_journal(journal, state)
        hidden.drop(i)
        if fp is not None:
            fp.drop(i)
        if group.world > 1:
            group.barrier()  # the layer's journal and hidden states are on disk
            if group.leader:
                for p in journal.glob(f"layer-{i}.gptq-*.safetensors"):
                    p.unlink()
        _absorb(res, rec)
        fb = f", {len(rec['fallbacks'])} expert(s) fell back to RTN" if rec["fallbacks"] else ""
        log(f"calibrated layer {i} in {rec['seconds']:.2f} s{fb}")
    return res


def _check_media(calib: CalibrationSet) -> None:
    """Image samples must come pre-processed: a ``.safetensors`` file holding the
    processor's ``pixel_values`` and ``image_grid_thw`` (Moonshot's image processor is
    the model directory's code, which k3convert never runs)."""
    for i, paths in enumerate(calib.images):
        for p in paths:
            if not str(p).endswith(".safetensors"):
                raise ConfigError(
                    f"{calib.source}: sample {i}'s image {p} is an image file; k3convert does "
                    f"not run the model's own image processor (its code lives in the model "
                    f"directory). Run the processor elsewhere, save its pixel_values and "
                    f"image_grid_thw with safetensors, and list that .safetensors file instead."
                )


def _media_batches(rt, calib: CalibrationSet):
    """One micro-batch per sample (its padding dropped), with its pixels: (batches,
    pixels); placeholders are widened as the model does (``Runtime.expand_media``)."""
    if rt.vision is None:
        raise ConfigError(
            f"{calib.source}: the calibration set holds images, but the model has no vision "
            f"tower the runtime runs."
        )
    batches, pixels = [], []
    for i, paths in enumerate(calib.images):
        real = calib.attention_mask[i].to(torch.bool)
        row = calib.input_ids[i][real][None]
        if not paths:
            batches.append((row, torch.ones_like(row)))
            pixels.append(None)
            continue
        pv, grid = [], []
        for p in paths:
            with safe_open(str(p), "pt") as f:
                keys = set(f.keys())
                if not {"pixel_values", "image_grid_thw"} <= keys:
                    raise ConfigError(
                        f"{p}: a pre-processed image file holds pixel_values and "
                        f"image_grid_thw; found {', '.join(sorted(keys)) or 'nothing'}."
                    )
                pv.append(f.get_tensor("pixel_values"))
                grid.append(f.get_tensor("image_grid_thw").long().reshape(-1, 3))
        g = torch.cat(grid)
        wide, _ = rt.expand_media(row, g)
        batches.append((wide, torch.ones_like(wide)))
        pixels.append((torch.cat(pv), g))
    return batches, pixels


def _absorb(res: SequentialResult, rec: dict) -> None:
    res.input_scales.update(rec["scales"])
    res.layer_seconds.append(rec["seconds"])
    res.expert_tokens.update(rec["expert_tokens"])
    if rec.get("routing") is not None:
        res.routing_counts[int(rec["layer"])] = list(rec["routing"])
    res.fallbacks.extend(rec["fallbacks"])
    res.part_rows.update({n: rec["layer"] for n in rec["parts"]})
    res.kept_rows.update({n: rec["layer"] for n in rec.get("kept", [])})
    for label, v in rec.get("smoothing", {}).items():
        res.smoothing[label] = v
    if rec.get("kv"):
        res.kv_absmax[int(rec["layer"])] = dict(rec["kv"])
    for r, k in enumerate(rec.get("solves") or []):  # GPTQ solves per torchrun process
        while len(res.solves_per_process) <= r:
            res.solves_per_process.append(0)
        res.solves_per_process[r] += k


def _layer(rt, src, ckpt, rows, allrows, i, algorithm, options, hidden, pos, masks, amasks,
           journal, observer, group, fp=None) -> dict:  # fmt: skip
    unit = f"layer.{i}"
    entries = rt.plan.units[unit]
    by_name = {e.name: e for e in entries.values()}
    mine = {n: rows[n] for n in by_name if n in rows}
    gptq = {n for n, r in mine.items() if algorithm in GPTQ_ALGORITHMS and gptq_supported(r.scheme)}
    # AWQ's clip step: every group-wise integer Linear's ranges searched on its output
    # error (per channel the Gram block would be the whole [in, in] matrix and each
    # candidate a full quadratic form: those keep the scheme's own rounding)
    clip = set()
    if algorithm == "awq" and options.awq_clip:
        clip = {n for n, r in mine.items()
                if isinstance(r.scheme, IntScheme) and r.scheme.strategy == "group"}  # fmt: skip
    static = {n for n, r in mine.items() if _static(r.scheme)}
    # under torchrun each process solves (and accumulates the Hessians of) its share of
    # the GPTQ Linears, balanced by the solve's cost; the others' come from the journal
    others: set[str] = set()
    if group.world > 1:
        from ..parallel.procs import balance

        def cost(n: str) -> int:  # the Hessian's Cholesky and the column sweep
            o, k = mine[n].shape
            return int(k) * int(k) * (int(k) + int(o))

        order = sorted(gptq | clip)
        others = set(order) - set(balance(order, cost, group.world)[group.rank])
    acc = {n: HessianAccumulator(int(mine[n].shape[1]), n) for n in gptq if n not in others}
    # gptq_fp_target: each solved Linear's cross term against the full-precision inputs
    # (the FP stream ``fp`` runs through every layer on every process, solved here or not)
    cross = {}
    if fp is not None:
        cross = {n: CrossAccumulator(int(mine[n].shape[1]), n) for n in acc}
    fp_experts = sorted({by_name[n].role.expert for n in cross
                         if by_name[n].role.expert is not None})  # fmt: skip
    gram = {n: GroupGram(int(mine[n].shape[1]), _group_of(mine[n].scheme, mine[n].shape), n)
            for n in clip if n not in others}  # fmt: skip
    # static input scales' observers; capacity: real tokens x input width bounds what
    # any Linear of the layer sees (a token reaches an expert at most once)
    real = sum(int(m.sum()) for m in masks)
    # (NVFP4's global scale is always the largest |input|'s, as compressed-tensors sets it)
    obs = {n: make_observer("minmax" if _nv_input(mine[n].scheme) else options.observer,
                            percentile=float(options.percentile),
                            capacity=max(1, real * int(mine[n].shape[1])),
                            act_type=mine[n].scheme.act.type,
                            act_bits=int(mine[n].scheme.act.num_bits))
           for n in static}  # fmt: skip
    seen: dict[str, int] = dict.fromkeys(mine, 0)  # tokens in the statistics
    routed: dict[str, int] = dict.fromkeys(mine, 0)  # tokens routed (experts)
    cur: dict = {}  # the micro-batch's valid mask and per-expert token rows
    router = next((e.name for e in entries.values() if e.key == "router.router"), None)
    latent_in = next((e.name for e in entries.values()
                      if e.key == "latent.routed_expert_down_proj"), None)  # fmt: skip
    n_exp = rt.text.num_experts
    routing = [0] * n_exp if router is not None else None
    all_experts = bool(options.moe_all_experts) and router is not None
    # experts with a calibrated Linear: the ones the all-experts pass runs
    calibrated_experts = sorted({by_name[n].role.expert for n in mine
                                 if by_name[n].role.expert is not None})  # fmt: skip
    # smoothing (AWQ / SmoothQuant): its mappings, and the Linears whose inputs it observes
    kind = SMOOTHING.get(algorithm)
    maps = []
    if kind is not None:
        keys = {e.key: e.name for e in entries.values()}
        fixed = any(n.endswith((".k_scale", ".v_scale")) for n in allrows)  # kept scales
        maps = layer_mappings(rt.text, i, keys, allrows, norms_only=False, cache_fixed=fixed)
    stats = Statistics(options.smooth_tokens, hidden.n)
    sources = {m.source for m in maps}
    # every smoothing choice is judged on sampled rows (SmoothQuant's too: a mapping is
    # smoothed only where it helps, see smooth.SQ_MIN_GAIN)
    sampled = sources | {n for m in maps for n in m.routed}
    stat_names = sources | sampled

    # gptq_fp_target: the full-precision inputs of this micro-batch's solved Linears, in
    # call order (the FP pass records them, the quantized pass takes them), and the FP
    # stream's routed-expert input (every expert's: the post-attention-norm rows)
    fp_in: dict[str, list[torch.Tensor]] = {}
    fp_state: dict = {}

    def fp_expert_inputs(tok: dict | None) -> None:
        """Run the solved routed experts on the FP stream's expert input at the rows the
        quantized pass routes to each (``tok``; None: every row), recording their
        Linears' inputs (gate / up: those rows; down: what the FP expert computes)."""
        _experts_pass(rt, unit, cur, fp_experts, fp_state.get("expert_input"), "fp_sub",
                      "gptq_fp_target (full-precision input)", tok)  # fmt: skip

    def on_router(name, x, y):
        if cur.get("mute"):  # AWQ's loss runs: no statistics
            return
        if cur.get("fp"):  # the FP pass: its routing is not used, only its expert input
            if latent_in is None:
                fp_state["expert_input"] = x
            return
        if cur.get("refine") or cur.get("smooth"):
            w = rt.loader.get(unit)
            _, idx = ROUTERS[rt.text.router](rt.text, y, w)
            order = idx.reshape(-1).argsort(stable=True)
            counts = torch.bincount(idx.reshape(-1), minlength=n_exp).tolist()
            cur["experts"] = dict(enumerate((order // idx.shape[1]).split(counts)))
            if all_experts and latent_in is None:
                cur["expert_input"] = x
            return
        w = rt.loader.get(unit)
        _, idx = ROUTERS[rt.text.router](rt.text, y, w)
        k = idx.shape[1]
        eid = idx.reshape(-1)
        order = eid.argsort(stable=True)
        tok = order // k
        counts = torch.bincount(eid, minlength=n_exp).tolist()
        cur["experts"] = dict(enumerate(tok.split(counts)))
        valid = cur["mask"].reshape(-1).to(idx.device)
        real = torch.bincount(idx[valid].reshape(-1), minlength=n_exp).tolist()
        for j, c in enumerate(real):
            routing[j] += int(c)
        if all_experts and latent_in is None:
            cur["expert_input"] = x  # [T, D] float32: every token, the experts' input
        if fp_experts and not all_experts:  # FP inputs at the rows routed here
            fp_expert_inputs(cur["experts"])

    def on_latent_input(name, x, y):
        if cur.get("fp"):
            fp_state["expert_input"] = y
        elif not cur.get("fp_sub"):
            cur["expert_input"] = y

    def rows_mask(name, e, x):
        routed = e.role.expert is not None and not cur.get("all")
        tok = cur["experts"][e.role.expert] if routed else None
        return token_mask(cur["mask"], tok, x, f"calibration: the input of '{name}'")

    def on_linear(name, x, y):
        e = by_name.get(name)
        if e is None or cur.get("mute"):
            return
        if cur.get("fp") or cur.get("fp_sub"):  # the FP stream: inputs recorded only
            if name in cross and (cur.get("fp_sub") or e.role.expert is None):
                fp_in.setdefault(name, []).append(x)
            return
        if cur.get("smooth"):  # smoothing statistics of the unsmoothed layer
            if name in stat_names:
                m = rows_mask(name, e, x).reshape(-1).to(torch.bool)
                stats.add(name, x.reshape(-1, x.shape[-1])[m], sample=name in sampled)
            return
        if name not in mine:
            return
        valid = cur["mask"]
        if e.role.expert is not None and all_experts and not cur.get("all"):
            # routed pass: counted, statistics come from the all-tokens pass
            if cur.get("refine"):
                return
            tok = cur["experts"][e.role.expert]
            routed[name] += int(valid.reshape(-1)[tok.to(valid.device)].sum())
            return
        m = rows_mask(name, e, x)
        if cur.get("refine"):  # second pass: observers that need one (mse)
            if name in static and obs[name].needs_refine:
                obs[name].refine(x[m.to(torch.bool)])
            return
        if observer is not None:
            observer(i, name, x, m)
        if name in acc:
            acc[name].add(x, m)
        if name in cross:
            got = fp_in.get(name)
            if not got:
                raise ConfigError(
                    f"calibration: gptq_fp_target found no full-precision input for "
                    f"'{name}' in layer {i}; calibrate without it."
                )
            cross[name].add(x, got.pop(0), m)
        if name in gram:
            gram[name].add(x, m)
        n = int(m.sum())
        seen[name] += n
        if e.role.expert is not None and not all_experts:
            routed[name] += n
        if name in static and n:
            obs[name].update(x[m.to(torch.bool)])

    handles = [rt.add_hook(on_linear, set(mine) | stat_names)]
    if router is not None:
        handles.append(rt.add_hook(on_router, {router}))
    if (all_experts or fp_experts) and latent_in is not None:
        handles.append(rt.add_hook(on_latent_input, {latent_in}))
    sm = Smoothing()
    last = i + 1 == rt.num_layers
    try:
        if maps:
            for b in range(hidden.n):
                cur.clear()
                cur["mask"], cur["smooth"] = masks[b], True
                rt.run_layer(i, hidden.get(b), pos[b], amasks[b])
            rt.loader.release()
            loss = None
            if kind == "awq":
                cur.clear()
                cur["mute"] = True
                loss = _LayerLoss(rt, src, i, hidden, pos, masks, amasks, options.smooth_tokens)
            sm = _choose_smoothing(ckpt, allrows, maps, stats, kind, options, loss)
            loss = None
            cur.clear()
            stats = None  # its samples are not needed any more
        touched = sm.touched()

        def smoothed(n: str) -> torch.Tensor:
            """A smoothed tensor: float32 for a quantized row, the output dtype if kept."""
            t = sm.apply(n, ckpt.get(n).float())
            return t if n in mine else t.to(allrows[n].out_dtype)

        # the layer runs on its smoothed (unquantized) weights for the statistics below
        src.overrides = {n: functools.partial(smoothed, n) for n in touched}
        for b in range(hidden.n):
            if fp is not None and (cross or not last):
                # the full-precision stream: this layer (unquantized) on the FP model's
                # own hidden states; its Linears' inputs are the targets' Xf
                fp_in.clear()
                fp_state.clear()
                cur.clear()
                cur["fp"] = True
                y = rt.run_layer(i, fp.get(b), pos[b], amasks[b])
                if not last:
                    fp.put_next(b, y)
                del y
            cur.clear()
            cur["mask"] = masks[b]
            rt.run_layer(i, hidden.get(b), pos[b], amasks[b])
            if all_experts and calibrated_experts:
                if fp_experts:
                    fp_expert_inputs(None)
                _all_experts_pass(rt, unit, cur, calibrated_experts)
        if any(o.needs_refine for o in obs.values()):  # the same inputs again
            for b in range(hidden.n):
                cur.clear()
                cur["mask"], cur["refine"] = masks[b], True
                rt.run_layer(i, hidden.get(b), pos[b], amasks[b])
                if all_experts and calibrated_experts:
                    _all_experts_pass(rt, unit, cur, calibrated_experts)
    finally:
        for h in handles:
            h.remove()
        rt.loader.release()
        src.overrides = {}

    rec: dict = {"layer": i, "scales": {}, "expert_tokens": {}, "fallbacks": [], "parts": [],
                 "kept": [], "routing": routing, "smoothing": sm.chosen}  # fmt: skip
    for n in mine:
        if by_name[n].role.expert is not None:
            rec["expert_tokens"][n] = routed[n]
    parts_out: dict[str, torch.Tensor] = {}
    overrides: dict[str, torch.Tensor] = {}
    for n in sorted(mine):
        r = mine[n]
        if n in others:  # another process's solve
            continue
        w = smoothed(n) if n in touched else ckpt.get(n)
        if n in gptq and acc[n].tokens:
            H = acc[n].hessian()
            target = None
            if n in cross:  # gptq_fp_target: the weight whose outputs on X match the target
                target = fp_target_weight(w, H, cross.pop(n).cross(),
                                          strength=float(options.gptq_fp_target),
                                          dampening=float(options.dampening), name=n)  # fmt: skip
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", GPTQFallbackWarning)
                parts = gptq_quantize(w, H, r.scheme, block_size=options.block_size,
                                      dampening=float(options.dampening),
                                      act_order=bool(options.act_order), name=n,
                                      target=target)  # fmt: skip
            del target
            for c in caught:  # not positive definite: rounded to nearest (listed too)
                warnings.warn(c.message, c.category, stacklevel=2)
                if issubclass(c.category, GPTQFallbackWarning) and n not in rec["fallbacks"]:
                    rec["fallbacks"].append(n)
            rec["parts"].append(n)
            parts_out.update({f"{r.module}.{k}": v.contiguous() for k, v in parts.items()})
            del acc[n]  # [in, in] float32 each: freed as soon as it is used
        elif n in gram and gram[n].tokens:  # AWQ's clip step on the smoothed weight
            parts = mse_observer.quantize(r.scheme, w, name=n, gram=gram.pop(n).blocks())
            rec["parts"].append(n)
            parts_out.update({f"{r.module}.{k}": v.contiguous() for k, v in parts.items()})
        else:
            if n in gptq or n in clip or (n in static and not seen[n]):
                why = "saw no calibration token"
                warnings.warn(
                    f"calibration: '{n}' {why}; rounded to nearest"
                    + (" (input scale from its sibling experts)" if n in static else ""),
                    ExpertFallbackWarning, stacklevel=2,
                )  # fmt: skip
                rec["fallbacks"].append(n)
            parts = _round_to_nearest(ckpt, n, r.scheme, w, n in touched)
            if n in touched:  # the smoothed weight's parts (the source's are not these)
                rec["parts"].append(n)
                parts_out.update({f"{r.module}.{k}": v.contiguous() for k, v in parts.items()})
        overrides[n] = functools.partial(_dequantized, r.scheme, parts)
        del w
    if group.world == 1:
        rec["solves"] = [len(parts_out_names(parts_out, mine))]
    else:
        weight = lambda n: smoothed(n) if n in touched else ckpt.get(n)  # noqa: E731
        _share_solves(group, journal, i, mine, others, weight, rec, parts_out, overrides)
    for n in sorted(touched - set(mine)):  # kept tensors smoothing changed (norms, router)
        t = smoothed(n).contiguous()
        parts_out[n] = t
        overrides[n] = t
        rec["kept"].append(n)
    for n in sorted(static):
        if seen[n]:
            v = _input_value(mine[n].scheme, float(obs[n].clip()))
            if v is not None:
                rec["scales"][mine[n].module] = v
    for n in sorted(static):  # experts without tokens: their siblings' widest range
        mod = mine[n].module
        if mod in rec["scales"]:
            continue
        leaf = by_name[n].key.rsplit(".", 1)[-1]
        nv = _nv_input(mine[n].scheme)
        same = [m for m in static if mine[m].module in rec["scales"]
                and _nv_input(mine[m].scheme) == nv]  # fmt: skip
        sib = [rec["scales"][mine[m].module] for m in same
               if by_name[m].key.rsplit(".", 1)[-1] == leaf]  # fmt: skip
        if not sib:
            sib = [rec["scales"][mine[m].module] for m in same]
        if not sib:
            raise ConfigError(
                f"calibration: no calibration token reached any Linear of layer {i} with a "
                f"static input scale{' or NVFP4 input global scale' if nv else ''} (or only "
                f"zeros did); use more (or unpadded) calibration samples."
            )
        if n not in rec["fallbacks"] and seen[n]:  # tokens came, all of them zero
            warnings.warn(f"calibration: '{n}' saw only zero inputs; its input "
                          f"{'global ' if nv else ''}scale is its siblings'",
                          ExpertFallbackWarning, stacklevel=2)  # fmt: skip
            rec["fallbacks"].append(n)
        # the widest range: the largest input scale, the smallest NVFP4 global scale
        rec["scales"][mod] = min(sib) if nv else max(sib)
    if parts_out and group.leader:
        tmp = journal / f"layer-{i}.tmp"
        save_file(parts_out, str(tmp))
        os.replace(tmp, journal / f"layer-{i}.safetensors")
    kv = options.kv_cache is not None and rt.text.attention_of(i) != "kda"
    if last and not kv:
        return rec
    # re-run the layer with its quantized weights: the next layer's inputs, and what
    # enters its KV cache as served (the layer's own weights quantized)
    kv_max: dict[str, float] = {}
    batch_mask: list = [None]

    def on_kv(layer, kind, t):
        if layer != i:
            return
        m = batch_mask[0].to(t.device)
        if kind in ("k", "v"):  # [B, heads, S, d]
            sel = t.transpose(1, 2)[m]
        elif kind == "k_rot":  # [B, 1, S, rope]
            sel = t[:, 0][m]
        else:  # latent [B, S, r]
            sel = t[m]
        a = float(sel.abs().max()) if sel.numel() else 0.0
        kv_max[kind] = max(kv_max.get(kind, 0.0), a)

    handle = rt.add_kv_hook(on_kv) if kv else None
    src.overrides = overrides
    try:
        for b in range(hidden.n):
            batch_mask[0] = masks[b]
            y = rt.run_layer(i, hidden.get(b), pos[b], amasks[b])
            if not last:
                hidden.put_next(b, y)
    finally:
        if handle is not None:
            handle.remove()
        rt.loader.release()
        src.overrides = {}
    if kv:
        if not all(math.isfinite(v) for v in kv_max.values()):
            raise ConfigError(
                f"calibration: non-finite values entered layer {i}'s KV cache; check the "
                f"source weights and the calibration data."
            )
        rec["kv"] = kv_max
    return rec


def _share_solves(group, journal: Path, i: int, mine, others, weight, rec, parts_out,
                  overrides) -> None:  # fmt: skip
    """Under torchrun: write the parts of this process's share of layer ``i``'s GPTQ
    Linears, wait for every process, then take the others' parts (and their fallbacks)
    as if solved here. A Linear of another share that wrote no parts saw no token and was
    rounded to nearest: that is recomputed here (cheap, the same bytes). The record's
    lists keep the one-process order (sorted names)."""
    path = journal / f"layer-{i}.gptq-{group.rank}.safetensors"
    err = None
    try:
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in parts_out.items()}, str(tmp))
        os.replace(tmp, path)
    except OSError as e:
        err = e
    mine_solved = sum(1 for n in parts_out_names(parts_out, mine) if n not in others)
    lists = group.gather((rec["fallbacks"], rec["parts"], mine_solved))
    group.agree(err, f"writing its GPTQ parts of layer {i}")
    by_module = {mine[n].module: n for n in others}
    got: dict[str, dict[str, torch.Tensor]] = {}
    for r in range(group.world):
        if r == group.rank:
            continue
        with safe_open(str(journal / f"layer-{i}.gptq-{r}.safetensors"), "pt") as f:
            for k in f.keys():  # noqa: SIM118
                module, _, part = k.rpartition(".")
                if module in by_module:
                    t = f.get_tensor(k)
                    parts_out[k] = t
                    got.setdefault(by_module[module], {})[part] = t
    for n in sorted(others):
        parts = got.get(n)
        if parts is None:  # no token reached it: its owner rounded it to nearest
            parts = mine[n].scheme.quantize(weight(n), name=n)
        overrides[n] = functools.partial(_dequantized, mine[n].scheme, parts)
    fb = {n for f, _, _ in lists for n in f}
    done = {n for _, p, _ in lists for n in p}
    rec["solves"] = [k for _, _, k in lists]
    rec["fallbacks"] = [n for n in sorted(mine) if n in fb]
    rec["parts"] = [n for n in sorted(mine) if n in done]


def parts_out_names(parts_out: dict, mine: dict) -> set[str]:
    """The quantized rows whose parts are in ``parts_out``."""
    mods = {k.rpartition(".")[0] for k in parts_out}
    return {n for n, r in mine.items() if r.module in mods}


class _LayerLoss:
    """AWQ's block loss: the squared error of layer ``i``'s output over the real tokens of
    the first micro-batches (at least ``tokens`` of them) when the weights the caller
    names are replaced, against the exact layer."""

    def __init__(self, rt, src, i, hidden, pos, masks, amasks, tokens: int):
        self.rt, self.src, self.i = rt, src, i
        self.batches: list[int] = []
        n = 0
        for b in range(hidden.n):
            self.batches.append(b)
            n += int(masks[b].sum())
            if n >= tokens:
                break
        self.inputs = {b: hidden.get(b) for b in self.batches}
        self.args = {b: (pos[b], amasks[b], masks[b]) for b in self.batches}
        self.ref = self._outputs()

    def _outputs(self) -> dict[int, torch.Tensor]:
        """The layer's outputs on the sample batches (its weights loaded once)."""
        try:
            return {b: layer_output(self.rt.run_layer(self.i, self.inputs[b], p, am)).float()
                    for b, (p, am, _) in self.args.items()}  # fmt: skip
        finally:
            self.rt.loader.release()

    def __call__(self, names, fake) -> float:
        self.src.overrides = {n: functools.partial(fake, n) for n in names}
        try:
            out = self._outputs()
        finally:
            self.src.overrides = {}
        total = 0.0
        for b, y in out.items():
            d = (y - self.ref[b])[self.args[b][2].to(torch.bool)]
            total += float(d.pow(2).sum())
        return total


def _choose_smoothing(ckpt, allrows, maps, stats: Statistics, kind: str, options,
                      layer_loss=None) -> Smoothing:  # fmt: skip
    """The layer's smoothing scales from its unsmoothed statistics (AWQ: searched per
    mapping; SmoothQuant: closed form with ``options.alpha``). A mapping whose input saw
    no real token is left alone."""
    sm = Smoothing()

    def weight(n: str) -> torch.Tensor:
        return ckpt.get(n).float()

    def scheme_of(n: str):
        return allrows[n].scheme

    # routed experts: their inputs are not quantized where the checkpoint runs (see
    # runtime.runtime's module doc), so SmoothQuant scores their weights alone
    plain = frozenset(n for m in maps for n in m.balance if allrows[n].role.expert is not None)

    for m in maps:
        if not stats.count.get(m.source):
            continue
        if kind == "awq":
            s, ratio = awq_scales(m, weight, scheme_of, stats, options.awq_grid,
                                  options.awq_duo_scaling, layer_loss)  # fmt: skip
            sm.chosen[m.label] = ratio
            if ratio is None:
                continue
        else:
            alphas = SQ_ALPHAS if options.alpha_search else (float(options.alpha),)
            s, alpha = smoothquant_search(m, weight, scheme_of, stats, alphas, plain)
            sm.chosen[m.label] = alpha
            if alpha is None:
                continue
        sm.add(m, s)
    return sm


@torch.inference_mode()
def _experts_pass(rt, unit: str, cur: dict, experts: list[int], x, flag: str, what: str,
                  rows: dict | None = None) -> None:  # fmt: skip
    """Run the routed ``experts`` on the captured expert input ``x`` (every row, or
    ``rows[e]`` for expert e) with ``cur[flag]`` set, so the hooks take what ``what``
    needs; the outputs are discarded."""
    if x is None:
        raise ConfigError(
            f"calibration: {what} could not capture the routed experts' input in {unit}; "
            f"run without it."
        )
    w = rt.loader.get(unit)
    cur[flag] = True
    try:
        x = x.to(rt.dtype)
        for e in experts:
            r = x if rows is None else x.index_select(0, rows[e].to(x.device))
            if r.shape[0]:
                gated_mlp(rt.text, rt._linear, w, f"routed_experts.{e}", r)
    finally:
        cur[flag] = False


def _all_experts_pass(rt, unit: str, cur: dict, experts: list[int]) -> None:
    """Run every calibrated routed expert on all of the micro-batch's tokens (the hooks
    take their statistics; the outputs are discarded)."""
    _experts_pass(rt, unit, cur, experts, cur.get("expert_input"), "all", "moe_all_experts")


def _read_journal(journal: Path) -> dict | None:
    p = journal / _JOURNAL
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _write_journal(journal: Path, state: dict) -> None:
    tmp = journal / (_JOURNAL + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, journal / _JOURNAL)


def _wipe(journal: Path) -> None:
    """Remove the journal's own files (not anything else in an offload directory)."""
    pats = ("layer-*.safetensors", "hidden-L*.safetensors", "layer-*.tmp", "hidden-L*.tmp",
            "fphidden-L*.safetensors", "fphidden-L*.tmp", _JOURNAL, _JOURNAL + ".tmp")  # fmt: skip
    for pat in pats:
        for p in journal.glob(pat):
            if p.is_file():
                p.unlink()


__all__ = [
    "ALGORITHMS",
    "ExpertFallbackWarning",
    "OverlaySource",
    "SequentialOptions",
    "SequentialResult",
    "calibrate_sequential",
    "check_algorithm",
]

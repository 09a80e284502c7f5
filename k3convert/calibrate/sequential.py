"""Layer-sequential calibration on the runtime: GPTQ weights and static input scales.

This module is the driver (options, the hidden states between layers, the journal); one
layer's loop is :mod:`.layer` and each algorithm's share of it a pass of :mod:`.passes`.
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

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import __version__ as _k3_version
from ..checkpoint.bounded import read_json
from ..errors import ConfigError
from ..parallel.procs import ProcessGroup
from ..quant.writer import shared_amax
from ..runtime.decoder import AttnResState
from ..runtime.runtime import Runtime
from .data import CalibrationSet
from .layer import calibrate_layer
from .options import ALGORITHMS, GPTQ_ALGORITHMS, SequentialOptions
from .passes import (
    ExpertFallbackWarning,
    gptq_supported,
    static_input,
)

_JOURNAL = "journal.json"
_JOURNAL_VERSION = "k3convert-sequential-v2"

#: observer(layer, weight name, input, mask or None): every Linear input the engine feeds
#: to an accumulator (tests recompute Hessians from it; raising aborts the run)
Observer = Callable[[int, str, torch.Tensor, torch.Tensor | None], None]


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


def check_algorithm(plan, algorithm: str) -> None:
    """Errors before any work: unknown algorithm, schemes GPTQ cannot handle, nothing for
    ``static`` to calibrate."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(
            f"calibration algorithm '{algorithm}' is not known; use one of {', '.join(ALGORITHMS)}."
        )
    rows = [r for r in plan.quantized if not r.as_stored]
    if algorithm in GPTQ_ALGORITHMS:
        bad = sorted({r.scheme.name for r in rows if not gptq_supported(r.scheme)})
        if bad:
            raise ConfigError(
                f"GPTQ handles int, FP8 and FP4 schemes; scheme(s) {', '.join(bad)} are not "
                f"supported. Use --algorithm rtn (or static) for them, or another scheme."
            )
    if algorithm == "static" and not any(static_input(r.scheme) for r in rows):
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
    on_layer: Callable[[int], None] | None = None,
) -> SequentialResult:
    """Calibrate every decoder layer of ``ckpt`` in order (see the module doc).

    group: the torchrun job (:class:`k3convert.parallel.procs.ProcessGroup`; default a
    group of one). Every process runs each layer's forward passes (the same inputs, the
    same statistics); the GPTQ solves of a layer - one per Linear, the routed experts
    being most of them - are split over the processes by cost, each writes its parts to
    the journal, and every process reads all of them before the quantized layer runs.
    Process 0 alone writes the journal's state and the hidden-state checkpoints.
    on_layer(i): called when layer ``i`` is calibrated (progress; ``log`` gets the line).

    plan: :func:`~k3convert.quant.planning.plan_quantization`'s plan (which rows are
    quantized with which scheme); calib: the calibration set; journal: the directory of
    the resume journal and the per-layer GPTQ parts (also the spill directory of the
    hidden states when ``options.offload_dir`` is set: then pass it as ``journal``).
    """
    options.check()
    check_algorithm(plan, algorithm)
    if calib.images:
        _check_media(calib)
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
                    log, group, on_layer)  # fmt: skip
    finally:
        rt.close()


def _run(
    rt,
    src,
    ckpt,
    plan,
    calib,
    algorithm,
    options,
    journal,
    state,
    observer,
    log,
    group,
    on_layer=None,
):
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
    shared = shared_amax(ckpt, plan)  # NVFP4's fused sets: one global scale each
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
        rec = calibrate_layer(rt, src, ckpt, rows, allrows, i, algorithm, options, hidden,
                              pos, masks, amasks, journal, observer, group, fp,
                              shared)  # fmt: skip
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
        if on_layer is not None:
            on_layer(i)
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


def _read_journal(journal: Path) -> dict | None:
    p = journal / _JOURNAL
    if not p.is_file():
        return None
    try:  # a damaged (or not regular) journal is not used: the layers are recomputed
        return read_json(p, "report", ConfigError)
    except ConfigError:
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

"""The calibration algorithms of one decoder layer, each behind one small interface.

The layer loop (:mod:`.layer`) runs a layer's micro-batches under the runtime's hooks and
hands every pass the inputs of the Linears it listens to, with the mask of their real
(not padding) rows; once the statistics are in, each pass decides what it owns:

- :class:`GPTQPass`: the Hessians of the Linears GPTQ solves (with ``gptq_fp_target``
  also the cross terms against the full-precision stream's inputs) and their solve;
- :class:`ClipPass`: AWQ's clip step, each group-wise integer Linear's input Gram blocks
  and the range search on them;
- :class:`ObserverPass`: static input scales and NVFP4 input global scales, their
  observers, the second pass some need (``mse``), the siblings' value for an expert that
  saw no token;
- :class:`SmoothingPass`: AWQ / SmoothQuant, the statistics of the unsmoothed layer and
  the scales chosen from them;
- :class:`KVPass`: the largest |value| entering the layer's KV cache on the re-run.

A pass's ``record(name, x, mask)`` takes one Linear input; ``solve(name, w, scheme)``
returns the parts of a weight it quantizes, or None when the row is not its own (the
loop then rounds it to nearest).
"""

from __future__ import annotations

import math
import warnings

import torch

from .. import formats as fmt
from ..errors import ConfigError
from ..formats import FP4_MAX, FP8_MAX
from ..quant import fp4_requant, mse_observer
from ..quant.activations import nv_input_global_scale
from ..quant.mse_observer import GroupGram
from ..quant.schemes import IntScheme, Scheme
from .gptq import (
    CrossAccumulator,
    GPTQFallbackWarning,
    HessianAccumulator,
    fp_target_weight,
    gptq_quantize,
)
from .observers import make_observer
from .options import (
    AWQOptions,
    GPTQOptions,
    ObserverOptions,
    SmoothQuantOptions,
)
from .smooth import (
    SQ_ALPHAS,
    Smoothing,
    Statistics,
    awq_scales,
    layer_mappings,
    smoothquant_search,
)


class ExpertFallbackWarning(UserWarning):
    """A routed expert saw no calibration token and was rounded to nearest."""


# -- what each scheme asks of calibration -------------------------------------------------
def gptq_supported(scheme: Scheme) -> bool:
    return scheme.support.gptq is not None


def transcoded_exactly(ckpt, name: str, scheme: Scheme) -> bool:
    """Whether tensor ``name`` is released in MXFP4 and ``scheme``'s format holds its
    values (NVFP4: e4m3 scales under a global scale; FP8: a float per value; MXFP4: the
    same format): such a tensor is transcoded from its bytes (:mod:`..quant.fp4_requant`),
    and GPTQ leaves it alone unless asked (``gptq_solve_released``). Integer schemes
    cannot hold it: GPTQ solves those. (A scheme produced from the bytes needs the byte
    path, little-endian hosts; MXFP4 itself is exact through the float path too.)"""
    sup = scheme.support
    if ckpt.meta(name).encoding != fmt.MXFP4 or fmt.MXFP4 not in sup.holds:
        return False
    return not sup.transcodes or fp4_requant.supported(scheme)


def group_of(scheme: IntScheme, shape) -> int:
    """Input channels per scale group of an integer scheme on a weight of ``shape``."""
    return int(shape[1]) // scheme.ngroups(int(shape[1]))


def static_input(scheme: Scheme) -> bool:
    """A scheme with a calibrated per-Linear input parameter: a static input scale, or
    NVFP4's input global scale (:func:`nv_input`)."""
    return (scheme.needs_input_scale and scheme.act.strategy == "tensor") or nv_input(scheme)


def nv_input(scheme: Scheme) -> bool:
    """NVFP4 activations: local scales on the fly under a static ``input_global_scale``."""
    return scheme.act is not None and scheme.act.strategy == "tensor_group"


def _qmax(scheme: Scheme) -> float:
    act = scheme.act
    if act.type == "float":
        return FP8_MAX if act.num_bits == 8 else FP4_MAX
    return float(2 ** (act.num_bits - 1) - 1)


def input_value(scheme: Scheme, clip: float) -> float | None:
    """What calibration stores for a Linear whose inputs' clip value is ``clip``: its
    static input scale (``clip / qmax``), or NVFP4's input global scale (float32, from
    the largest |input|, :func:`..quant.activations.nv_input_global_scale`); None where no
    finite positive value follows (no real input)."""
    if nv_input(scheme):
        return nv_input_global_scale(clip)
    return max(clip, torch.finfo(torch.float32).tiny) / _qmax(scheme)


def dequantized(scheme: Scheme, parts: dict) -> torch.Tensor:
    return scheme.dequantize(parts).to(torch.float32)


def round_to_nearest(ckpt, name: str, scheme: Scheme, w: torch.Tensor, smoothed: bool,
                     share=None):  # fmt: skip
    """A rounded-to-nearest Linear's parts as the writer will store them: an MXFP4 source
    (not smoothed) through :mod:`..quant.fp4_requant` (the exact NVFP4 / FP8 transcode,
    int4's searched scales), so the layers after it calibrate on the written values;
    else the scheme's own quantize of ``w``. (Its transcode warning is the writer's.)
    share: the fused set's :class:`~..quant.writer.SharedScale` (NVFP4's global scale)."""
    if not smoothed and ckpt.meta(name).encoding == fmt.MXFP4 and fp4_requant.supported(scheme):
        top = share.top_code if share is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fp4_requant.TranscodeLossWarning)
            parts = fp4_requant.requantize(ckpt.get_parts(name), scheme, name=name,
                                           top_code=top)  # fmt: skip
        if parts is not None:
            return parts
    if share is not None and getattr(scheme, "shares_global_scale", False):
        return scheme.quantize(w, name=name, global_amax=share.amax)
    return scheme.quantize(w, name=name)


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


# -- the passes ---------------------------------------------------------------------------
class GPTQPass:
    """GPTQ on ``solved`` (this process's share: the others' solves come from the
    journal). With ``fp_target``, GPTAQ-style: each solved Linear also accumulates the
    cross term of its quantized-stream inputs against the full-precision stream's, which
    the FP pass records (:meth:`record_fp`) before the quantized pass of a micro-batch."""

    def __init__(self, rows: dict, solved, options: GPTQOptions, layer: int, fp_target: bool):
        self.options, self.layer = options, layer
        self.acc = {n: HessianAccumulator(int(rows[n].shape[1]), n) for n in solved}
        self.cross = {}
        if fp_target:
            self.cross = {n: CrossAccumulator(int(rows[n].shape[1]), n) for n in self.acc}
        #: the full-precision inputs of this micro-batch's solved Linears, in call order
        self.fp_in: dict[str, list[torch.Tensor]] = {}

    def record_fp(self, name: str, x: torch.Tensor) -> None:
        self.fp_in.setdefault(name, []).append(x)

    def record(self, name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
        if name in self.acc:
            self.acc[name].add(x, mask)
        if name in self.cross:
            got = self.fp_in.get(name)
            if not got:
                raise ConfigError(
                    f"calibration: gptq_fp_target found no full-precision input for "
                    f"'{name}' in layer {self.layer}; calibrate without it."
                )
            self.cross[name].add(x, got.pop(0), mask)

    def solve(self, name: str, w: torch.Tensor, scheme: Scheme,
              global_amax=None) -> tuple[dict, bool] | None:  # fmt: skip
        """(parts, fell back to round to nearest: Hessian not positive definite), or None
        when ``name`` is not solved here or saw no token. global_amax: NVFP4's fused set's
        largest |value| (its global scale)."""
        acc = self.acc.get(name)
        if acc is None or not acc.tokens:
            return None
        o = self.options
        H = acc.hessian()
        target = None
        if name in self.cross:  # gptq_fp_target: the weight whose outputs on X match it
            target = fp_target_weight(w, H, self.cross.pop(name).cross(),
                                      strength=float(o.fp_target),
                                      dampening=float(o.dampening), name=name)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", GPTQFallbackWarning)
            parts = gptq_quantize(w, H, scheme, block_size=o.block_size,
                                  dampening=float(o.dampening), act_order=bool(o.act_order),
                                  name=name, target=target,
                                  global_amax=global_amax)  # fmt: skip
        del target
        fell_back = False
        for c in caught:  # not positive definite: rounded to nearest (listed too)
            warnings.warn(c.message, c.category, stacklevel=4)
            fell_back |= issubclass(c.category, GPTQFallbackWarning)
        del self.acc[name]  # [in, in] float32 each: freed as soon as it is used
        return parts, fell_back


class ClipPass:
    """AWQ's clip step: each group-wise integer Linear's ranges searched for the smallest
    output error over the calibration tokens (per channel the Gram block would be the
    whole [in, in] matrix and each candidate a full quadratic form: those keep the
    scheme's own rounding)."""

    def __init__(self, rows: dict, names):
        self.gram = {n: GroupGram(int(rows[n].shape[1]), group_of(rows[n].scheme, rows[n].shape),
                                  n) for n in names}  # fmt: skip

    def record(self, name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
        if name in self.gram:
            self.gram[name].add(x, mask)

    def solve(self, name: str, w: torch.Tensor, scheme: Scheme) -> dict | None:
        g = self.gram.get(name)
        if g is None or not g.tokens:
            return None
        return mse_observer.quantize(scheme, w, name=name, gram=self.gram.pop(name).blocks())


class ObserverPass:
    """Static input scales (and NVFP4 input global scales) of ``names``: one observer per
    Linear; capacity (real tokens x input width) bounds what any Linear of the layer sees,
    as a token reaches an expert at most once. NVFP4's global scale is always the largest
    |input|'s, as compressed-tensors sets it."""

    def __init__(self, rows: dict, names, options: ObserverOptions, real_tokens: int):
        self.obs = {n: make_observer("minmax" if nv_input(rows[n].scheme) else options.observer,
                                     percentile=float(options.percentile),
                                     capacity=max(1, real_tokens * int(rows[n].shape[1])),
                                     act_type=rows[n].scheme.act.type,
                                     act_bits=int(rows[n].scheme.act.num_bits))
                    for n in names}  # fmt: skip

    @property
    def needs_refine(self) -> bool:
        return any(o.needs_refine for o in self.obs.values())

    def record(self, name: str, x: torch.Tensor, mask: torch.Tensor, tokens: int) -> None:
        if name in self.obs and tokens:
            self.obs[name].update(x[mask.to(torch.bool)])

    def refine(self, name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
        """The second pass over the same inputs (observers that need one: mse)."""
        if name in self.obs and self.obs[name].needs_refine:
            self.obs[name].refine(x[mask.to(torch.bool)])

    def scales(self, layer: int, rows: dict, keys: dict, seen: dict, fallbacks: list) -> dict:
        """Module -> stored value (:func:`input_value`). A Linear without a value (no real
        token, or only zeros) takes its siblings': the same projection of the other experts
        first, else any Linear of the layer with the same kind of value; the widest range
        (the largest input scale, the smallest NVFP4 global scale). ``keys``: name -> the
        table key (its last component names the projection); ``fallbacks`` gets the
        Linears that saw only zeros."""
        out: dict = {}
        for n in sorted(self.obs):
            if seen[n]:
                v = input_value(rows[n].scheme, float(self.obs[n].clip()))
                if v is not None:
                    out[rows[n].module] = v
        for n in sorted(self.obs):
            mod = rows[n].module
            if mod in out:
                continue
            leaf = keys[n].rsplit(".", 1)[-1]
            nv = nv_input(rows[n].scheme)
            same = [m for m in self.obs if rows[m].module in out
                    and nv_input(rows[m].scheme) == nv]  # fmt: skip
            sib = [out[rows[m].module] for m in same if keys[m].rsplit(".", 1)[-1] == leaf]
            if not sib:
                sib = [out[rows[m].module] for m in same]
            if not sib:
                raise ConfigError(
                    f"calibration: no calibration token reached any Linear of layer {layer} "
                    f"with a static input scale{' or NVFP4 input global scale' if nv else ''} "
                    f"(or only zeros did); use more (or unpadded) calibration samples."
                )
            if n not in fallbacks and seen[n]:  # tokens came, all of them zero
                warnings.warn(f"calibration: '{n}' saw only zero inputs; its input "
                              f"{'global ' if nv else ''}scale is its siblings'",
                              ExpertFallbackWarning, stacklevel=3)  # fmt: skip
                fallbacks.append(n)
            out[mod] = min(sib) if nv else max(sib)
        return out


class SmoothingPass:
    """AWQ / SmoothQuant on one layer: its mappings (:func:`.smooth.layer_mappings`), the
    statistics of their source and balance Linears on the unsmoothed layer (every choice is
    judged on sampled rows, SmoothQuant's too: a mapping is smoothed only where it helps,
    see :data:`.smooth.SQ_MIN_GAIN`), and the scales chosen from them."""

    def __init__(self, kind: str | None, text, layer: int, keys: dict, allrows: dict,
                 awq: AWQOptions, sq: SmoothQuantOptions, batches: int,
                 set_of=None, exact=frozenset()):  # fmt: skip
        self.kind, self.awq, self.sq = kind, awq, sq
        #: name -> its NVFP4 fused set's names (quant.writer.SharedScales.members) or None
        self.set_of = set_of
        self.maps = []
        if kind is not None:
            fixed = any(n.endswith((".k_scale", ".v_scale")) for n in allrows)  # kept scales
            self.maps = layer_mappings(text, layer, keys, allrows, norms_only=False,
                                       cache_fixed=fixed, exact=exact)  # fmt: skip
        self.stats = Statistics(awq.tokens, batches)
        sources = {m.source for m in self.maps}
        self.sampled = sources | {n for m in self.maps for n in m.routed}
        #: the Linears whose inputs the statistics take
        self.names = sources | self.sampled

    def record(self, name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
        if name in self.names:
            m = mask.reshape(-1).to(torch.bool)
            self.stats.add(name, x.reshape(-1, x.shape[-1])[m], sample=name in self.sampled)

    def choose(self, ckpt, allrows: dict, layer_loss=None) -> Smoothing:
        """The layer's smoothing scales from its unsmoothed statistics (AWQ: searched per
        mapping, judged by ``layer_loss``; SmoothQuant: closed form with the options'
        alpha, or the best of :data:`.smooth.SQ_ALPHAS`). A mapping whose input saw no real
        token is left alone. The statistics are dropped afterwards."""
        sm = Smoothing()
        stats, awq, sq = self.stats, self.awq, self.sq

        def weight(n: str) -> torch.Tensor:
            return ckpt.get(n).float()

        def scheme_of(n: str):
            return allrows[n].scheme

        # routed experts: their inputs are not quantized where the checkpoint runs (see
        # runtime.runtime's module doc), so SmoothQuant scores their weights alone
        plain = frozenset(n for m in self.maps for n in m.balance
                          if allrows[n].role.expert is not None)  # fmt: skip
        for m in self.maps:
            if not stats.count.get(m.source):
                continue
            if self.kind == "awq":
                s, ratio = awq_scales(m, weight, scheme_of, stats, awq.grid, awq.duo_scaling,
                                      layer_loss, self.set_of)  # fmt: skip
                sm.chosen[m.label] = ratio
                if ratio is None:
                    continue
            else:
                alphas = SQ_ALPHAS if sq.alpha_search else (float(sq.alpha),)
                s, alpha = smoothquant_search(m, weight, scheme_of, stats, alphas, plain,
                                              self.set_of, sq.min_gain)  # fmt: skip
                sm.chosen[m.label] = alpha
                if alpha is None:
                    continue
            sm.add(m, s)
        self.stats = None  # its samples are not needed any more
        return sm


class KVPass:
    """The largest |value| entering layer ``layer``'s KV cache, by kind (``k`` / ``v`` of
    GQA, ``k_rot`` and the ``latent`` of MLA), over the real tokens of the re-run with the
    layer's quantized weights (what the engine caches as served)."""

    def __init__(self, layer: int):
        self.layer = layer
        self.kv_max: dict[str, float] = {}
        #: the valid-token mask of the micro-batch being run
        self.mask: torch.Tensor | None = None

    def hook(self, layer: int, kind: str, t: torch.Tensor) -> None:
        if layer != self.layer:
            return
        m = self.mask.to(t.device)
        if kind in ("k", "v"):  # [B, heads, S, d]
            sel = t.transpose(1, 2)[m]
        elif kind == "k_rot":  # [B, 1, S, rope]
            sel = t[:, 0][m]
        else:  # latent [B, S, r]
            sel = t[m]
        a = float(sel.abs().max()) if sel.numel() else 0.0
        self.kv_max[kind] = max(self.kv_max.get(kind, 0.0), a)

    def result(self) -> dict[str, float]:
        if not all(math.isfinite(v) for v in self.kv_max.values()):
            raise ConfigError(
                f"calibration: non-finite values entered layer {self.layer}'s KV cache; "
                f"check the source weights and the calibration data."
            )
        return self.kv_max

"""Smoothing: per-input-channel scales moved between an op and the Linears it feeds
(AWQ, SmoothQuant).

For a *mapping* ``prev -> balance``, where every Linear in ``balance`` reads the output of
``prev`` (an RMSNorm's weight, or a Linear's rows), dividing ``prev``'s output channel
``j`` by ``s_j`` and multiplying column ``j`` of every reader by ``s_j`` leaves the layer's
function unchanged (exactly, up to rounding) while changing what each quantized reader
has to represent: channels with large inputs get larger (finer-quantized) weights.

- **SmoothQuant** (Xiao et al., https://arxiv.org/abs/2211.10438) moves activation
  outliers into the weights for W8A8: ``s = max|x|^alpha / max|W|^(1 - alpha)`` per
  channel (``max|W|`` over the balance Linears' columns), computed from the calibration
  statistics; a mapping is smoothed only where its W8A8 output error on sampled rows
  drops by :data:`SQ_MIN_GAIN` (``--alpha-search``: the best of several alphas). Routed
  experts' inputs are not quantized where the checkpoint is run (transformers'
  compressed-tensors integration, the runtime by default): their part of that error is
  the weights' alone, and their own ``up_proj -> down_proj`` mappings are left alone. Unlike
  the paper (and llm-compressor), which smooth only the norm -> Linears sites, every
  mapping below is a candidate, ``up_proj -> down_proj`` too: a trained model's largest
  activation outliers are down_proj's inputs.
- **AWQ** (Lin et al., https://arxiv.org/abs/2306.00978) protects salient weight channels
  for low-bit weight-only schemes: ``s = mean|x|^r / mean|W~|^(1 - r)`` ("duo scaling";
  ``mean|W~|`` the balance weights' magnitudes normalised per quantization group,
  averaged over rows), normalised by ``sqrt(max(s) * min(s))``; the ratio ``r`` is
  searched on a grid ``0, 1/n, ... (n-1)/n`` (plus ``s = 1``, so a search never does worse
  on its own loss than no smoothing) for the least summed squared error
  ``|| x Q(W s)^T / s - x W^T ||^2`` over the balance Linears on sampled calibration rows
  (each routed expert on the rows routed to it). Both norm -> Linears and Linear ->
  Linear mappings (``up_proj -> down_proj``, ``v_proj -> o_proj`` without GQA) are used.

The mappings come from what the runtime's layers compute (its weight keys), so every
family the runtime runs is covered: GQA and MLA attention (``q_a_proj`` /
``kv_a_proj_with_mqa`` share the input norm; ``q_a_layernorm -> q_b_proj``,
``kv_a_layernorm -> kv_b_proj``), KDA linear attention (every projection of the normed
input), dense MLPs, MoE (the post-attention norm feeds the router, every routed expert,
the shared experts, or a latent MoE's down projection) and per-expert ``up -> down``.
A kept Linear that reads a smoothed input (the router) has its columns scaled too, so it
computes exactly what it did; it is written with the new values. A mapping touching a
tensor that is copied as stored (an MXFP4 release expert), or that the output holds
exactly as released (MXFP4 under NVFP4, MXFP4 or FP8 blocks; unless
``gptq_solve_released``), is skipped.

Memory: the scales are vectors; smoothed weights are made on demand, one Linear at a
time (:meth:`Smoothing.tensor`), never a whole MoE layer at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..errors import ConfigError
from ..quant.activations import fake_quant_activation, nv_input_global_scale

#: Linears that read the attention block's normed input (``input_layernorm``)
_ATTENTION_READERS = (
    "attention.q_proj", "attention.q_a_proj", "attention.k_proj", "attention.v_proj",
    "attention.kv_a_proj_with_mqa", "attention.g_proj",
    "linear_attention.q_proj", "linear_attention.k_proj", "linear_attention.v_proj",
    "linear_attention.f_a_proj", "linear_attention.b_proj", "linear_attention.g_proj",
    "linear_attention.g_a_proj",
)  # fmt: skip
#: norm -> its one reader
_NORM_PAIRS = (
    ("norms.q_a_layernorm", "attention.q_b_proj"),
    ("norms.kv_a_layernorm", "attention.kv_b_proj"),
    ("latent.routed_expert_norm", "latent.routed_expert_up_proj"),
)


@dataclass(frozen=True)
class Mapping:
    """One smoothing site of a layer. prev: the tensor whose output channels are divided
    (a norm weight, or a Linear's weight with its bias ``prev_bias``); balance: quantized
    Linears reading that output (searched on, columns multiplied); compensate: kept
    Linears reading it (columns multiplied, not quantized); source: a Linear whose input
    is the whole mapping input (its statistics are the mapping's); routed: balance members
    that see only the rows routed to them (their own samples are used)."""

    label: str
    prev: str
    prev_is_norm: bool
    balance: tuple[str, ...]
    compensate: tuple[str, ...] = ()
    source: str = ""
    routed: tuple[str, ...] = ()
    prev_bias: str | None = None

    @property
    def members(self) -> tuple[str, ...]:
        return self.balance + self.compensate


def layer_mappings(
    ts,
    layer: int,
    keys: dict[str, str],
    rows: dict,
    *,
    norms_only: bool,
    cache_fixed: bool = False,
    exact=frozenset(),
) -> list[Mapping]:
    """The mappings of decoder layer ``layer``. keys: runtime key -> tensor name of the
    layer's tensors; rows: tensor name -> the plan's Decision (every row); norms_only:
    only norm -> Linears mappings; cache_fixed: the KV cache's contents must not change
    (the source's KV-cache scales are kept): no ``kv_a_layernorm -> kv_b_proj`` (MLA's
    cached latent) and no ``v_proj -> o_proj`` (the cached values); exact: tensors whose
    released values the output holds exactly and must keep (an MXFP4 release under
    NVFP4 / MXFP4 / FP8 blocks, :func:`.passes.transcoded_exactly`): a mapping touching
    one is left alone, as one touching a tensor copied as stored."""

    def usable(name: str) -> bool:
        r = rows.get(name)
        return r is not None and not r.as_stored and name not in exact

    def quantized(name: str) -> bool:
        return not rows[name].kept

    out: list[Mapping] = []

    def add(label: str, prev_key: str, readers: list[str], is_norm: bool, routed=()) -> None:
        prev = keys.get(prev_key)
        names = [keys[k] for k in readers if k in keys]
        if prev is None or not names or not all(usable(n) for n in [prev, *names]):
            return
        bias = keys.get(prev_key + "_bias")
        if bias is not None and not usable(bias):
            return
        balance = tuple(n for n in names if quantized(n))
        if not balance:
            return
        routed_names = {keys[k] for k in routed if k in keys}
        full = [n for n in names if n not in routed_names]
        if not full:
            return  # no reader sees every row: no statistics of the whole input
        src = next((n for n in full if quantized(n)), full[0])
        out.append(Mapping(
            label=f"layer {layer}: {prev_key} -> {', '.join(_short(readers, keys))}",
            prev=prev, prev_is_norm=is_norm, balance=balance,
            compensate=tuple(n for n in names if not quantized(n)), source=src,
            routed=tuple(n for n in balance if n in routed_names), prev_bias=bias,
        ))  # fmt: skip

    add("attention", "norms.input_layernorm", list(_ATTENTION_READERS), True)
    for norm, reader in _NORM_PAIRS:
        if not (cache_fixed and norm == "norms.kv_a_layernorm"):
            add(norm, norm, [reader], True)
    experts = sorted({int(k.split(".")[1]) for k in keys if k.startswith("routed_experts.")})
    if "router.router" in keys:
        readers = ["router.router", "shared_experts.gate_proj", "shared_experts.up_proj"]
        routed: list[str] = []
        if "latent.routed_expert_down_proj" in keys:
            readers.append("latent.routed_expert_down_proj")
        else:
            routed = [f"routed_experts.{e}.{p}" for e in experts for p in ("gate_proj", "up_proj")]
        add("mlp", "norms.post_attention_layernorm", readers + routed, True, routed)
    else:
        add("mlp", "norms.post_attention_layernorm",
            ["dense_mlp.gate_proj", "dense_mlp.up_proj"], True)  # fmt: skip
    if norms_only:
        return out
    if ts.glu is None and ts.act is not None:  # down's input is act(gate) * up: linear in up
        prefixes = ["dense_mlp", "shared_experts"] + [f"routed_experts.{e}" for e in experts]
        for p in prefixes:
            add(p, f"{p}.up_proj", [f"{p}.down_proj"], False)
    if ts.attention_of(layer) == "gqa" and "attention.g_proj" not in keys and not cache_fixed:
        v, o = keys.get("attention.v_proj"), keys.get("attention.o_proj")
        if v is not None and o is not None and rows[v].shape[0] == rows[o].shape[1]:
            add("v->o", "attention.v_proj", ["attention.o_proj"], False)
    return out


def _short(readers: list[str], keys: dict) -> list[str]:
    """Reader keys for a label; a norm's many routed experts as a count."""
    present = [k for k in readers if k in keys]
    experts = {k.split(".")[1] for k in present if k.startswith("routed_experts.")}
    if len(experts) <= 1:
        return present
    rest = [k for k in present if not k.startswith("routed_experts.")]
    return [*rest, f"{len(experts)} routed experts"]


class Statistics:
    """Per Linear input, over the real calibration rows: sum and max of |x| per channel
    and a sample of rows (at most ``cap``, spread over the micro-batches) for AWQ's loss."""

    def __init__(self, cap: int, batches: int):
        self.cap = max(1, int(cap))
        self.per_call = max(1, math.ceil(self.cap / max(1, batches)))
        self.sum: dict[str, torch.Tensor] = {}
        self.max: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self.rows: dict[str, list[torch.Tensor]] = {}
        self._kept: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor, sample: bool) -> None:
        """x: [n, in] real rows."""
        if not x.shape[0]:
            return
        a = x.detach().float().abs()
        s = a.sum(0, dtype=torch.float64)
        m = a.amax(0)
        if name in self.sum:
            self.sum[name] += s
            torch.maximum(self.max[name], m, out=self.max[name])
        else:
            self.sum[name], self.max[name] = s, m
        self.count[name] = self.count.get(name, 0) + int(x.shape[0])
        if sample:
            room = self.cap - self._kept.get(name, 0)
            take = min(room, self.per_call, int(x.shape[0]))
            if take > 0:
                step = max(1, x.shape[0] // take)
                self.rows.setdefault(name, []).append(x[::step][:take].detach().float().clone())
                self._kept[name] = self._kept.get(name, 0) + take

    def mean(self, name: str) -> torch.Tensor | None:
        n = self.count.get(name, 0)
        return None if not n else (self.sum[name] / n).float()

    def sample(self, name: str) -> torch.Tensor | None:
        r = self.rows.get(name)
        return torch.cat(r) if r else None


@dataclass
class Smoothing:
    """Scales chosen for one layer: ``divide[name]`` divides a tensor's output channels
    (dim 0; a bias too), ``multiply[name]`` multiplies a Linear's input columns."""

    divide: dict[str, torch.Tensor] = field(default_factory=dict)
    multiply: dict[str, torch.Tensor] = field(default_factory=dict)
    chosen: dict[str, float | None] = field(default_factory=dict)  # label -> AWQ ratio

    def touched(self) -> set[str]:
        return set(self.divide) | set(self.multiply)

    def add(self, m: Mapping, s: torch.Tensor) -> None:
        s = s.float()
        for n in [m.prev] + ([m.prev_bias] if m.prev_bias else []):
            self.divide[n] = self.divide[n] * s if n in self.divide else s
        for n in m.members:
            self.multiply[n] = self.multiply[n] * s if n in self.multiply else s

    def apply(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """``w`` (float32) smoothed."""
        if name in self.multiply:
            w = w * self.multiply[name]
        if name in self.divide:
            d = self.divide[name]
            w = w / (d if w.dim() == 1 else d[:, None])
        return w


def power_of_two(s: torch.Tensor) -> torch.Tensor:
    """``s`` (positive) rounded to the nearest power of two in log scale, within
    ``2^-12 .. 2^12`` (a bf16 or fp16 norm of magnitude ~1 stays a normal number): a
    scale that divides a norm and multiplies a kept reader's columns exactly."""
    return torch.exp2(torch.log2(s.float().clamp(min=2.0**-12, max=2.0**12)).round())


def _group(scheme, width: int) -> int:
    g = getattr(scheme, "group_size", None)
    block = getattr(scheme, "block", None)
    if block:
        g = block[-1]
    if hasattr(scheme, "group") and not g:
        g = scheme.group
    if not g or width % int(g):
        return width
    return int(g)


def _fake(scheme, w: torch.Tensor, name: str, global_amax=None) -> torch.Tensor:
    """Round to nearest and back. The search scores candidate scales with the ``minmax``
    observer even where the scheme's is ``mse``: the clip search then runs once on the
    chosen smoothing (as AWQ's own clip step follows its scale search) instead of once
    per candidate, 20x the work; scoring inside the search measured no better (issue 22).
    global_amax: NVFP4's fused set's largest |value| (its shared global scale)."""
    if getattr(scheme, "observer", "minmax") != "minmax":
        scheme = replace(scheme, observer="minmax")
    kw = {} if global_amax is None else {"global_amax": global_amax}
    return scheme.dequantize(scheme.quantize(w, name=name, **kw)).float()


class _SetMax:
    """NVFP4's fused sets under a candidate smoothing ``s``: the largest |value| of the
    set a balance Linear belongs to (what its shared global scale is made from), from each
    member's column maxima (``max_ij |w_ij| s_j = max_j (max_i |w_ij|) s_j`` exactly:
    rounding a product by a positive factor is monotone). set_of(name): the names of its
    fused set (:meth:`..quant.writer.SharedScales.members`), or () if it has none."""

    def __init__(self, m: Mapping, weight, set_of):
        found = {n: tuple(set_of(n)) for n in m.balance} if set_of is not None else {}
        self.sets = {n: ms for n, ms in found.items() if ms}
        self.cols: dict[str, torch.Tensor] = {}
        self.fixed: dict[str, torch.Tensor] = {}
        for ms in set(self.sets.values()):
            for k in ms:
                if k in m.balance:
                    self.cols[k] = weight(k).abs().amax(0)
                else:  # not smoothed by this mapping: its own maximum
                    self.fixed[k] = weight(k).abs().amax()

    def __call__(self, name: str, s: torch.Tensor) -> torch.Tensor | None:
        ms = self.sets.get(name)
        if not ms:
            return None
        return torch.stack([(self.cols[k] * s).amax() if k in self.cols else self.fixed[k]
                            for k in ms]).amax()  # fmt: skip


def search_activation(scheme, x: torch.Tensor, plain: bool):
    """The activation spec a search fake-quantizes a Linear's (smoothed) input ``x``
    with, as it will run: a dynamic spec as it is; NVFP4's (local scales on the fly) under
    the input global scale calibration will store for this input (from its largest |x|,
    :func:`..quant.activations.nv_input_global_scale`); None for a static per-tensor spec
    (judged on the weights) and for ``plain`` Linears (inputs not quantized where run)."""
    act = None if plain else scheme.act
    if act is None:
        return None
    if act.dynamic is True:
        return act
    if act.strategy == "tensor_group":
        g = nv_input_global_scale(float(x.abs().max()))
        return act.with_global_scale(g) if g is not None else None
    return None


def smoothquant_scales(m: Mapping, weight, stats: Statistics, alpha: float) -> torch.Tensor:
    """``max|x|^alpha / max|W|^(1-alpha)`` per channel (weight(name) -> float32 W)."""
    x_max = stats.max[m.source].float().clamp(min=1e-5)
    w_max = None
    for n in m.balance:
        c = weight(n).abs().amax(0)
        w_max = c if w_max is None else torch.maximum(w_max, c)
    w_max = w_max.clamp(min=1e-5)
    s = x_max.pow(alpha) / w_max.pow(1.0 - alpha)
    return s.clamp(min=1e-5)


#: SmoothQuant smooths a mapping only when that lowers its balance Linears' W8A8 output
#: error on the sampled rows by at least this fraction. The local error is not the model's,
#: and small local gains flip with the CPU's rounding. Held-out KL vs bf16 on the trained
#: fixtures (plain w8a8: deepseek_v3 3.91e-4, llama 1.67e-4), alpha 0.5: on every mapping
#: dsv3 7.0e-4 and llama 1.41e-4; with a 10 % margin dsv3 4.07e-4; searched alphas with
#: 10 % dsv3 3.84e-4 under AVX512 but 4.61e-4 under AVX2; with 25 % dsv3 3.909e-4 (AVX512)
#: / 3.912e-4 (AVX2) and llama 1.41e-4. Issue 22 (routed experts scored as they run, see
#: the module doc): on the dsv3 fixture a 5 % margin helped on bench_calibrate's windows
#: (5.15e-4 plain -> 4.70 / 4.90e-4, seeds 0 / 1) but not on the test suite's (plain
#: 3.91e-4 -> 3.91e-4 AVX512, 5.12e-4 AVX2; 5 % on Linear -> Linear mappings only 4.25 /
#: 4.96e-4; scoring the decoder layer's output instead, activations quantized, 4.64e-4
#: AVX512): the MoE layers' routing flips with any change upstream of the router (that
#: loss is not monotone in alpha, up to 7x the unsmoothed one). At 25 % no dsv3 mapping is
#: smoothed: SmoothQuant is plain w8a8 there. No per-channel scale does much better on that
#: fixture: the best local error of any dsv3 mapping is 0.807 of the unsmoothed (layer 0
#: dense up -> down, alpha 0.5; mean|x|-based scales 0.868, learned scales 0.85-1.02), and
#: that mapping smoothed alone (a 15 % margin) raised the KL to 4.37e-4 / 4.83e-4 (AVX512
#: / AVX2): what moves the later layers' routing costs more than it saves. That KL is
#: mostly routing flips: its 10 largest of 3072 token KLs hold a third of it, and the 20
#: largest sit at layer-2 router margins (2nd - 3rd expert score) of median 0.0026 against
#: 0.117 over all tokens, so a 5-10 % gain on the other tokens does not show. With outlier
#: channels to move (tests/outliers.py) the margin is no obstacle: every norm's mapping,
#: the MoE one included, qualifies and the KL falls 17-20x (bench_calibrate).
SQ_MIN_GAIN = 0.25
SQ_ALPHAS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def smoothquant_search(
    m: Mapping,
    weight,
    scheme_of,
    stats: Statistics,
    alphas=SQ_ALPHAS,
    plain=frozenset(),
    set_of=None,
    min_gain: float = SQ_MIN_GAIN,
) -> tuple[torch.Tensor, float | None]:
    """SmoothQuant's strength chosen per mapping among ``alphas`` and no smoothing (None):
    the candidate whose smoothed, *activation- and weight-fake-quantized* balance Linears
    best reproduce their exact outputs on the sampled rows — the error W8A8 adds, dynamic
    input quantization included (compressed-tensors' fake quantization of the scheme's
    activation spec; static specs are judged on the weights alone) — provided it beats no
    smoothing by ``min_gain`` (by default :data:`SQ_MIN_GAIN`). ``plain``: Linears whose
    inputs are not quantized where the checkpoint runs (routed experts): judged on their
    weights alone; a mapping
    whose balance is all plain is not smoothed (there is no input error to move). A fixed
    ``--alpha`` is ``alphas=(alpha,)``: that strength where it helps, none elsewhere. A
    mapping with kept readers (an MoE's router) gets power-of-two scales: its compensated
    columns are then exact in bf16 and the router's logits, hence the top-k choice, do
    not move. NVFP4 (W4A4): inputs under their calibrated global scale
    (:func:`search_activation`), weights under their fused set's (``set_of``, see
    :class:`_SetMax`), both recomputed for each candidate as calibration will."""
    width = stats.max[m.source].shape[0]
    if all(n in plain for n in m.balance):
        return torch.ones(width), None
    exact = power_of_two if m.compensate else (lambda s: s)
    cands: list[tuple[float | None, torch.Tensor]] = [(None, torch.ones(width))]
    cands += [(a, exact(smoothquant_scales(m, weight, stats, a))) for a in alphas]
    loss = torch.zeros(len(cands), dtype=torch.float64)
    set_max = _SetMax(m, weight, set_of)
    for n in m.balance:
        x = stats.sample(n if n in m.routed else m.source)
        if x is None:
            continue
        w, sch = weight(n), scheme_of(n)
        y = x @ w.T
        for c, (_, s) in enumerate(cands):
            xs = x / s
            xa = fake_quant_activation(xs[None], search_activation(sch, xs, n in plain))[0]
            loss[c] += float((xa @ _fake(sch, w * s, n, set_max(n, s)).T - y).pow(2).sum())
        del w, y
    best = int(loss.argmin())
    if not bool(torch.isfinite(loss).all()):
        raise ConfigError(f"SmoothQuant: a non-finite loss in {m.label}; check the weights.")
    if loss[best] > (1.0 - min_gain) * loss[0]:
        best = 0  # a small local gain is not worth the risk (see SQ_MIN_GAIN)
    return cands[best][1], cands[best][0]


def awq_scales(
    m: Mapping,
    weight,
    scheme_of,
    stats: Statistics,
    grid: int = 20,
    duo: bool = True,
    layer_loss=None,
    set_of=None,
) -> tuple[torch.Tensor, float | None]:
    """AWQ's searched scales and the ratio chosen (None: no smoothing won).

    layer_loss(names, fake) -> float, for norm mappings: the squared error of the decoder
    layer's output when each balance Linear ``n`` computes with ``fake(n)`` (its smoothed,
    fake-quantized, unsmoothed weight) and everything else is exact — AWQ's loss on the
    block the mapping feeds. Without it (and for Linear -> Linear mappings, whose reader's
    output is that block's output) the loss is the balance Linears' own output error.
    NVFP4 weights take their fused set's global scale under each candidate (``set_of``,
    :class:`_SetMax`). Quantized inputs are not in AWQ's loss (a weight-only search): for
    W4A4 (``nvfp4``) scoring the balance Linears' own error with their NVFP4 inputs
    fake-quantized instead of the block loss chose scales that raised the trained llama's
    KL (1.41e-2 against 1.37e-2 weight-only, round to nearest 1.39e-2)."""
    x_mean = stats.mean(m.source)
    width = x_mean.shape[0]
    w_mean = torch.zeros(width, dtype=torch.float64)
    nrows = 0
    for n in m.balance:
        w = weight(n)
        g = _group(scheme_of(n), width)
        a = w.abs().reshape(w.shape[0], width // g, g)
        a = a / (a.amax(-1, keepdim=True) + 1e-6)
        w_mean += a.reshape(w.shape[0], width).sum(0, dtype=torch.float64)
        nrows += w.shape[0]
        del w, a
    w_mean = (w_mean / max(1, nrows)).float()
    ratios: list[float | None] = [None] + [i / grid for i in range(grid)]
    cands = []
    for r in ratios:
        if r is None:
            cands.append(torch.ones(width))
            continue
        if duo:
            s = x_mean.pow(r) / (w_mean.pow(1.0 - r) + 1e-4)
        else:
            s = x_mean.pow(r)
        s = s.clamp(min=1e-4)
        cands.append(s / (s.max() * s.min()).sqrt())
    loss = torch.zeros(len(cands), dtype=torch.float64)
    set_max = _SetMax(m, weight, set_of)
    if layer_loss is not None and m.prev_is_norm:
        for c, s in enumerate(cands):

            def fake(n: str, s=s) -> torch.Tensor:
                return _fake(scheme_of(n), weight(n) * s, n, set_max(n, s)) / s

            loss[c] = float(layer_loss(m.balance, fake))
        return _best(m, cands, ratios, loss)
    for n in m.balance:
        x = stats.sample(n if n in m.routed else m.source)
        if x is None:
            continue
        w = weight(n)
        sch = scheme_of(n)
        y = x @ w.T
        for c, s in enumerate(cands):
            wq = _fake(sch, w * s, n, set_max(n, s)) / s
            loss[c] += float(((x @ wq.T) - y).pow(2).sum())
        del w, y
    return _best(m, cands, ratios, loss)


def _best(m: Mapping, cands, ratios, loss: torch.Tensor):
    if not bool(torch.isfinite(loss).all()):
        raise ConfigError(f"AWQ: a non-finite loss in {m.label}; check the source weights.")
    best = int(loss.argmin())
    return cands[best], ratios[best]


def check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ConfigError(f"SmoothQuant alpha must be a number in [0, 1], got {alpha!r}.")
    return float(alpha)


__all__ = [
    "SQ_ALPHAS",
    "SQ_MIN_GAIN",
    "Mapping",
    "Smoothing",
    "Statistics",
    "awq_scales",
    "check_alpha",
    "layer_mappings",
    "smoothquant_scales",
    "smoothquant_search",
]

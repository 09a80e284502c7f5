"""Sensitivity scan and budgeted exceptions (``--auto-keep BUDGET``).

:func:`scan_sensitivity` runs the calibration set once, layer by layer, through the
UNQUANTIZED model on the runtime and scores every quantized row of a plan (kept and
as-stored rows are skipped): how much the model's output would change if that tensor
alone were quantized. Every tensor is scored on its own - a routed expert's gate, up and
down projections are three rows, each with its own score - so the budget can go to
single experts, not just to layers.

Three methods (``method=``), all on real tokens only (padding excluded; routed experts
on the tokens the router sends them), each tensor quantized ALONE with the rest of the
model unquantized. Rank correlation (Spearman) with the true single-tensor KL on held-out
text, measured on the trained fixtures under int3-g32 (tests/test_sensitivity.py; llama:
its 28 Linears, deepseek_v3: all 72 incl. 48 individual routed-expert rows):

``layer`` (default; llama 0.87, deepseek_v3 0.96):
    the change of the decoder layer's output (the residual stream after the layer) when
    that tensor's output is replaced by ``x Q(W)^T`` in a hook, as
    ``sum over real tokens ||dh||^2 / mean over real tokens ||h||^2``: the error where it
    reaches the residual stream, relative to the signal it perturbs (attention's
    softmax, the gating and the routing weights included). Cost: one rerun of the layer
    per tensor and micro-batch; routed experts of a plain MoE rerun only their expert on
    its tokens (the layer output changes by routing weight x expert output change,
    exactly: a test compares it with the full rerun), so a layer's experts cost about
    four times its routed-expert compute (one reference and three perturbed reruns of
    each expert; twice the perturbed ones with a ladder), not 3 x E layer reruns. A
    latent MoE (Kimi K3) reruns the layer per expert tensor (its norm after the sum is
    not linear), which is affordable for small models only.
``output`` (llama 0.45, deepseek_v3 0.69: cheap but weak):
    the Linear's own output error energy ``sum ||x W^T - x Q(W)^T||^2`` divided by the
    mean squared norm of the residual stream entering the layer. Cost: one forward plus
    one dequantize and matmul per tensor and micro-batch. It cannot see where an output
    goes (q/k/gate/up errors are damped or amplified before they reach the residual).
``kl`` (llama 0.98, deepseek_v3 0.96; small models only):
    the mean next-token KL divergence over the real calibration tokens, the tensor's
    output replaced in a hook and the remaining layers and the head run. Cost: per
    tensor, the rest of the model from its layer on for every micro-batch, and the
    reference log-probabilities of the whole set held in memory ([N, S, vocab] fp64).

In every method ``Q(W)`` is ``scheme.dequantize(scheme.quantize(W))``: a layer's parts are
made once and held compact, one tensor is dequantized at a time (never a whole MoE layer
in fp32). Memory: one layer's weights plus the calibration set's hidden states (in
memory; with the expert shortcut also each routed expert's input rows of the layer, top-k
times the layer's hidden states). A quantized ``lm_head`` is scored in the head stage
the same way (its logits stand for the layer output in ``layer``).
Scores are per weight tensor, summed over tokens (an expert that works on few tokens
matters less); they are comparable within one method only.

With a ladder scheme (``w4a16 -> int8-g32``) every tensor is scored under the ladder
scheme too, so the gain of an upgrade (score - ladder score) is known.

Routed experts that received no real calibration token have score 0 (and ladder score
0) and are listed in :attr:`SensitivityReport.unmeasured`: on the calibration set their
quantization changes nothing, which is exactly what the single-tensor KL on that set
gives too; spending budget on them would buy nothing measurable. (Scoring them on all
tokens would measure an input distribution they never see and put them above experts
that really work.) Rows the runtime does not run on text (a vision tower, MTP layers)
are scored 0 and listed there too.

:func:`choose_keeps` spends a :class:`Budget` (:func:`parse_budget`: ``5%`` of the
scored rows' output bytes, ``1.5GB`` / ``300MiB`` / plain bytes, or ``4.5bpw``) greedily
by gain per extra byte, never over the budget; extra bytes come from the writer's own
planned output entries (:func:`k3convert.quant.planning.row_entries`) for the row as
quantized, kept (its source dtype, as the writer keeps rows) or under the ladder scheme.
:func:`auto_keep` does all three in one call. :func:`apply_selection` turns a plan and a
selection into the plan the writer runs
(reason ``auto-keep: sensitivity rank k``); :func:`keep_patterns` gives the same choice
as exact-name patterns for ``quantize(keep=...)`` (kept only; a ladder needs
:func:`apply_selection`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError, NonFiniteError
from ..quant.planning import row_entries
from ..quant.rules import Decision, Plan
from ..quant.schemes import Scheme, get_scheme
from ..runtime.decoder import ROUTERS, gated_mlp, layer_output
from ..runtime.runtime import Runtime
from ..units import NUMBER, SIZE_UNITS, human_bytes
from .data import CalibrationSet
from .passes import dequantized, token_mask
from .sensitivity_report import REPORT_FILE, SensitivityReport, TensorSensitivity

METHODS = ("output", "layer", "kl")
#: ``layer`` method: routed experts of a plain MoE rerun alone (False: the whole layer,
#: the definition the shortcut must reproduce; tests compare the two)
_EXPERT_SHORTCUT = True
BUDGET_FORMS = (
    "a percentage of the quantized tensors' output bytes ('5%'), "
    "a byte count ('1.5GB', '300MiB', '2000000'), "
    "or a target average bits per weight including scales ('4.5bpw')"
)


# -- budget -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    """kind: ``percent`` (of the scored rows' output bytes), ``bytes`` (extra bytes) or
    ``bpw`` (target average bits per weight over the scored rows, scales included)."""

    kind: str
    value: float
    text: str

    def extra_bytes(self, base_bytes: int, params: int) -> int:
        """Extra bytes allowed over ``base_bytes`` (the rows as planned)."""
        if self.kind == "percent":
            return math.floor(base_bytes * self.value / 100.0)
        if self.kind == "bytes":
            return int(self.value)
        return math.floor(self.value * params / 8.0) - int(base_bytes)


def parse_budget(text) -> Budget:
    """``5%`` / ``1.5GB`` / ``300MiB`` / ``2000000`` / ``4.5bpw`` -> :class:`Budget`."""
    if isinstance(text, bool):
        raise ConfigError(f"--auto-keep budget {text!r} is not a budget; give {BUDGET_FORMS}.")
    if isinstance(text, int):
        text = str(text)
    if not isinstance(text, str):
        raise ConfigError(f"--auto-keep budget {text!r} is not a budget; give {BUDGET_FORMS}.")
    s = text.strip()
    m = re.fullmatch(rf"({NUMBER})\s*(%|bpw|[a-zA-Z]*)", s)
    unit = m.group(2).lower() if m else None
    if m is None or (unit not in SIZE_UNITS and unit not in ("%", "bpw")):
        raise ConfigError(f"--auto-keep budget '{text}' is not understood; give {BUDGET_FORMS}.")
    v = float(m.group(1))
    if not math.isfinite(v):
        raise ConfigError(f"--auto-keep budget '{text}' is not finite; give {BUDGET_FORMS}.")
    if unit == "%":
        if not 0 <= v <= 100:
            raise ConfigError(f"--auto-keep budget '{text}': a percentage is 0% to 100%.")
        return Budget("percent", v, s)
    if unit == "bpw":
        if not 0 < v <= 64:
            raise ConfigError(
                f"--auto-keep budget '{text}': a target bits per weight is above 0 and at "
                f"most 64 (e.g. '4.5bpw')."
            )
        return Budget("bpw", v, s)
    n = v * SIZE_UNITS[unit]
    if unit in ("", "b") and v != int(v):
        raise ConfigError(f"--auto-keep budget '{text}': a byte count is a whole number.")
    return Budget("bytes", float(int(n)), s)


# -- scan -------------------------------------------------------------------------------
def _ladder_scheme(ladder) -> Scheme | None:
    if ladder is None or isinstance(ladder, Scheme):
        s = ladder
    else:
        s = get_scheme(str(ladder))
    if s is not None and s.needs_input_scale:
        raise ConfigError(
            f"ladder scheme '{s.name}' needs static input scales from calibration; use a "
            f"weight-only or dynamic scheme as the ladder (e.g. int8-g128)."
        )
    return s


def _scored_rows(plan: Plan, ladder: Scheme | None) -> list[Decision]:
    rows = [r for r in plan.rows if not r.kept and not r.as_stored]
    if ladder is not None:
        for r in rows:
            ladder.check(r.name, r.shape)
    return rows


def scan_sensitivity(
    ckpt,
    plan: Plan,
    calib: CalibrationSet,
    *,
    ladder: str | Scheme | None = None,
    batch_size: int = 8,
    dtype: str = "fp32",
    method: str = "layer",
    log: Callable[[str], None] | None = None,
) -> SensitivityReport:
    """Score every quantized row of ``plan`` on ``calib`` (see the module doc).

    ckpt / plan: :func:`~k3convert.quant.planning.plan_quantization`'s pair; ladder: a
    scheme name (or Scheme) also scored for every row; method: ``layer`` (default),
    ``output`` or ``kl``; batch_size: samples per forward micro-batch; dtype: the
    runtime's compute dtype; log: called with one line per scored layer.

    Scores are round-to-nearest errors (what the scheme alone does to the tensor): run
    the scan before GPTQ / AWQ, on the plan those will then use (after
    :func:`apply_selection`)."""
    if method not in METHODS:
        raise ConfigError(
            f"sensitivity method '{method}' is not known; use one of {', '.join(METHODS)}."
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"sensitivity batch_size must be a positive integer, got {batch_size!r}.")
    if calib.images:
        raise ConfigError(
            f"{calib.source}: the calibration set holds images; the sensitivity scan runs "
            f"text only. Use a text dataset."
        )
    if not int(calib.attention_mask.sum()):
        raise ConfigError(f"{calib.source}: the calibration set has no real token.")
    lad = _ladder_scheme(ladder)
    rows = _scored_rows(plan, lad)
    log = log or (lambda s: None)
    t0 = time.perf_counter()
    rt = Runtime(ckpt, dtype=dtype, prefetch=False, act_quant=False)
    try:
        scan = _Scan(rt, ckpt, rows, lad, calib, batch_size, method, log)
        scores = scan.run()
    finally:
        rt.close()
    tensors = []
    for r in rows:
        s = scores[r.name]
        tensors.append(
            TensorSensitivity(
                r.name, r.role.layer, r.role.expert, math.prod(r.shape), r.scheme.name,
                int(s["tokens"]), float(s["score"]),
                None if lad is None else float(s["ladder"]),
            )
        )  # fmt: skip
    unmeasured = [t.name for t in tensors if t.tokens == 0]
    bad = [t.name for t in tensors
           if not math.isfinite(t.score) or (t.ladder_score is not None
                                             and not math.isfinite(t.ladder_score))]  # fmt: skip
    if bad:
        raise NonFiniteError(
            f"sensitivity scan: {len(bad)} tensor(s) got a non-finite score (e.g. "
            f"'{bad[0]}'); the model's activations overflow in {dtype}: use dtype fp32."
        )
    return SensitivityReport(method, None if lad is None else lad.name, tensors,
                             calib.describe(), time.perf_counter() - t0, unmeasured)  # fmt: skip


def route_tokens(rt, unit: str, y: torch.Tensor):
    """The router Linear's output ``y`` [T, E] -> (expert -> its token rows in the order
    the runtime feeds them, expert -> the routing weights of those rows)."""
    w = rt.loader.get(unit)
    weights, idx = ROUTERS[rt.text.router](rt.text, y, w)
    k = idx.shape[1]
    eid = idx.reshape(-1)
    order = eid.argsort(stable=True)
    counts = torch.bincount(eid, minlength=rt.text.num_experts).tolist()
    rows = dict(enumerate((order // k).split(counts)))
    return rows, dict(enumerate(weights.reshape(-1)[order].split(counts)))


class _Scan:
    """One layer-sequential pass of the unquantized model with scoring hooks: every
    decoder layer, then the head (a quantized lm_head is scored too)."""

    def __init__(self, rt, ckpt, rows, ladder, calib, bs, method, log):
        self.rt, self.ckpt, self.ladder, self.method, self.log = rt, ckpt, ladder, method, log
        self.rows = {r.name: r for r in rows}
        ids, mask = calib.input_ids, calib.attention_mask
        self.batches = [(ids[k : k + bs], mask[k : k + bs]) for k in range(0, ids.shape[0], bs)]
        self.pos = [rt.default_positions(b) for b, _ in self.batches]
        self.masks = [m.to(torch.bool) for _, m in self.batches]
        self.amasks = [None if bool(m.all()) else m for m in self.masks]
        self.real = sum(int(m.sum()) for m in self.masks)
        self.scores = {n: {"score": 0.0, "ladder": 0.0, "tokens": 0} for n in self.rows}
        self.expert_shortcut = _EXPERT_SHORTCUT

    def run(self) -> dict:
        rt = self.rt
        hidden = [rt.embed(b) for b, _ in self.batches]
        ref_logp = None
        if self.method == "kl":
            ref_logp = [_logp(self._rest(0, h, b)) for b, h in enumerate(hidden)]
        for i in range(rt.num_layers + 1):
            t0 = time.perf_counter()
            hidden = self._stage(i, hidden, ref_logp)
            what = f"layer {i}" if i < rt.num_layers else "the head"
            self.log(f"sensitivity: {what} scored in {time.perf_counter() - t0:.2f} s")
        return self.scores

    # -- helpers ----------------------------------------------------------------------
    def _run(self, i: int, h, b: int):
        """Stage ``i``: decoder layer i, or (i == num_layers) the head's logits."""
        if i == self.rt.num_layers:
            return self.rt.head(h)
        return self.rt.run_layer(i, h, self.pos[b], self.amasks[b])

    def _rest(self, start: int, h, b: int) -> torch.Tensor:
        for j in range(start, self.rt.num_layers + 1):
            h = self._run(j, h, b)
        return h

    def _perturbed(self, i: int, h, b: int, ref_out, ref_logp) -> float:
        """One micro-batch with the target's output replaced (the hook): ``kl``: the
        summed next-token KL after the rest of the model; ``layer``: the stage output's
        error energy over the real tokens, relative to the output's mean energy per token."""
        m = self.masks[b]
        if self.method == "kl":
            return _kl_sum(ref_logp[b], _logp(self._rest(i, h, b)), m)
        got = layer_output(self._run(i, h, b)).to(torch.float32)
        ref = layer_output(ref_out).to(torch.float32)
        d = (got - ref)[m.to(ref.device)].double()
        r = ref[m.to(ref.device)].double()
        return float((d * d).sum() / max(float((r * r).sum(-1).mean()), 1e-30))

    @torch.inference_mode()
    def _experts(self, unit, by_name, mine, experts, routed, out, cur, variants) -> None:
        """``layer`` scores of routed experts' Linears: each expert rerun alone on its
        tokens, its output change weighted by the routing weights (see ``_stage``)."""
        rt = self.rt
        w = rt.loader.get(unit)
        names = {e: [n for n in mine if by_name[n].role.expert == e] for e in experts}
        for b, rec in enumerate(routed):
            ref_out = layer_output(out[b]).to(torch.float32)[self.masks[b].to(out[b].device)]
            norm = max(float((ref_out.double() ** 2).sum(-1).mean()), 1e-30)
            for e in experts:
                x = rec["inputs"].get(e)
                if x is None:  # no token (real or padding) reached it
                    continue
                cur.clear()
                cur["mask"], cur["experts"] = self.masks[b], rec["experts"]
                real = self.masks[b].reshape(-1)[rec["experts"][e].to(self.masks[b].device)]
                wts = rec["weights"][e][:, None].to(torch.float32)
                ref = gated_mlp(rt.text, rt.linear, w, f"routed_experts.{e}", x)
                for name in names[e]:
                    for lad in variants:
                        cur["target"], cur["ladder"] = name, lad
                        got = gated_mlp(rt.text, rt.linear, w, f"routed_experts.{e}", x)
                        d = ((got.to(torch.float32) - ref.to(torch.float32)) * wts)[real]
                        key = "ladder" if lad else "score"
                        self.scores[name][key] += float((d.double() ** 2).sum()) / norm
        cur.clear()

    def _parts(self, cache: dict, name: str):
        """(quantized parts, ladder parts or None) of ``name``, made once per stage (the
        parts are compact; the source weight is mapped only while they are made)."""
        got = cache.get(name)
        if got is None:
            r = self.rows[name]
            w = self.ckpt.get(name)
            got = (r.scheme.quantize(w, name=name),
                   None if self.ladder is None else self.ladder.quantize(w, name=name))  # fmt: skip
            cache[name] = got
        return got

    def _stage(self, i: int, hidden: list, ref_logp) -> list:
        rt = self.rt
        unit = f"layer.{i}" if i < rt.num_layers else "head"
        entries = rt.plan.units.get(unit, {})
        by_name = {e.name: e for e in entries.values()}
        mine = [n for n in by_name if n in self.rows]
        router = next((e.name for e in entries.values() if e.key == "router.router"), None)
        cur: dict = {}
        cache: dict = {}

        def on_router(name, x, y):
            cur["experts"], cur["weights"] = route_tokens(rt, unit, y)

        def on_expert_input(name, x, y):
            if cur.get("capture"):
                cur["inputs"][by_name[name].role.expert] = x

        def rows_mask(name, x) -> torch.Tensor:
            e = by_name[name]
            tok = cur["experts"][e.role.expert] if e.role.expert is not None else None
            return token_mask(cur["mask"], tok, x, f"sensitivity scan: the input of '{name}'")

        def on_linear(name, x, y):
            if name not in self.scores:
                return None
            if self.method != "output":
                if name != cur.get("target"):
                    return None
                lad = cur["ladder"]
                parts = self._parts(cache, name)[1 if lad else 0]
                wq = dequantized(self.ladder if lad else self.rows[name].scheme, parts)
                if not lad:
                    self.scores[name]["tokens"] += int(rows_mask(name, x).sum())
                bias = rt.loader.get(unit).get(by_name[name].key + "_bias")
                return torch.nn.functional.linear(x, wq.to(x.dtype), bias)
            m = rows_mask(name, x)
            n = int(m.sum())
            s = self.scores[name]
            s["tokens"] += n
            if not n:
                return None
            xr = x[m.to(torch.bool)].to(torch.float32)
            w = self.ckpt.get(name).to(torch.float32)
            parts, lparts = self._parts(cache, name)
            s["score"] += _energy(xr, w - dequantized(self.rows[name].scheme, parts)) / cur["norm"]
            if lparts is not None:
                s["ladder"] += _energy(xr, w - dequantized(self.ladder, lparts)) / cur["norm"]
            return None

        # routed experts of a plain MoE (the routed sum added to the layer output as it
        # is): the layer output changes by weight x (expert output change) on the expert's
        # own tokens, so only that expert is rerun (not the layer: 3 x E reruns per layer)
        latent = any(e.key == "latent.routed_expert_down_proj" for e in entries.values())
        shortcut = (self.method == "layer" and self.expert_shortcut and router is not None
                    and not latent)  # fmt: skip
        experts = sorted({by_name[n].role.expert for n in mine
                          if by_name[n].role.expert is not None})  # fmt: skip
        handles = [rt.add_hook(on_linear, set(mine))] if mine else []
        if router is not None and mine:
            handles.append(rt.add_hook(on_router, {router}))
        if shortcut and experts:
            gates = {e.name for e in entries.values()
                     if e.role.expert in experts and e.key.endswith(".gate_proj")}  # fmt: skip
            handles.append(rt.add_hook(on_expert_input, gates))
        out, routed = [], []
        try:
            for b, h in enumerate(hidden):
                cur.clear()
                cur["mask"] = self.masks[b]
                hv = layer_output(h).to(torch.float32)[self.masks[b].to(layer_output(h).device)]
                cur["norm"] = max(float((hv.double() ** 2).sum(-1).mean()), 1e-30)
                cur["capture"], cur["inputs"] = shortcut, {}
                out.append(self._run(i, h, b))
                if shortcut:
                    routed.append({k: cur.get(k) for k in ("experts", "weights", "inputs")})
            cur.clear()
            if self.method != "output":
                variants = (False, True) if self.ladder is not None else (False,)
                for name in mine:
                    if shortcut and by_name[name].role.expert is not None:
                        continue
                    for lad in variants:
                        cur["target"], cur["ladder"] = name, lad
                        key = "ladder" if lad else "score"
                        for b, h in enumerate(hidden):
                            cur["mask"] = self.masks[b]
                            cur.pop("experts", None)
                            self.scores[name][key] += self._perturbed(i, h, b, out[b], ref_logp)
                if shortcut:
                    self._experts(unit, by_name, mine, experts, routed, out, cur, variants)
                if self.method == "kl":  # (a KL is >= 0; rounding can give -1e-9)
                    for name in mine:
                        for key in ("score", "ladder"):
                            self.scores[name][key] = max(self.scores[name][key] / self.real, 0.0)
        finally:
            for hd in handles:
                hd.remove()
            rt.loader.release()
        return out


def _logp(logits: torch.Tensor) -> torch.Tensor:
    """float64 log-probabilities: the KL of two fp32 logit sets that differ by 1e-7 is
    ~1e-12, below float32's resolution of a log-probability."""
    return torch.log_softmax(logits.double(), dim=-1)


def _energy(x: torch.Tensor, dw: torch.Tensor) -> float:
    """sum over rows of ||x dw^T||^2 (float64 accumulation)."""
    e = x @ dw.t()
    return float((e.double() * e.double()).sum())


def _kl_sum(ref_logp: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> float:
    """sum over real positions of KL(ref || q) of the next-token distributions."""
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return float(kl[mask.to(kl.device)].double().sum())


# -- selection --------------------------------------------------------------------------
def _row_bytes(r: Decision) -> int:
    return sum(math.prod(s) * d.itemsize for _, d, s in row_entries(r))


def _kept_row(r: Decision, reason: str) -> Decision:
    k = dataclasses.replace(r, scheme=None, reason=reason, as_stored=False)
    return dataclasses.replace(k, out_bytes=_row_bytes(k))


def _ladder_row(r: Decision, ladder: Scheme, reason: str) -> Decision:
    ladder.check(r.name, r.shape)
    k = dataclasses.replace(r, scheme=ladder, reason=reason, as_stored=False)
    return dataclasses.replace(k, out_bytes=_row_bytes(k))


@dataclass
class Selection:
    """What :func:`choose_keeps` chose. names: in rank order (1 first); action: ``keep``
    or the ladder scheme's name; bytes: the scored rows' output bytes as planned
    (``base_bytes``), the extra bytes allowed and used; bpw: before and after over the
    scored rows (scales included); gain: the score removed; note: why nothing or little
    was chosen, when that is the case."""

    names: list[str]
    action: str
    budget: Budget
    budget_bytes: int
    used_bytes: int
    base_bytes: int
    params: int
    base_bpw: float
    bpw: float
    gain: float
    total_score: float
    ladder: Scheme | None = None
    note: str = ""

    def summary(self) -> str:
        what = "kept in high precision" if self.ladder is None else f"moved to {self.action}"
        s = (
            f"auto-keep {self.budget.text}: {len(self.names)} tensor(s) {what}, "
            f"{human_bytes(self.used_bytes)} of {human_bytes(max(self.budget_bytes, 0))} "
            f"extra bytes, {self.base_bpw:.3f} -> {self.bpw:.3f} bpw"
        )
        if self.total_score > 0:
            s += f", {self.gain / self.total_score:.1%} of the sensitivity removed"
        return s + (f" ({self.note})" if self.note else "")

    def to_json(self) -> dict:
        return {
            "names": list(self.names), "action": self.action, "budget": self.budget.text,
            "budget_kind": self.budget.kind, "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes, "base_bytes": self.base_bytes,
            "params": self.params, "base_bpw": self.base_bpw, "bpw": self.bpw,
            "gain": self.gain, "total_score": self.total_score, "note": self.note,
            "summary": self.summary(),
        }  # fmt: skip


def choose_keeps(
    report: SensitivityReport,
    budget: Budget | str,
    plan: Plan,
    ladder: str | Scheme | None = None,
) -> Selection:
    """The tensors to keep (or, with ``ladder``, to move to the ladder scheme) within
    ``budget``: greedy by gain per extra byte (gain: score, or score - ladder score),
    each taken if it still fits; never over the budget. Marks the report's tensors
    ``chosen`` / ``rank`` and stores the summary in ``report.selection``."""
    if isinstance(budget, str):
        budget = parse_budget(budget)
    lad = _ladder_scheme(ladder)
    if lad is not None and report.ladder is not None and report.ladder != lad.name:
        raise ConfigError(
            f"the sensitivity report scored ladder '{report.ladder}', not '{lad.name}'; "
            f"scan again with ladder='{lad.name}'."
        )
    if lad is not None and report.ladder is None:
        raise ConfigError(
            f"ladder '{lad.name}' given, but the sensitivity report has no ladder scores; "
            f"scan with ladder='{lad.name}'."
        )
    rows = {r.name: r for r in plan.rows if not r.kept and not r.as_stored}
    scored = report.by_name()
    missing = [n for n in rows if n not in scored]
    if missing:
        raise ConfigError(
            f"the sensitivity report does not score {len(missing)} quantized tensor(s) of "
            f"the plan (e.g. '{missing[0]}'); scan the same plan."
        )
    base = sum(r.out_bytes for r in rows.values())
    params = sum(math.prod(r.shape) for r in rows.values())
    allowed = budget.extra_bytes(base, params)
    cands = []
    for n, r in rows.items():
        t = scored[n]
        new = _ladder_row(r, lad, "") if lad is not None else _kept_row(r, "")
        cost = new.out_bytes - r.out_bytes
        gain = t.score - (t.ladder_score or 0.0) if lad is not None else t.score
        if gain > 0 and cost > 0:
            cands.append((gain / cost, gain, cost, n))
    cands.sort(key=lambda c: (-c[0], c[3]))
    chosen, used, gain = [], 0, 0.0
    for _, g, c, n in cands:
        if used + c <= allowed:
            chosen.append(n)
            used += c
            gain += g
    note = ""
    if not chosen:
        if allowed <= 0:
            note = f"the budget allows no extra bytes (base {base / params * 8:.3f} bpw)"
        elif cands:
            cheapest = min(c[2] for c in cands)
            note = (f"the budget ({allowed} B) is smaller than any single tensor's cost "
                    f"(the cheapest needs {cheapest} B): nothing chosen")  # fmt: skip
        else:
            note = "no tensor has a measured sensitivity: nothing chosen"
    for t in report.tensors:
        t.chosen, t.rank = False, None
    for k, n in enumerate(chosen, 1):
        scored[n].chosen, scored[n].rank = True, k
    total = sum(scored[n].score for n in rows)
    sel = Selection(
        chosen, "keep" if lad is None else lad.name, budget, allowed, used, base, params,
        base * 8 / params if params else 0.0, (base + used) * 8 / params if params else 0.0,
        gain, total, lad, note,
    )  # fmt: skip
    report.selection = sel.to_json()
    return sel


def apply_selection(plan: Plan, selection: Selection) -> Plan:
    """``plan`` with the selection's rows kept (source dtype, as the writer keeps rows) or
    moved to the ladder scheme, reason ``auto-keep: sensitivity rank k``; a new Plan."""
    rank = {n: k for k, n in enumerate(selection.names, 1)}
    found = set()
    rows = []
    for r in plan.rows:
        k = rank.get(r.name)
        if k is None:
            rows.append(r)
            continue
        if r.kept or r.as_stored:
            raise ConfigError(f"auto-keep: '{r.name}' is not a quantized row of this plan.")
        found.add(r.name)
        why = f"auto-keep: sensitivity rank {k}"
        if selection.ladder is not None:
            rows.append(_ladder_row(r, selection.ladder, why))
        else:
            rows.append(_kept_row(r, why))
    lost = [n for n in selection.names if n not in found]
    if lost:
        raise ConfigError(f"auto-keep: '{lost[0]}' is not a tensor of this plan.")
    return dataclasses.replace(plan, rows=rows)


def auto_keep(
    ckpt,
    plan: Plan,
    calib: CalibrationSet,
    budget: Budget | str,
    *,
    ladder: str | Scheme | None = None,
    method: str = "layer",
    batch_size: int = 8,
    dtype: str = "fp32",
    log: Callable[[str], None] | None = None,
) -> tuple[Plan, SensitivityReport, Selection]:
    """Scan, choose within ``budget`` and apply: (the plan to write, the report with the
    choice marked, the selection). The budget and the ladder are checked before the scan."""
    if not isinstance(budget, Budget):
        budget = parse_budget(budget)
    _scored_rows(plan, _ladder_scheme(ladder))
    report = scan_sensitivity(ckpt, plan, calib, ladder=ladder, batch_size=batch_size,
                              dtype=dtype, method=method, log=log)  # fmt: skip
    sel = choose_keeps(report, budget, plan, ladder)
    return apply_selection(plan, sel), report, sel  # the caller reports sel.summary()


def keep_patterns(selection: Selection | Sequence[str]) -> list[str]:
    """Exact-name ``re:`` patterns of the chosen tensors for ``quantize(keep=...)``
    (regex metacharacters escaped; each matches that one weight name)."""
    names = selection.names if isinstance(selection, Selection) else list(selection)
    if isinstance(selection, Selection) and selection.ladder is not None:
        raise ConfigError(
            "keep patterns keep tensors in high precision; a ladder selection moves them "
            "to another scheme - use apply_selection(plan, selection) instead."
        )
    return [f"re:{re.escape(n)}$" for n in names]


__all__ = [
    "BUDGET_FORMS",
    "METHODS",
    "REPORT_FILE",
    "Budget",
    "Selection",
    "SensitivityReport",
    "TensorSensitivity",
    "apply_selection",
    "auto_keep",
    "choose_keeps",
    "keep_patterns",
    "parse_budget",
    "route_tokens",
    "scan_sensitivity",
]

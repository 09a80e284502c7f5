"""One decoder layer's calibration: the loop that runs the layer's micro-batches under the
runtime's hooks and feeds the passes of :mod:`.passes`.

For layer ``i`` (:func:`calibrate_layer`):

1. smoothing (AWQ / SmoothQuant): the unsmoothed layer's statistics, then the scales
   (AWQ's judged on the layer's own output, :class:`LayerLoss`);
2. the statistics pass on the (smoothed, unquantized) layer: per micro-batch, with
   ``gptq_fp_target`` first the full-precision stream's run (its Linears' inputs are the
   GPTQ targets), then the quantized stream's, then, with ``moe_all_experts``, every
   calibrated expert on all of the batch's tokens; a second pass where an observer needs
   one;
3. each quantized Linear decided: GPTQ's solve, AWQ's clip search, else round to nearest
   (the parts are shared between processes under torchrun), the static input scales;
4. the layer re-run on its quantized weights: the next layer's inputs, and the KV-cache
   absmax.

The hooks tell the passes apart by the micro-batch's mode (:class:`_Mode`): which run of
the layer is under way decides what a Linear's input is for.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ConfigError
from ..parallel.procs import balance
from ..quant.writer import SharedScale
from ..runtime.decoder import ROUTERS, gated_mlp, layer_output
from .options import GPTQ_ALGORITHMS, SMOOTHING
from .passes import (
    ClipPass,
    ExpertFallbackWarning,
    GPTQPass,
    KVPass,
    ObserverPass,
    SmoothingPass,
    dequantized,
    gptq_supported,
    round_to_nearest,
    static_input,
    token_mask,
    transcoded_exactly,
)


class _Mode(dict):
    """The state of the micro-batch being run: its valid mask (``mask``), the routed token
    rows per expert (``experts``), the captured expert input, and which run this is:
    ``smooth`` (smoothing statistics), ``mute`` (AWQ's loss runs: nothing recorded),
    ``fp`` / ``fp_sub`` (the full-precision stream / its routed experts), ``refine`` (an
    observer's second pass), ``all`` (the all-experts pass); none of them: the statistics
    pass."""


class _Layer:
    """The state of one layer's calibration (see the module doc)."""

    def __init__(self, rt, src, ckpt, rows, allrows, i, algorithm, options, hidden, pos,
                 masks, amasks, journal, observer, group, fp, shared=None):  # fmt: skip
        self.rt, self.src, self.ckpt, self.allrows, self.i = rt, src, ckpt, allrows, i
        self.shared = shared  # NVFP4 fused sets' global scales (quant.writer.SharedScales)
        self.options, self.hidden, self.pos, self.masks, self.amasks = (
            options, hidden, pos, masks, amasks)  # fmt: skip
        self.journal, self.observer, self.group, self.fp = journal, observer, group, fp
        self.unit = f"layer.{i}"
        self.entries = rt.plan.units[self.unit]
        self.by_name = {e.name: e for e in self.entries.values()}
        self.mine = {n: rows[n] for n in self.by_name if n in rows}
        mine = self.mine
        keys = {e.key: e.name for e in self.entries.values()}
        # a tensor released in MXFP4 whose scheme holds it stays the exact transcode, unless
        # asked (gptq_solve_released): neither smoothed nor solved
        exact = frozenset()
        if not options.gptq_solve_released:
            exact = frozenset(n for n, r in mine.items() if transcoded_exactly(ckpt, n, r.scheme))
        self.smoothing = SmoothingPass(SMOOTHING.get(algorithm), rt.text, i, keys, allrows,
                                       options.awq(), options.smoothquant(), hidden.n,
                                       shared.members if shared else None, exact)  # fmt: skip
        self.gptq = {n for n, r in mine.items()
                     if algorithm in GPTQ_ALGORITHMS and gptq_supported(r.scheme)
                     and n not in exact}  # fmt: skip
        self.clip = set()
        if algorithm == "awq" and options.awq_clip:
            self.clip = {n for n, r in mine.items()
                         if r.scheme.support.awq_clip}  # fmt: skip
        self.static = {n for n, r in mine.items() if static_input(r.scheme)}
        self.others = self._others()
        solved = [n for n in self.gptq if n not in self.others]
        self.gptq_pass = GPTQPass(mine, solved, options.gptq(), i, fp_target=fp is not None)
        self.clip_pass = ClipPass(mine, [n for n in self.clip if n not in self.others])
        real = sum(int(m.sum()) for m in masks)
        self.obs = ObserverPass(mine, self.static, options.observers(), real)
        self.seen: dict[str, int] = dict.fromkeys(mine, 0)  # tokens in the statistics
        self.routed: dict[str, int] = dict.fromkeys(mine, 0)  # tokens routed (experts)
        self.cur = _Mode()
        self.router = next((e.name for e in self.entries.values()
                            if e.key == "router.router"), None)  # fmt: skip
        self.latent_in = next((e.name for e in self.entries.values()
                               if e.key == "latent.routed_expert_down_proj"), None)  # fmt: skip
        self.n_exp = rt.text.num_experts
        self.routing = [0] * self.n_exp if self.router is not None else None
        self.all_experts = bool(options.moe_all_experts) and self.router is not None
        # experts with a calibrated Linear: the ones the all-experts pass runs
        self.calibrated_experts = sorted({self.by_name[n].role.expert for n in mine
                                          if self.by_name[n].role.expert is not None})  # fmt: skip
        # gptq_fp_target: the experts whose Linears take full-precision inputs
        self.fp_experts = sorted({self.by_name[n].role.expert for n in self.gptq_pass.cross
                                  if self.by_name[n].role.expert is not None})  # fmt: skip
        self.fp_state: dict = {}  # the FP stream's routed-expert input
        self.last = i + 1 == rt.num_layers

    def _others(self) -> set[str]:
        """Under torchrun each process solves (and accumulates the Hessians of) its share
        of the GPTQ / clip Linears, balanced by the solve's cost; the others' come from the
        journal."""
        if self.group.world == 1:
            return set()
        mine = self.mine

        def cost(n: str) -> int:  # the Hessian's Cholesky and the column sweep
            o, k = mine[n].shape
            return int(k) * int(k) * (int(k) + int(o))

        order = sorted(self.gptq | self.clip)
        return set(order) - set(balance(order, cost, self.group.world)[self.group.rank])

    # -- hooks --------------------------------------------------------------------------
    def fp_expert_inputs(self, tok: dict | None) -> None:
        """Run the solved routed experts on the FP stream's expert input at the rows the
        quantized pass routes to each (``tok``; None: every row), recording their
        Linears' inputs (gate / up: those rows; down: what the FP expert computes)."""
        _experts_pass(self.rt, self.unit, self.cur, self.fp_experts,
                      self.fp_state.get("expert_input"), "fp_sub",
                      "gptq_fp_target (full-precision input)", tok)  # fmt: skip

    def on_router(self, name, x, y) -> None:
        cur, rt = self.cur, self.rt
        if cur.get("mute"):  # AWQ's loss runs: no statistics
            return
        if cur.get("fp"):  # the FP pass: its routing is not used, only its expert input
            if self.latent_in is None:
                self.fp_state["expert_input"] = x
            return
        w = rt.loader.get(self.unit)
        _, idx = ROUTERS[rt.text.router](rt.text, y, w)
        k = idx.shape[1]
        eid = idx.reshape(-1)
        order = eid.argsort(stable=True)
        counts = torch.bincount(eid, minlength=self.n_exp).tolist()
        cur["experts"] = dict(enumerate((order // k).split(counts)))
        if self.all_experts and self.latent_in is None:
            cur["expert_input"] = x  # [T, D] float32: every token, the experts' input
        if cur.get("refine") or cur.get("smooth"):
            return
        valid = cur["mask"].reshape(-1).to(idx.device)
        real = torch.bincount(idx[valid].reshape(-1), minlength=self.n_exp).tolist()
        for j, c in enumerate(real):
            self.routing[j] += int(c)
        if self.fp_experts and not self.all_experts:  # FP inputs at the rows routed here
            self.fp_expert_inputs(cur["experts"])

    def on_latent_input(self, name, x, y) -> None:
        if self.cur.get("fp"):
            self.fp_state["expert_input"] = y
        elif not self.cur.get("fp_sub"):
            self.cur["expert_input"] = y

    def rows_mask(self, name, e, x):
        routed = e.role.expert is not None and not self.cur.get("all")
        tok = self.cur["experts"][e.role.expert] if routed else None
        return token_mask(self.cur["mask"], tok, x, f"calibration: the input of '{name}'")

    def on_linear(self, name, x, y) -> None:
        e, cur = self.by_name.get(name), self.cur
        if e is None or cur.get("mute"):
            return
        if cur.get("fp") or cur.get("fp_sub"):  # the FP stream: inputs recorded only
            if name in self.gptq_pass.cross and (cur.get("fp_sub") or e.role.expert is None):
                self.gptq_pass.record_fp(name, x)
            return
        if cur.get("smooth"):  # smoothing statistics of the unsmoothed layer
            if name in self.smoothing.names:
                self.smoothing.record(name, x, self.rows_mask(name, e, x))
            return
        if name not in self.mine:
            return
        valid = cur["mask"]
        if e.role.expert is not None and self.all_experts and not cur.get("all"):
            # routed pass: counted, statistics come from the all-tokens pass
            if cur.get("refine"):
                return
            tok = cur["experts"][e.role.expert]
            self.routed[name] += int(valid.reshape(-1)[tok.to(valid.device)].sum())
            return
        m = self.rows_mask(name, e, x)
        if cur.get("refine"):  # second pass: observers that need one (mse)
            self.obs.refine(name, x, m)
            return
        if self.observer is not None:
            self.observer(self.i, name, x, m)
        self.gptq_pass.record(name, x, m)
        self.clip_pass.record(name, x, m)
        n = int(m.sum())
        self.seen[name] += n
        if e.role.expert is not None and not self.all_experts:
            self.routed[name] += n
        self.obs.record(name, x, m, n)

    # -- runs ---------------------------------------------------------------------------
    def _run(self, b: int, **mode) -> None:
        self.cur.clear()
        self.cur.update(mask=self.masks[b], **mode)
        self.rt.run_layer(self.i, self.hidden.get(b), self.pos[b], self.amasks[b])

    def smooth(self):
        """The smoothing statistics pass and the scales chosen from it."""
        if not self.smoothing.maps:
            return self.smoothing.choose(self.ckpt, self.allrows)
        for b in range(self.hidden.n):
            self._run(b, smooth=True)
        self.rt.loader.release()
        loss = None
        if self.smoothing.kind == "awq":
            self.cur.clear()
            self.cur["mute"] = True
            loss = LayerLoss(self.rt, self.src, self.i, self.hidden, self.pos, self.masks,
                             self.amasks, self.options.smooth_tokens)  # fmt: skip
        sm = self.smoothing.choose(self.ckpt, self.allrows, loss)
        self.cur.clear()
        return sm

    def statistics(self) -> None:
        """The statistics pass (with the FP stream and the all-experts pass), and the
        observers' second pass where one needs it."""
        fp, rt, cur = self.fp, self.rt, self.cur
        gp = self.gptq_pass
        every = self.all_experts and self.calibrated_experts
        for b in range(self.hidden.n):
            if fp is not None and (gp.cross or not self.last):
                # the full-precision stream: this layer (unquantized) on the FP model's
                # own hidden states; its Linears' inputs are the targets' Xf
                gp.fp_in.clear()
                self.fp_state.clear()
                cur.clear()
                cur["fp"] = True
                y = rt.run_layer(self.i, fp.get(b), self.pos[b], self.amasks[b])
                if not self.last:
                    fp.put_next(b, y)
                del y
            self._run(b)
            if every:
                if self.fp_experts:
                    self.fp_expert_inputs(None)
                _all_experts_pass(rt, self.unit, cur, self.calibrated_experts)
        if self.obs.needs_refine:  # the same inputs again
            for b in range(self.hidden.n):
                self._run(b, refine=True)
                if every:
                    _all_experts_pass(rt, self.unit, cur, self.calibrated_experts)

    def solve(self, rec: dict, smoothed, touched) -> tuple[dict, dict]:
        """Every quantized Linear of this process decided (GPTQ, AWQ's clip search, else
        round to nearest): (parts to journal, name -> its dequantized weight)."""
        parts_out: dict[str, torch.Tensor] = {}
        overrides: dict = {}
        set_amax: dict[tuple, SharedScale] = {}
        for n in sorted(self.mine):
            r = self.mine[n]
            if n in self.others:  # another process's solve
                continue
            share = self._share(n, smoothed, touched, set_amax)
            w, changed = self._weight(n, smoothed, touched, share)
            got = self.gptq_pass.solve(n, w, r.scheme,
                                       None if share is None else share.amax)  # fmt: skip
            parts = None
            if got is not None:
                parts, fell_back = got
                if fell_back and n not in rec["fallbacks"]:
                    rec["fallbacks"].append(n)
            else:
                parts = self.clip_pass.solve(n, w, r.scheme)  # AWQ's clip, smoothed weight
            if parts is not None:
                rec["parts"].append(n)
                parts_out.update({f"{r.module}.{k}": v.contiguous() for k, v in parts.items()})
            else:
                if n in self.gptq or n in self.clip or (n in self.static and not self.seen[n]):
                    warnings.warn(
                        f"calibration: '{n}' saw no calibration token; rounded to nearest"
                        + (" (input scale from its sibling experts)" if n in self.static
                           else ""),
                        ExpertFallbackWarning, stacklevel=3,
                    )  # fmt: skip
                    rec["fallbacks"].append(n)
                parts = round_to_nearest(self.ckpt, n, r.scheme, w, changed, share)
                if changed:
                    # the smoothed weight's parts, or a member of a smoothed fused set (its
                    # global scale is the set's smoothed one): the source's are not these
                    rec["parts"].append(n)
                    parts_out.update({f"{r.module}.{k}": v.contiguous()
                                      for k, v in parts.items()})  # fmt: skip
            overrides[n] = functools.partial(dequantized, r.scheme, parts)
            del w
        return parts_out, overrides

    def _weight(self, n: str, smoothed, touched, share) -> tuple[torch.Tensor, bool]:
        """(the weight ``n`` is quantized from, whether it is not the source's): smoothed
        (float32) where smoothing changed it or a member of its fused set (the members
        then compute their global scale alike, in float32, and none is a transcode of
        the source's bytes), else as stored."""
        if n in touched or (share is not None and share.smoothed):
            return smoothed(n), True
        return self.ckpt.get(n), False

    def _share(self, n: str, smoothed, touched, cache: dict) -> SharedScale | None:
        """What ``n``'s NVFP4 fused set shares: the source's (:class:`SharedScales`), or,
        where smoothing changed a member, the set's largest |value| after smoothing (every
        member is then quantized under it; every process computes the same value)."""
        share = self.shared.get(n) if self.shared else None
        if share is None:
            return None
        members = self.shared.members(n)
        if not any(k in touched for k in members):
            return share
        if members not in cache:
            top = torch.stack([self.allrows[k].scheme.abs_max(smoothed(k), name=k)
                               for k in members]).amax()  # fmt: skip
            cache[members] = SharedScale(top, None, smoothed=True)
        return cache[members]

    def rerun(self, overrides: dict, kv: bool) -> dict | None:
        """The layer on its quantized weights: the next layer's inputs, and what enters
        its KV cache as served (its KV absmax when ``kv``)."""
        rt = self.rt
        kvp = KVPass(self.i) if kv else None
        handle = rt.add_kv_hook(kvp.hook) if kvp is not None else None
        self.src.overrides = overrides
        try:
            for b in range(self.hidden.n):
                if kvp is not None:
                    kvp.mask = self.masks[b]
                y = rt.run_layer(self.i, self.hidden.get(b), self.pos[b], self.amasks[b])
                if not self.last:
                    self.hidden.put_next(b, y)
        finally:
            if handle is not None:
                handle.remove()
            rt.loader.release()
            self.src.overrides = {}
        return kvp.result() if kvp is not None else None


def calibrate_layer(rt, src, ckpt, rows, allrows, i, algorithm, options, hidden, pos, masks,
                    amasks, journal, observer, group, fp=None, shared=None) -> dict:  # fmt: skip
    """Calibrate decoder layer ``i`` (see the module doc); the layer's journal record:
    input scales, routed-token counts, fallbacks, the rows whose parts are journaled,
    smoothing choices, routing counts, KV absmax."""
    L = _Layer(rt, src, ckpt, rows, allrows, i, algorithm, options, hidden, pos, masks,
               amasks, journal, observer, group, fp, shared)  # fmt: skip
    mine, by_name = L.mine, L.by_name
    handles = [rt.add_hook(L.on_linear, set(mine) | L.smoothing.names)]
    if L.router is not None:
        handles.append(rt.add_hook(L.on_router, {L.router}))
    if (L.all_experts or L.fp_experts) and L.latent_in is not None:
        handles.append(rt.add_hook(L.on_latent_input, {L.latent_in}))
    try:
        sm = L.smooth()
        touched = sm.touched()

        def smoothed(n: str) -> torch.Tensor:
            """A smoothed tensor: float32 for a quantized row, the output dtype if kept."""
            t = sm.apply(n, ckpt.get(n).float())
            return t if n in mine else t.to(allrows[n].out_dtype)

        # the layer runs on its smoothed (unquantized) weights for the statistics below
        src.overrides = {n: functools.partial(smoothed, n) for n in touched}
        L.statistics()
    finally:
        for h in handles:
            h.remove()
        rt.loader.release()
        src.overrides = {}

    rec: dict = {"layer": i, "scales": {}, "expert_tokens": {}, "fallbacks": [], "parts": [],
                 "kept": [], "routing": L.routing, "smoothing": sm.chosen}  # fmt: skip
    for n in mine:
        if by_name[n].role.expert is not None:
            rec["expert_tokens"][n] = L.routed[n]
    parts_out, overrides = L.solve(rec, smoothed, touched)
    if group.world == 1:
        rec["solves"] = [len(parts_out_names(parts_out, mine))]
    else:
        sets: dict = {}

        def rtn(n: str) -> dict:  # as its owner rounded it (L.solve)
            share = L._share(n, smoothed, touched, sets)
            w, changed = L._weight(n, smoothed, touched, share)
            return round_to_nearest(ckpt, n, mine[n].scheme, w, changed, share)

        _share_solves(group, journal, i, mine, L.others, rtn, rec, parts_out, overrides)
    for n in sorted(touched - set(mine)):  # kept tensors smoothing changed (norms, router)
        t = smoothed(n).contiguous()
        parts_out[n] = t
        overrides[n] = t
        rec["kept"].append(n)
    keys = {n: by_name[n].key for n in L.static}
    rec["scales"] = L.obs.scales(i, mine, keys, L.seen, rec["fallbacks"])
    if parts_out and group.leader:
        tmp = journal / f"layer-{i}.tmp"
        save_file(parts_out, str(tmp))
        os.replace(tmp, journal / f"layer-{i}.safetensors")
    kv = options.kv_cache is not None and rt.text.attention_of(i) != "kda"
    if L.last and not kv:
        return rec
    kv_max = L.rerun(overrides, kv)
    if kv:
        rec["kv"] = kv_max
    return rec


def _share_solves(group, journal: Path, i: int, mine, others, rtn, rec, parts_out,
                  overrides) -> None:  # fmt: skip
    """Under torchrun: write the parts of this process's share of layer ``i``'s GPTQ
    Linears, wait for every process, then take the others' parts (and their fallbacks)
    as if solved here. A Linear of another share that wrote no parts saw no token and was
    rounded to nearest: that is recomputed here (``rtn(name)``: cheap, the same bytes,
    its fused set's global scale and an MXFP4 source's transcode included). The record's
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
            parts = rtn(n)
        overrides[n] = functools.partial(dequantized, mine[n].scheme, parts)
    fb = {n for f, _, _ in lists for n in f}
    done = {n for _, p, _ in lists for n in p}
    rec["solves"] = [k for _, _, k in lists]
    rec["fallbacks"] = [n for n in sorted(mine) if n in fb]
    rec["parts"] = [n for n in sorted(mine) if n in done]


def parts_out_names(parts_out: dict, mine: dict) -> set[str]:
    """The quantized rows whose parts are in ``parts_out``."""
    mods = {k.rpartition(".")[0] for k in parts_out}
    return {n for n, r in mine.items() if r.module in mods}


class LayerLoss:
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
                gated_mlp(rt.text, rt.linear, w, f"routed_experts.{e}", r)
    finally:
        cur[flag] = False


def _all_experts_pass(rt, unit: str, cur: dict, experts: list[int]) -> None:
    """Run every calibrated routed expert on all of the micro-batch's tokens (the hooks
    take their statistics; the outputs are discarded)."""
    _experts_pass(rt, unit, cur, experts, cur.get("expert_input"), "all", "moe_all_experts")

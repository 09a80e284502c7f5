"""``plan_memory``: a source and a workload into a :class:`~.render.MemoryPlan`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..arch import load_config
from ..checkpoint.output import refuse_partial
from ..errors import ConfigError
from ..layout import Layout
from ..serving import ServingTarget, resolve_device
from ..shard.plan import load_expert_load
from ..stream.format import is_stream_dir
from ..synth import PRESETS, preset_config
from ..units import parse_tokens
from .devices import device_budget
from .render import MemoryPlan
from .search import Planner
from .tensors import Tensors, checkpoint_tensors, config_tensors, quantized_tensors
from .workload import LayerModel, Workload


def load_source(src: str | Path | None) -> Tensors:
    """A config.json, a model directory (its stored tensors when it has weights) or a
    bundled preset name."""
    if src is None:
        raise ConfigError(
            "give SRC (a config.json, a model directory or a preset such as kimi-k3), or a "
            "--recipe whose source.path names the model."
        )
    p = Path(src)
    if p.exists():
        refuse_partial(p)  # an unfinished output (a stream without its manifest, too)
        if is_stream_dir(p):
            raise ConfigError(
                f"{p} is a stream directory (it has a manifest.json); plan from the "
                f"checkpoint it was sharded from, or its config.json."
            )
        if p.is_dir() and any(
            f.suffix in (".safetensors", ".bin", ".pt", ".pth") for f in p.iterdir()
        ):
            return checkpoint_tensors(p)
        raw = load_config(p)
        f = p / "config.json" if p.is_dir() else p
        return config_tensors(raw, str(f))
    if str(src) in PRESETS:
        return config_tensors(preset_config(str(src)), f"preset {src}")
    raise ConfigError(
        f"'{src}' is neither a config.json / model directory nor a preset ({', '.join(PRESETS)})."
    )


def _attention_label(L: LayerModel) -> str:
    counts = {k: L.kinds.count(k) for k in ("kda", "mla", "gqa") if k in L.kinds}
    return ", ".join(f"{n} {k.upper()}" for k, n in counts.items())


#: plan_memory's stages, in order (``on_stage``)
STAGES = ("reading the model", "planning the quantization", "placing every rank's weights",
          "searching the layouts that fit")  # fmt: skip


def plan_memory(
    *,
    src: str | Path | None = None,
    recipe=None,
    tp: int | None = None,
    pp: int | None = None,
    ep: int | None = None,
    redundant_experts: int | None = None,
    pp_layers: Sequence[int] | None = None,
    expert_load=None,
    scheme: str | None = None,
    context: int | str | None = None,
    batch: int | None = None,
    kv_dtype: str = "bf16",
    prefill_chunk: int | str = 8192,
    device_mem: str | int | None = None,
    device: str | None = None,
    search: bool = True,
    top: int = 5,
    serving_device: str | None = None,
    strict_serving: bool = False,
    on_stage=None,
) -> MemoryPlan:
    """The memory budget of every rank (see the module doc). ``recipe`` (a loaded
    :class:`k3convert.recipe.Recipe`): its ``source.path``, ``layout`` and ``quantize``
    sections are the defaults, and its ``target`` the device, context and batch (else
    131072 tokens x 1, no device); explicit arguments win (``scheme`` replaces the
    recipe's quantize section).
    A planned quantization is checked against vLLM on ``serving_device`` (None: the
    recipe's ``output.serving_device``, else cuda) at the layout's
    tp (:mod:`k3convert.serving`): ``warnings`` lists what it would refuse;
    ``strict_serving`` (or the recipe's ``output.strict_serving``) raises instead.
    on_stage(name): progress, called as each stage starts (:data:`STAGES`)."""
    stage = on_stage or (lambda name: None)
    if isinstance(recipe, (str, os.PathLike)):  # loading one is the caller's (a layer up)
        raise TypeError(f"plan_memory takes a loaded Recipe (k3convert.recipe.load_recipe), "
                        f"not the path {recipe}")  # fmt: skip
    rlay = getattr(recipe, "layout", None)
    if src is None and recipe is not None:
        src = getattr(getattr(recipe, "source", None), "path", None)
    tp = tp if tp is not None else getattr(rlay, "tp", 1)
    pp = pp if pp is not None else getattr(rlay, "pp", 1)
    ep = ep if ep is not None else getattr(rlay, "moe_ep", 1)
    if redundant_experts is None:
        redundant_experts = getattr(rlay, "redundant_experts", 0) or 0
    if pp_layers is None and getattr(rlay, "pp_layers", None):
        pp_layers = list(rlay.pp_layers)
    even_load = False
    if expert_load is None and rlay is not None and getattr(rlay, "expert_load", None):
        if rlay.expert_load == "calibration":  # measured by a run that has not happened:
            even_load = True  # equal counts, as convert plans before calibrating
        else:
            expert_load = rlay.expert_load
    target = getattr(recipe, "target", None)
    if target is not None:
        if device is None and device_mem is None:
            device = target.device
        context = target.context if context is None else context
        batch = target.batch if batch is None else batch
    workload = Workload(
        context=parse_tokens(131072 if context is None else context, "--context"),
        batch=1 if batch is None else batch,
        kv_dtype=kv_dtype,
        prefill_chunk=parse_tokens(prefill_chunk, "--prefill-chunk"),
    )
    budget, label = device_budget(device_mem, device)
    if not isinstance(top, int) or top < 1:
        raise ConfigError(f"--top must be a positive integer, got {top!r}.")
    layout = Layout(tp=tp, pp=pp, moe_ep=ep)
    stage(STAGES[0])
    t = load_source(src)
    want = getattr(getattr(recipe, "source", None), "model_type", None)
    if want is not None and t.config.get("model_type") != want:
        raise ConfigError(
            f"{recipe.origin}: source.model_type is '{want}' but {src} is a "
            f"'{t.config.get('model_type')}' model; plan the model the recipe was written "
            f"for (or change source.model_type)."
        )
    if scheme is not None or (recipe is not None and recipe.quantize is not None):
        stage(STAGES[1])
        t = (
            quantized_tensors(t, scheme=scheme)
            if scheme is not None
            else quantized_tensors(t, recipe=recipe)
        )
    load = load_expert_load(expert_load)
    if even_load:
        n = getattr(getattr(t.cfg, "text", t.cfg), "num_experts", 0) or 0
        layers = {r.layer for r in t.roles if r.expert is not None}
        load = {L: [1.0] * n for L in layers} if layers else None
    stage(STAGES[2])
    planner = Planner(t, workload, load=load, redundant=redundant_experts)
    planner.check(layout)
    if pp_layers is not None and len(pp_layers) != layout.pp:
        raise ConfigError(
            f"--pp-layers lists {len(pp_layers)} stage(s) but --pp is {layout.pp}; give one "
            f"layer count per stage."
        )
    serving = _serving_warnings(t, layout, recipe, serving_device, strict_serving)
    ranks, ranges = planner.ranks(layout, pp_layers)
    L = planner.layers
    plan = MemoryPlan(
        source=str(src),
        model=_model_info(t, L),
        layout=layout,
        redundant_experts=redundant_experts,
        workload=workload,
        stages=ranges,
        ranks=ranks,
        budget=budget,
        device=label,
        warnings=serving,
    )
    plan.notes += _notes(L, layout)
    if budget is not None and search:
        stage(STAGES[3])
        plan.search, plan.search_note = planner.search(budget, top)
    return plan


def _serving_warnings(t, layout: Layout, recipe, serving_device, strict_serving) -> list[str]:
    """What vLLM would refuse of the planned quantization (strict: raises)."""
    if t.qplan is None:
        return []
    out_sec = getattr(recipe, "output", None)
    target = ServingTarget(
        tp=layout.tp, moe_ep=layout.moe_ep,
        device=resolve_device(serving_device or getattr(out_sec, "serving_device", None),
                              engine_output=False),  # (a plan is for a cluster: auto is cuda)
        strict=strict_serving or bool(getattr(out_sec, "strict_serving", False)),
    )  # fmt: skip
    return [f"serving: {p.line()}" for p in target.check(t.qplan, t.config)]


def _model_info(t, L) -> dict:
    """The plan's model section: type, layers, attention, where the weights come from."""
    return {
        "model_type": t.config.get("model_type"),
        "arch": t.arch.name,
        "layers": L.n,
        "attention": _attention_label(L),
        "weights_from": (
            "config (what synth writes for it)"
            if t.origin == "config"
            else "checkpoint (its stored tensors)"
        )
        + (f", quantized by {t.quantized}" if t.quantized else ""),
        "tensors": len(t.names),
    }


def _notes(L, layout: Layout) -> list[str]:
    """What the figures leave out or assume, for this model and layout."""
    notes = []
    if "mla" in L.kinds and layout.tp > 1:
        notes.append("the MLA latent cache is replicated on every TP rank of a stage.")
    if "kda" in L.kinds:
        notes.append(
            "KDA layers keep a fixed state per sequence (float32 recurrent state + bf16 conv "
            "inputs) that does not grow with the context."
        )
    if getattr(L.text, "num_mtp", 0):
        notes.append("MTP layers' weights are counted; their KV cache is not.")
    return notes

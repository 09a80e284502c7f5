"""``k3convert quantize``: the command line of :func:`k3convert.pipeline.quantize`. Its
calibration and auto-keep flags become the recipe sections they override and go through
the same checks (:func:`k3convert.recipe.calibrate_section`), in the flags' words."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from .cli_options import Force, NoProgress, StrictServing
from .errors import ConfigError

#: calibration / auto-keep options whose flag is not ``--`` + the key (error messages)
_FLAGS = {"awq_clip": "--no-awq-clip", "act_order": "--no-act-order",
          "budget": "--auto-keep", "scheme": "--auto-keep-scheme"}  # fmt: skip


# -- quantize's options (typer reads help and flag names from these) --
Src = Annotated[Path, typer.Argument(help="Source checkpoint (bf16, FP8-block, int4, ...).")]
Out = Annotated[Path, typer.Argument(help="Output compressed-tensors directory.")]
Scheme = Annotated[
    str | None,
    typer.Option(
        help="Scheme for every quantizable Linear: fp8-block, w4a16, w8a8, nvfp4, ... "
        "(--list-schemes prints them all)."
    ),
]


def _list_schemes(value: bool) -> None:
    if value:
        typer.echo(scheme_table())
        raise typer.Exit()


ListSchemes = Annotated[
    bool,
    typer.Option(
        "--list-schemes",
        callback=_list_schemes,
        is_eager=True,
        help="Print every registered scheme (weights, activations, format) and exit.",
    ),
]
Recipe = Annotated[Path | None, typer.Option(help="Recipe YAML with ordered rules (see recipes/).")]
Keep = Annotated[
    list[str] | None,
    typer.Option(
        help="Also keep tensors matching this glob or re: pattern (repeatable). A kept "
        "tensor of a quantized source stays as released when its format is a "
        "compressed-tensors one (MXFP4, NVFP4, packed int-N); see --dequantize-kept."
    ),
]
DequantizeKept = Annotated[
    bool,
    typer.Option(
        "--dequantize-kept",
        help="Write kept tensors of a quantized source dequantized (config dtype) "
        "instead of as released.",
    ),
]
NoDefaultKeep = Annotated[
    bool,
    typer.Option(
        "--no-default-keep", help="Drop the architecture's default exceptions (router...)."
    ),
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved table, write nothing.")]
FullTable = Annotated[
    bool, typer.Option("--full-table", help="With --dry-run: one row per tensor.")
]
Workers = Annotated[
    int | None,
    typer.Option(help="Tensors quantized in parallel (default: the CPU cores, at most 8)."),
]
ShardSizeGb = Annotated[float, typer.Option(help="Output file size in GiB.")]
Calibrate = Annotated[
    bool,
    typer.Option(
        "--calibrate",
        help="Calibrate layer by layer on the runtime first (static input scales and "
        "NVFP4 input global scales; GPTQ weights with --algorithm gptq); resumable from "
        "OUT.calib/ or --offload-dir. The way to write nvfp4 (W4A4).",
    ),
]
Algorithm = Annotated[
    str | None,
    typer.Option(
        help="With --calibrate: gptq (default; int, FP8 and FP4 schemes), awq (low-bit "
        "int or FP4 weights), smoothquant, smoothquant+gptq (W8A8, NVFP4 W4A4), static "
        "(scales only) or rtn (scales and routing counts, weights rounded)."
    ),
]
Dataset = Annotated[
    str | None,
    typer.Option(
        help="With --calibrate: a local file / dir, a calibration/*.yaml name, or a "
        "cached hub dataset (default: the built-in corpus)."
    ),
]
NumSamples = Annotated[
    int | None, typer.Option(help="With --calibrate: calibration samples (default 128).")
]
SeqLen = Annotated[
    int | None, typer.Option(help="With --calibrate: tokens per sample (default 512).")
]
Seed = Annotated[int | None, typer.Option(help="With --calibrate: shuffle seed (default 0).")]
OffloadDir = Annotated[
    Path | None,
    typer.Option(help="With --calibrate: keep hidden states and the journal here."),
]
MoeAllExperts = Annotated[
    bool,
    typer.Option(
        "--moe-all-experts",
        help="With --calibrate: every routed expert's statistics over all calibration "
        "tokens (none starved; outputs and routing counts stay the routed ones).",
    ),
]
Observer = Annotated[
    str | None,
    typer.Option(
        help="With --calibrate: static input scales from minmax (default), percentile "
        "of |x| (--percentile) or mse (MSE-optimal clip)."
    ),
]
Percentile = Annotated[
    float | None,
    typer.Option(help="With --observer percentile: the percentile of |x| (default 99.99)."),
]
WeightObserver = Annotated[
    str | None,
    typer.Option(
        help="Integer and FP4 schemes' weight scales: minmax (full range, default) or mse "
        "(each group's scale searched for the smallest rounding error; RTN, GPTQ and AWQ; "
        "under GPTQ an FP4 group's error is weighed by its block of the Hessian).",
    ),
]
Alpha = Annotated[
    float | None,
    typer.Option(help="With --algorithm smoothquant[+gptq]: migration strength (0.5)."),
]
AlphaSearch = Annotated[
    bool,
    typer.Option(
        "--alpha-search",
        help="With --algorithm smoothquant[+gptq]: search alpha per mapping on the "
        "W8A8 / W4A4 error (weights and activations fake-quantized as they run) instead "
        "of --alpha.",
    ),
]
SqMinGain = Annotated[
    float | None,
    typer.Option(
        help="With --algorithm smoothquant[+gptq]: smooth a mapping only where that "
        "removes at least this fraction of its quantization error on the calibration "
        "rows (default 0.25; 0 smooths wherever it helps, measured best for nvfp4 W4A4 "
        "on a dense model).",
    ),
]
NoActOrder = Annotated[
    bool,
    typer.Option(
        "--no-act-order",
        help="With GPTQ: sweep columns in their stored order, not by descending "
        "Hessian diagonal (act-order, the default, as llm-compressor's).",
    ),
]
NoAwqClip = Annotated[
    bool,
    typer.Option(
        "--no-awq-clip",
        help="With --algorithm awq: skip AWQ's clip step (each int Linear's group "
        "ranges searched for the smallest output error over the calibration tokens).",
    ),
]
GptqSolveReleased = Annotated[
    bool,
    typer.Option(
        "--gptq-solve-released",
        help="With GPTQ: also solve tensors released in MXFP4 under a scheme that holds "
        "them exactly (nvfp4, nvfp4a16, mxfp4, fp8-block); by default they are transcoded "
        "exactly and GPTQ solves the rest.",
    ),
]
GptqFpTarget = Annotated[
    float | None,
    typer.Option(
        "--gptq-fp-target",
        help="With GPTQ: move each Linear's target output from its output on the "
        "quantized model's inputs (0, GPTQ's own, the default) towards the "
        "full-precision model's (1), GPTAQ-style; 0.5 recommended. Carries a second, "
        "full-precision copy of the calibration hidden states.",
        metavar="A",
    ),
]
KvCache = Annotated[
    str | None,
    typer.Option(
        "--kv-cache",
        help="With --calibrate: fp8 writes calibrated per-layer KV-cache scales "
        "(k_scale / v_scale; MLA: the latent cache) and kv_cache_scheme.",
    ),
]
AutoKeep = Annotated[
    str | None,
    typer.Option(
        "--auto-keep",
        help="Budgeted exceptions: keep the most sensitive tensors (routed experts "
        "individually) within BUDGET: 5%, 1.5GB, 300MiB or 4.5bpw. Report in "
        "OUT/sensitivity.json.",
        metavar="BUDGET",
    ),
]
AutoKeepScheme = Annotated[
    str | None,
    typer.Option(
        help="With --auto-keep: move the chosen tensors to this scheme (a ladder, e.g. "
        "int8-g128) instead of keeping them in high precision."
    ),
]
Sensitivity = Annotated[
    str,
    typer.Option(
        help="With --auto-keep: layer (default: each tensor quantized alone, its "
        "layer's output error), output (cheapest) or kl (exact, small models)."
    ),
]
Plot = Annotated[
    Path | None,
    typer.Option(help="With --auto-keep: also draw the sensitivities as a PNG chart."),
]
ServingTp = Annotated[
    int,
    typer.Option(help="Check that vLLM loads OUT at this tensor-parallel degree (warns)."),
]
ServingDevice = Annotated[
    str, typer.Option(help="Device class vLLM will serve OUT on: cuda or cpu.")
]


def quantize(
    src: Src,
    out: Out,
    scheme: Scheme = None,
    list_schemes: ListSchemes = False,
    recipe: Recipe = None,
    keep: Keep = None,
    dequantize_kept: DequantizeKept = False,
    no_default_keep: NoDefaultKeep = False,
    dry_run: DryRun = False,
    full_table: FullTable = False,
    force: Force = False,
    no_progress: NoProgress = False,
    workers: Workers = None,
    shard_size_gb: ShardSizeGb = 4.0,
    calibrate: Calibrate = False,
    algorithm: Algorithm = None,
    dataset: Dataset = None,
    num_samples: NumSamples = None,
    seq_len: SeqLen = None,
    seed: Seed = None,
    offload_dir: OffloadDir = None,
    moe_all_experts: MoeAllExperts = False,
    observer: Observer = None,
    percentile: Percentile = None,
    weight_observer: WeightObserver = None,
    alpha: Alpha = None,
    alpha_search: AlphaSearch = False,
    sq_min_gain: SqMinGain = None,
    no_act_order: NoActOrder = False,
    no_awq_clip: NoAwqClip = False,
    gptq_fp_target: GptqFpTarget = None,
    gptq_solve_released: GptqSolveReleased = False,
    kv_cache: KvCache = None,
    auto_keep: AutoKeep = None,
    auto_keep_scheme: AutoKeepScheme = None,
    sensitivity: Sensitivity = "layer",
    plot: Plot = None,
    serving_tp: ServingTp = 1,
    serving_device: ServingDevice = "cuda",
    strict_serving: StrictServing = False,
):
    """Quantize to FP8 / INT8 / low-bit, writing a compressed-tensors checkpoint."""
    from .parallel import procs
    from .pipeline import quantize as do_quantize
    from .serving import ServingTarget

    cal, scan_data = _calibration_flags(
        scheme=scheme, recipe=recipe, calibrate=calibrate, algorithm=algorithm,
        dataset=dataset, num_samples=num_samples, seq_len=seq_len, seed=seed,
        offload_dir=offload_dir, moe_all_experts=moe_all_experts, observer=observer,
        percentile=percentile, alpha=alpha, alpha_search=alpha_search, sq_min_gain=sq_min_gain,
        no_act_order=no_act_order, no_awq_clip=no_awq_clip, gptq_fp_target=gptq_fp_target,
        gptq_solve_released=gptq_solve_released, kv_cache=kv_cache, auto_keep=auto_keep,
        auto_keep_scheme=auto_keep_scheme, plot=plot, sensitivity=sensitivity,
    )  # fmt: skip
    res = do_quantize(
        src=src,
        out=out,
        scheme=scheme,
        recipe=recipe,
        keep=tuple(keep or ()),
        default_keep=not no_default_keep,
        kept_as_stored=not dequantize_kept,
        dry_run=dry_run,
        force=force,
        workers=workers,
        progress=not no_progress,
        shard_size=max(1, int(shard_size_gb * 2**30)),
        calibrate=cal.options() if cal is not None else None,
        algorithm=cal.algorithm if cal is not None else "rtn",
        log=lambda line: typer.echo(line, err=True),
        auto_keep=auto_keep,
        auto_keep_scheme=auto_keep_scheme,
        sensitivity=sensitivity,
        plot=plot,
        sensitivity_data=scan_data,
        serving=ServingTarget(tp=serving_tp, device=serving_device, strict=strict_serving),
        weight_observer=weight_observer,
    )
    if procs.current().leader:  # under torchrun process 0 reports for the job
        _print_quantize(res, dry_run=dry_run, full_table=full_table, plot=plot)


def _calibration_flags(*, scheme, recipe, calibrate, algorithm, dataset, num_samples, seq_len,
                       seed, offload_dir, moe_all_experts, observer, percentile, alpha,
                       alpha_search, sq_min_gain, no_act_order, no_awq_clip, gptq_fp_target,
                       gptq_solve_released, kv_cache,
                       auto_keep, auto_keep_scheme, plot, sensitivity):  # fmt: skip
    """quantize's calibration and auto-keep flags, as the recipe sections they override
    (:func:`k3convert.recipe.calibrate_section` / :func:`~k3convert.recipe.
    auto_keep_section`: the checks a recipe gets, in the flags' words): (the calibration
    section or None, the sensitivity scan's data options or None)."""
    # imported here, not at the top: they pull in torch, and `k3convert --help` must not
    from .calibrate.options import SequentialOptions
    from .recipe import auto_keep_section, calibrate_section, load_recipe

    if (scheme is None) == (recipe is None):
        raise typer.BadParameter("give exactly one of --scheme NAME or --recipe R.yaml.")
    data = {k: v for k, v in (("dataset", dataset), ("num_samples", num_samples),
            ("seq_len", seq_len), ("seed", seed)) if v is not None}  # fmt: skip
    offload = os.fspath(offload_dir) if offload_dir is not None else None
    section = {k: v for k, v in (
        ("algorithm", algorithm), ("offload_dir", offload),
        ("moe_all_experts", moe_all_experts or None), ("observer", observer),
        ("percentile", percentile), ("alpha", alpha), ("kv_cache", kv_cache),
        ("alpha_search", alpha_search or None), ("sq_min_gain", sq_min_gain),
        ("act_order", False if no_act_order else None),
        ("awq_clip", False if no_awq_clip else None), ("gptq_fp_target", gptq_fp_target),
        ("gptq_solve_released", gptq_solve_released or None),
    ) if v is not None}  # fmt: skip
    try:
        if auto_keep is not None:
            ak = {"budget": auto_keep, "scheme": auto_keep_scheme, "sensitivity": sensitivity}
            auto_keep_section(ak, name=_flag)
        else:
            extra = [n for n, v in (("--auto-keep-scheme", auto_keep_scheme), ("--plot", plot),
                     ("--sensitivity", None if sensitivity == "layer" else sensitivity))
                     if v is not None]  # fmt: skip
            if extra:
                raise ConfigError(f"{', '.join(extra)} only apply with --auto-keep.")
        if calibrate:
            section.setdefault("algorithm", "gptq")
            cal = calibrate_section({**data, **section}, name=_flag)
            return cal, None
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    rec = load_recipe(recipe).require_quantize() if recipe is not None else None
    scan = None
    if auto_keep is not None or (rec is not None and rec.auto_keep is not None):
        if rec is not None and rec.calibrate is not None:  # the recipe's data scans too
            if data:
                raise typer.BadParameter(
                    f"{', '.join(map(_flag, data))}: the recipe's quantize.calibrate section "
                    f"sets the calibration data; give --calibrate to replace that section."
                )
        else:  # the sensitivity scan's data: the calibration set's options alone
            scan = SequentialOptions(**{"dataset": "default", **data})
        data = {}
    if section or data:
        raise typer.BadParameter(
            f"{', '.join(map(_flag, [*section, *data]))} only apply with --calibrate"
            + (" or --auto-keep." if not section else ".")
        )
    return None, scan


def scheme_table() -> str:
    """Every registered scheme, one line each: its weights, its activations, its
    compressed-tensors format (``quantize --list-schemes``)."""
    from .quant.schemes import get_scheme, known_schemes  # torch: not at start-up

    def args(a: dict | None, weights: bool) -> str:
        if a is None:
            return "-"
        text = f"{a['type']}{a['num_bits']} {a['strategy']}"
        if a.get("block_structure"):
            text += " " + "x".join(map(str, a["block_structure"]))
        elif a.get("group_size"):
            text += f" g{a['group_size']}"
        text += "" if a.get("symmetric", True) else " asym"
        if not weights and a.get("dynamic") == "local":  # NVFP4: per-group scales on the fly
            text += " dynamic, global scale calibrated"
        elif not weights:
            text += " dynamic" if a.get("dynamic") else " static (calibrated)"
        return text

    rows = [("scheme", "weights", "activations", "format")]
    for name in known_schemes():
        sc = get_scheme(name)
        rows.append((name, args(sc.weight_args(), True),
                     args(sc.act.ct_args() if sc.act else None, False), sc.format))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
        for r in rows
    )


def _flag(key: str) -> str:
    """The flag that sets a calibration / auto-keep option (error messages)."""
    return _FLAGS.get(key) or "--" + key.replace("_", "-")


def _print_quantize(res, *, dry_run: bool, full_table: bool, plot) -> None:
    """quantize's report: the table (dry run), the sensitivity scan, the calibration,
    the routing counts, the summary."""
    if dry_run:
        typer.echo(res.table(collapse=not full_table))
    if res.sensitivity is not None:
        typer.echo(res.sensitivity.table(top=15))  # ends with the selection's summary
        if res.sensitivity.selection is None:
            typer.echo(res.selection.summary())
        if not dry_run:
            typer.echo(f"sensitivity report: {res.out / 'sensitivity.json'}")
        if plot is not None:
            typer.echo(f"sensitivity chart: {plot}")
    cal = res.calibration
    if cal is not None:
        total = sum(cal.layer_seconds)
        per = ", ".join(f"{i}: {t:.2f} s" for i, t in enumerate(cal.layer_seconds))
        typer.echo(
            f"calibration ({cal.algorithm}): {len(cal.layer_seconds)} layer(s), {total:.1f} s; "
            f"per layer: {per}"
        )
        if cal.kv_absmax:
            typer.echo(f"KV-cache fp8 scales calibrated for {len(cal.kv_absmax)} layer(s)")
        if cal.smoothing:
            won = sum(v is not None for v in cal.smoothing.values())
            typer.echo(f"smoothing: {won} of {len(cal.smoothing)} mapping(s) smoothed")
        if cal.fallbacks:
            typer.echo(
                f"{len(cal.fallbacks)} routed expert Linear(s) saw no calibration token and "
                f"were rounded to nearest: {', '.join(cal.fallbacks)}"
            )
    if res.routing_counts is not None:
        typer.echo(
            f"routing counts of {len(cal.routing_counts)} MoE layer(s): {res.routing_counts} "
            f"(shard --expert-load; picked up by shard --redundant-experts)"
        )
    typer.echo(res.summary())

"""``k3convert quantize``: the command line of :func:`k3convert.pipeline.quantize`. Its
calibration and auto-keep flags are checked against each other (and a recipe's
sections) here, in the flags' words; the checks a recipe gets too live in
:class:`k3convert.calibrate.sequential.SequentialOptions`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .cli_options import Force, StrictServing
from .errors import ConfigError, K3Error

#: calibration options -> the quantize flags that set them (error messages)
_CAL_FLAGS = {"gptq_fp_target": "--gptq-fp-target", "awq_clip": "--no-awq-clip",
              "alpha": "--alpha", "alpha_search": "--alpha-search", "percentile": "--percentile",
              "algorithm": "--algorithm", "observer": "--observer"}  # fmt: skip


def quantize(
    src: Annotated[Path, typer.Argument(help="Source checkpoint (bf16, FP8-block, int4, ...).")],
    out: Annotated[Path, typer.Argument(help="Output compressed-tensors directory.")],
    scheme: Annotated[
        str | None,
        typer.Option(help="Scheme for every quantizable Linear: fp8-block, w4a16, w8a8, ..."),
    ] = None,
    recipe: Annotated[
        Path | None, typer.Option(help="Recipe YAML with ordered rules (see recipes/).")
    ] = None,
    keep: Annotated[
        list[str] | None,
        typer.Option(
            help="Also keep tensors matching this glob or re: pattern (repeatable). A kept "
            "tensor of a quantized source stays as released when its format is a "
            "compressed-tensors one (MXFP4, NVFP4, packed int-N); see --dequantize-kept."
        ),
    ] = None,
    dequantize_kept: Annotated[
        bool,
        typer.Option(
            "--dequantize-kept",
            help="Write kept tensors of a quantized source dequantized (config dtype) "
            "instead of as released.",
        ),
    ] = False,
    no_default_keep: Annotated[
        bool,
        typer.Option(
            "--no-default-keep", help="Drop the architecture's default exceptions (router...)."
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved table, write nothing.")
    ] = False,
    full_table: Annotated[
        bool, typer.Option("--full-table", help="With --dry-run: one row per tensor.")
    ] = False,
    force: Force = False,
    workers: Annotated[
        int | None,
        typer.Option(help="Tensors quantized in parallel (default: the CPU cores, at most 8)."),
    ] = None,
    shard_size_gb: Annotated[float, typer.Option(help="Output file size in GiB.")] = 4.0,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="Calibrate layer by layer on the runtime first (static input scales and "
            "NVFP4 input global scales; GPTQ weights with --algorithm gptq); resumable from "
            "OUT.calib/ or --offload-dir. The way to write nvfp4 (W4A4).",
        ),
    ] = False,
    algorithm: Annotated[
        str | None,
        typer.Option(
            help="With --calibrate: gptq (default; rtn for an FP4 --scheme, whose weights "
            "GPTQ does not solve), awq (low-bit weight-only), smoothquant, smoothquant+gptq "
            "(W8A8), static (scales only) or rtn (scales and routing counts, weights rounded)."
        ),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            help="With --calibrate: a local file / dir, a calibration/*.yaml name, or a "
            "cached hub dataset (default: the built-in corpus)."
        ),
    ] = None,
    num_samples: Annotated[
        int | None, typer.Option(help="With --calibrate: calibration samples (default 128).")
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option(help="With --calibrate: tokens per sample (default 512).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="With --calibrate: shuffle seed (default 0).")
    ] = None,
    offload_dir: Annotated[
        Path | None,
        typer.Option(help="With --calibrate: keep hidden states and the journal here."),
    ] = None,
    moe_all_experts: Annotated[
        bool,
        typer.Option(
            "--moe-all-experts",
            help="With --calibrate: every routed expert's statistics over all calibration "
            "tokens (none starved; outputs and routing counts stay the routed ones).",
        ),
    ] = False,
    observer: Annotated[
        str | None,
        typer.Option(
            help="With --calibrate: static input scales from minmax (default), percentile "
            "of |x| (--percentile) or mse (MSE-optimal clip)."
        ),
    ] = None,
    percentile: Annotated[
        float | None,
        typer.Option(help="With --observer percentile: the percentile of |x| (default 99.99)."),
    ] = None,
    weight_observer: Annotated[
        str | None,
        typer.Option(
            help="Integer schemes' weight scales: minmax (full range, default) or mse (each "
            "group's clip ratio searched for the smallest rounding error; RTN, GPTQ and AWQ).",
        ),
    ] = None,
    alpha: Annotated[
        float | None,
        typer.Option(help="With --algorithm smoothquant[+gptq]: migration strength (0.5)."),
    ] = None,
    alpha_search: Annotated[
        bool,
        typer.Option(
            "--alpha-search",
            help="With --algorithm smoothquant[+gptq]: search alpha per mapping on the "
            "W8A8 error (weights and dynamic activations fake-quantized) instead of --alpha.",
        ),
    ] = False,
    no_act_order: Annotated[
        bool,
        typer.Option(
            "--no-act-order",
            help="With GPTQ: sweep columns in their stored order, not by descending "
            "Hessian diagonal (act-order, the default, as llm-compressor's).",
        ),
    ] = False,
    no_awq_clip: Annotated[
        bool,
        typer.Option(
            "--no-awq-clip",
            help="With --algorithm awq: skip AWQ's clip step (each int Linear's group "
            "ranges searched for the smallest output error over the calibration tokens).",
        ),
    ] = False,
    gptq_fp_target: Annotated[
        float | None,
        typer.Option(
            "--gptq-fp-target",
            help="With GPTQ: move each Linear's target output from its output on the "
            "quantized model's inputs (0, GPTQ's own, the default) towards the "
            "full-precision model's (1), GPTAQ-style; 0.5 recommended. Carries a second, "
            "full-precision copy of the calibration hidden states.",
            metavar="A",
        ),
    ] = None,
    kv_cache: Annotated[
        str | None,
        typer.Option(
            "--kv-cache",
            help="With --calibrate: fp8 writes calibrated per-layer KV-cache scales "
            "(k_scale / v_scale; MLA: the latent cache) and kv_cache_scheme.",
        ),
    ] = None,
    auto_keep: Annotated[
        str | None,
        typer.Option(
            "--auto-keep",
            help="Budgeted exceptions: keep the most sensitive tensors (routed experts "
            "individually) within BUDGET: 5%, 1.5GB, 300MiB or 4.5bpw. Report in "
            "OUT/sensitivity.json.",
            metavar="BUDGET",
        ),
    ] = None,
    auto_keep_scheme: Annotated[
        str | None,
        typer.Option(
            help="With --auto-keep: move the chosen tensors to this scheme (a ladder, e.g. "
            "int8-g128) instead of keeping them in high precision."
        ),
    ] = None,
    sensitivity: Annotated[
        str,
        typer.Option(
            help="With --auto-keep: layer (default: each tensor quantized alone, its "
            "layer's output error), output (cheapest) or kl (exact, small models)."
        ),
    ] = "layer",
    plot: Annotated[
        Path | None,
        typer.Option(help="With --auto-keep: also draw the sensitivities as a PNG chart."),
    ] = None,
    serving_tp: Annotated[
        int,
        typer.Option(help="Check that vLLM loads OUT at this tensor-parallel degree (warns)."),
    ] = 1,
    serving_device: Annotated[
        str, typer.Option(help="Device class vLLM will serve OUT on: cuda or cpu.")
    ] = "cuda",
    strict_serving: StrictServing = False,
):
    """Quantize to FP8 / INT8 / low-bit, writing a compressed-tensors checkpoint."""
    from .parallel import procs
    from .pipeline import quantize as do_quantize
    from .serving import ServingTarget

    opts, scan_data = _calibration_flags(
        scheme=scheme, recipe=recipe, calibrate=calibrate, algorithm=algorithm,
        dataset=dataset, num_samples=num_samples, seq_len=seq_len, seed=seed,
        offload_dir=offload_dir, moe_all_experts=moe_all_experts, observer=observer,
        percentile=percentile, alpha=alpha, alpha_search=alpha_search,
        no_act_order=no_act_order, no_awq_clip=no_awq_clip, gptq_fp_target=gptq_fp_target,
        kv_cache=kv_cache, auto_keep=auto_keep, auto_keep_scheme=auto_keep_scheme, plot=plot,
        sensitivity=sensitivity,
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
        progress=True,
        shard_size=max(1, int(shard_size_gb * 2**30)),
        calibrate=opts,
        algorithm=(algorithm or _default_algorithm(scheme)) if calibrate else "rtn",
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
                       alpha_search, no_act_order, no_awq_clip, gptq_fp_target, kv_cache,
                       auto_keep, auto_keep_scheme, plot, sensitivity):  # fmt: skip
    """quantize's calibration and auto-keep flags, checked against each other and the
    recipe's sections: (the calibration options or None, the sensitivity scan's data
    options or None)."""
    if (scheme is None) == (recipe is None):
        raise typer.BadParameter("give exactly one of --scheme NAME or --recipe R.yaml.")
    data_given = [n for n, v in (("--dataset", dataset), ("--num-samples", num_samples),
                  ("--seq-len", seq_len), ("--seed", seed)) if v is not None]  # fmt: skip
    given = [n for n, v in (("--algorithm", algorithm), ("--offload-dir", offload_dir),
             ("--moe-all-experts", moe_all_experts or None), ("--observer", observer),
             ("--percentile", percentile), ("--alpha", alpha), ("--kv-cache", kv_cache),
             ("--alpha-search", alpha_search or None), ("--no-act-order", no_act_order or None),
             ("--no-awq-clip", no_awq_clip or None), ("--gptq-fp-target", gptq_fp_target))
             if v is not None]  # fmt: skip
    if auto_keep is None:
        extra = [n for n, v in (("--auto-keep-scheme", auto_keep_scheme), ("--plot", plot),
                 ("--sensitivity", None if sensitivity == "layer" else sensitivity))
                 if v is not None]  # fmt: skip
        if extra:
            raise typer.BadParameter(f"{', '.join(extra)} only apply with --auto-keep.")
    rec_keep = rec_cal = False
    if recipe is not None and scheme is None:  # its sections count as given
        from .recipe import load_recipe

        r = load_recipe(recipe)
        q = r.require_quantize()
        rec_keep, rec_cal = q.auto_keep is not None, q.calibrate is not None
    opts = scan_data = None
    if not calibrate and (auto_keep is not None or rec_keep):
        from .calibrate.sequential import SequentialOptions

        if rec_cal and data_given:
            raise typer.BadParameter(
                f"{', '.join(data_given)}: the recipe's quantize.calibrate section sets the "
                f"calibration data; give --calibrate to replace that section."
            )
        if not rec_cal:
            scan_data = SequentialOptions(
                dataset=dataset if dataset is not None else "default",
                num_samples=num_samples, seq_len=seq_len, seed=seed if seed is not None else 0,
            )  # fmt: skip
        data_given = []
    if calibrate:
        from .calibrate.sequential import SequentialOptions

        opts = SequentialOptions(
            dataset=dataset if dataset is not None else "default", num_samples=num_samples,
            seq_len=seq_len, seed=seed if seed is not None else 0, offload_dir=offload_dir,
            moe_all_experts=moe_all_experts, observer=observer or "minmax",
            percentile=percentile if percentile is not None else 99.99,
            alpha=alpha if alpha is not None else 0.5, kv_cache=kv_cache,
            alpha_search=alpha_search, act_order=not no_act_order, awq_clip=not no_awq_clip,
            gptq_fp_target=gptq_fp_target if gptq_fp_target is not None else 0.0,
        )  # fmt: skip
        if gptq_fp_target is not None and not 0 <= gptq_fp_target <= 1:
            raise typer.BadParameter(
                f"--gptq-fp-target must be a number in [0, 1] (0: GPTQ's own target, 1: "
                f"the full-precision model's outputs; 0.5 recommended), got {gptq_fp_target}."
            )
        set_ = {k for k, v in (("gptq_fp_target", gptq_fp_target is not None),
                ("awq_clip", no_awq_clip), ("alpha", alpha is not None),
                ("alpha_search", alpha_search),
                ("percentile", percentile is not None)) if v}  # fmt: skip
        try:  # the checks a recipe's quantize.calibrate gets, in the flags' words
            opts.check_applicable(algorithm or "gptq", set_, _CAL_FLAGS.get)
        except ConfigError as e:
            raise typer.BadParameter(str(e)) from None
    elif given or data_given:
        raise typer.BadParameter(
            f"{', '.join(given + data_given)} only apply with --calibrate"
            + (" or --auto-keep." if not given else ".")
        )
    return opts, scan_data


def _print_quantize(res, *, dry_run: bool, full_table: bool, plot) -> None:
    """quantize's report: the table (dry run), the sensitivity scan, the calibration,
    the routing counts, the summary."""
    if dry_run:
        typer.echo(res.table(collapse=not full_table))
    if res.sensitivity is not None:
        typer.echo(res.sensitivity.table(top=15))
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


def _default_algorithm(scheme: str | None) -> str:
    """--calibrate's algorithm when none is given: GPTQ, except for an FP4 scheme (NVFP4,
    MXFP4), whose weights it does not solve: there calibration sets the input global
    scales and rounds the weights to nearest (rtn)."""
    from .quant.schemes import FP4Scheme, get_scheme

    if scheme is not None:
        try:
            if isinstance(get_scheme(scheme), FP4Scheme):
                return "rtn"
        except K3Error:
            pass  # an unknown name: the plan names the problem
    return "gptq"

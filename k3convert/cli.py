"""The ``k3convert`` command line: thin wrappers over keyword-only library functions.

Every K3Error becomes one line on stderr and exit code 2 (no traceback); anything else
is a bug and keeps its traceback. Commands live in their library modules; this file
only parses options and prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer

from . import __version__
from .cli_options import (
    ComputeDType,
    Device,
    ExpertLoad,
    Force,
    PPLayers,
    RedundantExperts,
    StrictServing,
)
from .errors import ConfigError, K3Error

app = typer.Typer(
    name="k3convert",
    help="Offline conversion of frontier-scale MoE checkpoints: inspect, synth, quantize, "
    "shard, verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool):
    if value:
        from . import native  # imported here: the other verbs load it only when they decode

        typer.echo(f"k3convert {__version__}\n{native.status()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="Print the version and whether the native FP4 kernels are in use.",
        ),
    ] = False,
):
    """k3convert: quantize, reshard and verify checkpoints without holding the whole model."""


#: calibration options -> the quantize flags that set them (error messages)
_CAL_FLAGS = {"gptq_fp_target": "--gptq-fp-target", "awq_clip": "--no-awq-clip",
              "alpha": "--alpha", "alpha_search": "--alpha-search", "percentile": "--percentile",
              "algorithm": "--algorithm", "observer": "--observer"}  # fmt: skip


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="Model directory, or a config.json alone.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    tensors: Annotated[
        bool, typer.Option("--tensors", help="Also print the per-tensor role table.")
    ] = False,
    drop_mtp: Annotated[
        bool, typer.Option("--drop-mtp", help="Leave multi-token-prediction layers out.")
    ] = False,
):
    """Model type, layers, experts, parameters and bytes by component, dtype and encoding."""
    from .inspect import format_report, inspect_path

    report = inspect_path(path=path, tensors=tensors, keep_mtp=not drop_mtp)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        typer.echo(format_report(report))


@app.command()
def synth(
    config: Annotated[
        str,
        typer.Argument(
            help="config.json, a model directory, or a built-in preset "
            "(kimi-k3, kimi-linear-48b, kimi-k2, kimi-k2-thinking, kimi-k25, deepseek-v3, "
            "llama3-8b, qwen3-30b-a3b)."
        ),
    ],
    out: Annotated[Path, typer.Argument(help="Output directory (must not exist).")],
    tiny: Annotated[
        bool, typer.Option("--tiny", help="Scale every dimension down, keeping the structure.")
    ] = False,
    layers: Annotated[int | None, typer.Option(help="Decoder layers.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size.")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="KV heads (GQA families).")] = None,
    intermediate: Annotated[int | None, typer.Option(help="Dense MLP width.")] = None,
    experts: Annotated[int | None, typer.Option(help="Routed experts per MoE layer.")] = None,
    moe_intermediate: Annotated[int | None, typer.Option(help="Routed expert width.")] = None,
    latent: Annotated[
        int | None, typer.Option(help="Latent MoE width (Kimi K3: the routed experts' input).")
    ] = None,
    topk: Annotated[int | None, typer.Option(help="Experts per token.")] = None,
    vocab: Annotated[int | None, typer.Option(help="Vocabulary size.")] = None,
    vision_layers: Annotated[int | None, typer.Option(help="Vision encoder blocks.")] = None,
    mtp: Annotated[int | None, typer.Option(help="MTP layers (DeepSeek-V3 family).")] = None,
    dtype: Annotated[
        str | None, typer.Option(help="Storage dtype: bf16, fp16 or fp32 (default: config's).")
    ] = None,
    encoding: Annotated[
        str,
        typer.Option(
            help="auto (as the config's quantization_config says), plain, fp8-block, int4 or "
            "mxfp4 (routed experts, as Kimi K3 is released)."
        ),
    ] = "auto",
    shard_mb: Annotated[
        float, typer.Option(help="Split into files of about this many MB, with an index.")
    ] = 0,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    force: Force = False,
):
    """Write a random checkpoint with the exact names, dtypes and layout of an architecture."""
    from .synth import synthesize

    summary = synthesize(
        config=config,
        out=out,
        tiny=tiny,
        overrides=dict(
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            intermediate=intermediate,
            experts=experts,
            moe_intermediate=moe_intermediate,
            latent=latent,
            topk=topk,
            vocab=vocab,
            vision_layers=vision_layers,
            mtp=mtp,
        ),
        dtype=dtype,
        encoding=encoding,
        shard_mb=shard_mb,
        seed=seed,
        force=force,
        progress=True,
    )
    typer.echo(summary)


@app.command()
def forward(
    src: Annotated[
        Path, typer.Argument(help="Checkpoint, quantized checkpoint, or single-rank stream dir.")
    ],
    ids: Annotated[
        str | None, typer.Option(help='Token ids, e.g. "1 2 3" (";" separates sequences).')
    ] = None,
    ids_file: Annotated[
        Path | None,
        typer.Option(
            help="safetensors with input_ids (batch x seq) and optionally attention_mask."
        ),
    ] = None,
    pixel_values: Annotated[
        Path | None,
        typer.Option(help="safetensors with pixel_values and image_grid_thw (kimi_k25)."),
    ] = None,
    dtype: ComputeDType = "fp32",
    save_logits: Annotated[
        Path | None, typer.Option(help="Write the logits (batch x seq x vocab, float32) here.")
    ] = None,
    top: Annotated[int, typer.Option(help="Top-K next tokens to print.")] = 5,
    device: Device = "cpu",
    act_quant: Annotated[
        bool,
        typer.Option(
            "--act-quant/--no-act-quant",
            help="Fake-quantize Linear inputs as the checkpoint's quantization_config says; "
            "--no-act-quant runs dequantized weights only (isolates the weight error).",
        ),
    ] = True,
):
    """Run the embedded layer-by-layer runtime on token ids; print the top next tokens."""
    from .runtime.forward_cmd import run_forward

    typer.echo(
        run_forward(
            src=src,
            ids=ids,
            ids_file=ids_file,
            pixel_values=pixel_values,
            dtype=dtype,
            save_logits=save_logits,
            top=top,
            device=device,
            act_quant=act_quant,
        )
    )


@app.command()
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
    from .pipeline import quantize as do_quantize
    from .serving import ServingTarget

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
    if not _leader():  # under torchrun process 0 reports for the job
        return
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


def _leader() -> bool:
    from .parallel import procs

    return procs.current().leader


@app.command()
def shard(
    src: Annotated[
        Path, typer.Argument(help="Checkpoint to reshard (or, with --check, a stream dir).")
    ],
    out: Annotated[Path | None, typer.Argument(help="Output stream directory.")] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree.")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel stages.")] = 1,
    ep: Annotated[
        int, typer.Option(help="Expert-parallel degree inside the tp group (moe_tp = tp/ep).")
    ] = 1,
    compress: Annotated[str, typer.Option(help="Unit compression: none or zstd.")] = "none",
    unit_hash: Annotated[
        str,
        typer.Option(
            help="Unit integrity hash: xxh3-128 (fast to verify on every load) or sha256."
        ),
    ] = "xxh3-128",
    workers: Annotated[
        int | None, typer.Option(help="Units written in parallel (default: CPU count).")
    ] = None,
    pp_layers: PPLayers = None,
    expert_load: ExpertLoad = None,
    redundant_experts: RedundantExperts = 0,
    force: Force = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Verify SRC as a stream dir: exit 0 intact, 1 damaged, 2 not one."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --check: print JSON.")] = False,
):
    """Reshard for TP / PP / EP into the per-rank, layer-ordered MUSA streaming format."""
    from .config_parse import int_list
    from .shard import check as check_stream
    from .shard import shard as do_shard

    if check:
        report = check_stream(src)
        typer.echo(json.dumps(report.to_json(), indent=2) if as_json else str(report))
        raise typer.Exit(report.exit_code)
    if out is None:
        raise typer.BadParameter("OUT is required (or pass --check to verify SRC).")
    res = do_shard(
        src=src,
        out=out,
        tp=tp,
        pp=pp,
        ep=ep,
        compress=compress,
        unit_hash=unit_hash,
        workers=workers,
        force=force,
        pp_layers=int_list(pp_layers, "--pp-layers") if pp_layers else None,
        expert_load=expert_load,
        redundant_experts=redundant_experts,
        progress=True,
    )
    if not _leader():  # under torchrun process 0 reports for the job
        return
    if res.expert_load_from is not None:
        typer.echo(f"expert load: {res.expert_load_from} (routing counts from calibration)")
    typer.echo(
        f"wrote {res.out}: {res.units_written} units ({res.units_skipped} already intact, "
        f"skipped), {res.bytes_written / 2**20:.1f} MiB in {res.seconds:.1f} s; manifest "
        f"{res.manifest}"
    )


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Working directory for the demo.")] = Path("demo-out"),
    family: Annotated[
        str, typer.Option(help="Preset model to rehearse: kimi-k3, kimi-k25, kimi-k2, ...")
    ] = "kimi-k3",
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bar.")] = False,
):
    """Synth a tiny model and convert it with the demo recipe (quantize -> shard -> verify)."""
    from .demo import run_demo

    run_demo(out=out, preset=family, echo=typer.echo, progress=not no_progress)


@app.command()
def verify(
    candidate: Annotated[
        Path,
        typer.Argument(
            help="Stream directory (all ranks), quantized checkpoint, or checkpoint + --layout."
        ),
    ],
    reference: Annotated[
        str | None,
        typer.Option(
            help="Reference checkpoint (default: the original named in the candidate's "
            "provenance), or 'transformers' to run transformers' own model on it."
        ),
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(help="For a checkpoint: cut it on the fly for e.g. tp=4,pp=2,ep=2."),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(help="Inputs: .jsonl (text / input_ids), .txt, or .safetensors (input_ids)."),
    ] = None,
    random: Annotated[int, typer.Option(help="Random sequences when no --data (seeded).")] = 2,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 32,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    pixel_values: Annotated[
        Path | None,
        typer.Option(help="safetensors with pixel_values and image_grid_thw (kimi_k25)."),
    ] = None,
    decode: Annotated[
        int, typer.Option(help="Also decode N tokens greedily with a KV cache and check them.")
    ] = 0,
    kv_cache: Annotated[
        str | None, typer.Option(help="KV cache dtype for --decode: fp8 (e4m3, per-tensor).")
    ] = None,
    mla_cache: Annotated[
        str, typer.Option(help="MLA cache for --decode: expanded or latent.")
    ] = "expanded",
    max_kld: Annotated[float | None, typer.Option(help="Fail above this mean KLD.")] = None,
    min_top1: Annotated[float | None, typer.Option(help="Fail below this top-1 agreement.")] = None,
    max_rel_err: Annotated[
        float | None, typer.Option(help="Fail above this logits max relative error.")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG plot of the report here.")] = None,
    dtype: ComputeDType = "fp32",
    device: Device = "cpu",
    pp_layers: PPLayers = None,
    expert_load: ExpertLoad = None,
    redundant_experts: RedundantExperts = 0,
    resident: Annotated[
        bool,
        typer.Option(
            "--resident",
            help="Keep the candidate's weights in memory (fast --decode of small "
            "models); default streams them layer by layer.",
        ),
    ] = False,
):
    """Run every rank of CANDIDATE as the cluster will and report parity against the
    original: exit 0 pass, 1 fail (first failing metric and layer named), 2 bad input."""
    from .config_parse import int_list
    from .verify.report import render_table
    from .verify.run import run_verify

    rep = run_verify(
        candidate=candidate, reference=reference, layout=layout, data=data, random=random,
        seq_len=seq_len, seed=seed, pixel_values=pixel_values, decode=decode,
        kv_cache=kv_cache, mla_cache=mla_cache, max_kld=max_kld, min_top1=min_top1,
        max_rel_err=max_rel_err, json_path=json_out, plot_path=plot, dtype=dtype,
        device=device, pp_layers=int_list(pp_layers, "--pp-layers") if pp_layers else None,
        expert_load=expert_load, redundant_experts=redundant_experts, resident=resident,
    )  # fmt: skip
    if rep.get("rank", 0) != 0:
        return
    typer.echo(render_table(rep))
    if not rep["passed"]:
        typer.echo(f"FAIL: {rep['failure']}", err=True)
        raise typer.Exit(1)


from .cli_convert import register as _register_convert  # noqa: E402

_register_convert(app)
from .cli_plan import register as _register_plan  # noqa: E402

_register_plan(app)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: K3Error -> one line on stderr, exit 2."""
    try:
        rv = app(args=argv, standalone_mode=False)
    except K3Error as e:
        typer.echo(f"error: {e}", err=True)
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 130
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        return 130
    except Exception as e:  # click usage errors (typer vendors its own click)
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            return 2
        raise
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


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


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """k3convert's own warnings (a transcode's rounded groups, an expert calibration never
    reached, ...) as one ``warning: ...`` line above the progress bar, without the source
    line Python adds; any other warning as Python shows it."""
    if category.__module__.startswith("k3convert"):
        from tqdm import tqdm

        tqdm.write(f"warning: {message}", file=sys.stderr)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def entry() -> None:
    """``k3convert`` / ``python -m k3convert``: :func:`main`, then leave without the
    interpreter's teardown. Every file is closed and every output renamed into place by
    the time main returns; what is left is torch's destructors, about 0.7 s on 2 cores,
    paid by every invocation. Under a tracer or profiler (coverage, cProfile), whose
    results are written at exit, or with K3_NO_FAST_EXIT=1, the exit is the normal one."""
    warnings.showwarning = _show_warning
    code = main()
    monitored = False
    if hasattr(sys, "monitoring"):  # 3.12+: coverage's sys.monitoring core sets no trace
        monitored = any(sys.monitoring.get_tool(i) for i in range(6))
    if sys.gettrace() or sys.getprofile() or monitored or os.environ.get("K3_NO_FAST_EXIT"):
        sys.exit(code)
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say
            stream.flush()
    os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)

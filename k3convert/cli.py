"""The ``k3convert`` command line: thin wrappers over keyword-only library functions.

Every K3Error becomes one line on stderr and exit code 2 (no traceback); anything else
is a bug and keeps its traceback. Commands live in their library modules; this file
only parses options and prints.

The command modules (this one, ``cli_quantize``, ``cli_plan``, ``cli_convert``) import
their jobs inside the command functions: ``k3convert --help`` and a usage error must not
pay for torch (seconds); that start-up laziness is the only reason for those imports.
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
    NoProgress,
    PPLayers,
    RedundantExperts,
    StrictServing,
    examples,
)
from .cli_quantize import quantize
from .errors import K3Error
from .targets import target_help

app = typer.Typer(
    name="k3convert",
    help="Offline conversion of frontier-scale MoE checkpoints: inspect, synth, quantize, "
    "shard, verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: paragraphs rewrapped to the terminal (rich mode keeps the
    # docstrings' line breaks mid-sentence) and flags without a '<bool>' type column
    rich_markup_mode=None,
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


@app.command(epilog=examples("inspect"))
def inspect(
    path: Annotated[
        Path,
        typer.Argument(
            help="Model directory, a config.json alone, or a preset (kimi-k3, kimi-k2, ...)."
        ),
    ],
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


@app.command(epilog=examples("synth"))
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
    no_progress: NoProgress = False,
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
        progress=not no_progress,
    )
    typer.echo(summary)


@app.command(epilog=examples("forward"))
def forward(
    src: Annotated[
        Path,
        typer.Argument(
            help="Checkpoint, quantized checkpoint, or stream dir (every rank run here)."
        ),
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


app.command(epilog=examples("quantize"))(quantize)


def _leader() -> bool:
    from .parallel import procs

    return procs.current().leader


@app.command(epilog=examples("shard"))
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
    no_progress: NoProgress = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Verify SRC as a stream dir: exit 0 intact, 1 damaged, 2 not one."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --check: print JSON.")] = False,
    target: Annotated[str, typer.Option(help=target_help())] = "stream",
    serving_device: Annotated[
        str | None,
        typer.Option(
            help="With --target vllm: the device class vLLM will run OUT on, cuda or cpu, "
            "checked before writing (a warning per problem). Default: this machine's (cuda "
            "when torch sees a GPU, else cpu)."
        ),
    ] = None,
    strict_serving: StrictServing = False,
):
    """Reshard for TP / PP / EP into the per-rank, layer-ordered MUSA streaming format.

    With --target vllm: the per-rank files vLLM loads with load_format='sharded_state'."""
    from . import targets
    from .config_parse import int_list
    from .shard import check as check_stream
    from .shard import shard as do_shard

    chosen = targets.get(target)
    written = targets.written_by(src) if check else None
    if written is not None and written.check_fn is not None:  # (a stream reports below)
        typer.echo(written.check(src))
        return
    if chosen.shard_fn is not None and not check:  # an engine's files: the target's job
        from .serving import ServingTarget, resolve_device

        device = resolve_device(serving_device, engine_output=True)  # default: this machine's
        serving = ServingTarget(tp=tp, moe_ep=ep, device=device, strict=strict_serving)
        _shard_engine(chosen, src, out, tp, pp, ep, compress, pp_layers, expert_load,
                      redundant_experts, force, not no_progress, serving)  # fmt: skip
        return
    if serving_device is not None or strict_serving:
        raise typer.BadParameter(
            "--serving-device and --strict-serving check what vLLM will run: they go with "
            "--target vllm (quantize and convert take them too)."
        )
    if check:
        report = check_stream(src)
        if report.status == "not_stream" and not as_json:  # one error line, as elsewhere
            from .errors import ConfigError

            if (src / "config.json").is_file():
                raise ConfigError(
                    f"{src}: a checkpoint, not a stream (no manifest.json); `k3convert "
                    f"inspect {src}` describes it, `k3convert shard {src} OUT` cuts a stream "
                    f"from it."
                )
            raise ConfigError(report.problems[0])
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
        progress=not no_progress,
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
    if res.replicated_bytes and res.bytes_written > res.source_bytes:
        from .units import human_bytes

        typer.echo(
            f"  larger than the source ({human_bytes(res.source_bytes)}): "
            f"{human_bytes(res.replicated_bytes)} are copies held on more than one rank "
            f"(tensors every rank needs whole, such as norms, routers and a vision tower), "
            f"the rest unit headers and alignment"
        )


def _shard_engine(target, src, out, tp, pp, ep, compress, pp_layers, expert_load, redundant,
                  force, progress, serving) -> None:  # fmt: skip
    """``shard --target T`` for an engine's files: the stream's placement flags refused
    (the engine places layers and experts itself), then the target's job."""
    if out is None:
        raise typer.BadParameter("OUT is required.")
    given = [f for f, v in (("--compress", compress != "none"),
             ("--pp-layers", pp_layers), ("--expert-load", expert_load),
             ("--redundant-experts", redundant)) if v]  # fmt: skip
    if given:
        raise typer.BadParameter(
            f"{', '.join(given)} apply to the stream target; --target {target.name} takes "
            f"--tp, --pp and --ep (the engine places layers and experts itself)."
        )
    from .serving import vllm_check

    lead = _leader()  # under torchrun process 0 speaks for the job
    check = vllm_check(serving, (lambda line: typer.echo(line, err=True)) if lead else None)
    line = target.shard(src, out, tp=tp, pp=pp, ep=ep, force=force, progress=progress and lead,
                        before_write=check)  # fmt: skip
    if lead:
        typer.echo(line)


@app.command(epilog=examples("demo"))
def demo(
    out: Annotated[Path, typer.Option(help="Working directory for the demo.")] = Path("demo-out"),
    family: Annotated[
        str, typer.Option(help="Preset model to rehearse: kimi-k3, kimi-k25, kimi-k2, ...")
    ] = "kimi-k3",
    no_progress: NoProgress = False,
):
    """Synth a tiny model and convert it with the demo recipe (quantize -> shard -> verify)."""
    from .demo import run_demo

    run_demo(out=out, preset=family, echo=typer.echo, progress=not no_progress)


@app.command(epilog=examples("verify"))
def verify(
    candidate: Annotated[
        Path,
        typer.Argument(
            help="Stream directory (all ranks), quantized checkpoint, checkpoint + --layout, "
            "or a vLLM sharded_state directory (shard --target vllm)."
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
    no_progress: NoProgress = False,
):
    """Run every rank of CANDIDATE as the cluster will and report parity.

    Compares against the original: exit 0 pass, 1 fail (first failing metric and layer
    named), 2 bad input."""
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
        progress=not no_progress,
    )  # fmt: skip
    if rep.get("rank", 0) != 0:
        return
    typer.echo(render_table(rep))
    for what, path in (("report", json_out), ("plot", plot)):
        if path is not None:
            typer.echo(f"{what} written to {path}")
    if not rep["passed"]:
        # the table's RESULT line says it on a terminal; stderr gets it too when stdout
        # goes elsewhere (a file, a pipe), so a log of stderr alone still holds the verdict
        if not (sys.stdout.isatty() and sys.stderr.isatty()):
            typer.echo(f"FAIL: {rep['failure']}", err=True)
        raise typer.Exit(1)


from .cli_convert import register as _register_convert  # noqa: E402

_register_convert(app)
from .cli_plan import register as _register_plan  # noqa: E402

_register_plan(app)


#: what an interrupted command says: its outputs are staged or journaled, so a rerun
#: picks up where it stopped and nothing half-written is taken for a result
INTERRUPTED = (
    "interrupted: no partial output is taken for a result; rerun the same command "
    "(shard, convert and calibration resume where they stopped)."
)


def _interrupted() -> None:
    """One line on stderr, on a line of its own (a progress bar may hold the cursor)."""
    sys.stderr.write("\n" + INTERRUPTED + "\n")
    sys.stderr.flush()


def command():
    """The click command of ``app``, its arguments named in capitals (``SRC OUT``, as the
    docstrings write them; typer would print ``{src} {out}``)."""
    root = typer.main.get_command(app)
    todo = [root]
    while todo:
        cmd = todo.pop()
        todo.extend(getattr(cmd, "commands", {}).values())
        for p in cmd.params:
            if p.param_type_name == "argument" and p.metavar is None:
                p.metavar = p.name.upper()
    return root


def main(argv: list[str] | None = None) -> int:
    """Console entry point: K3Error -> one line on stderr, exit 2."""
    try:
        rv = command()(args=argv, standalone_mode=False, prog_name="k3convert")
    except K3Error as e:
        typer.echo(f"error: {e}", err=True)
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:  # typer's answer to an end of input (EOF) inside a command
        typer.echo("aborted: unexpected end of input.", err=True)
        return 130
    except KeyboardInterrupt:  # Ctrl-C outside typer's own handling (which returns 130)
        _interrupted()
        return 130
    except Exception as e:  # click usage errors (typer vendors its own click)
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            # one line, as every other error (click's own is usage, hint and message)
            ctx = getattr(e, "ctx", None)
            msg = " ".join(e.format_message().split())
            msg += "" if msg.endswith((".", "?")) else "."
            what = "commands" if hasattr(getattr(ctx, "command", None), "commands") else "options"
            where = f" `{ctx.command_path} --help` lists its {what}." if ctx else ""
            typer.echo(f"error: {msg}{where}", err=True)
            return 2
        raise
    if rv == 130:  # typer answers Ctrl-C with exit code 130 and no word (no command does)
        _interrupted()
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


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

"""``k3convert plan``: the command line of :mod:`k3convert.memplan` (registered by cli.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from .cli_options import ExpertLoad, PPLayers, RedundantExperts, StrictServing, examples
from .errors import ConfigError, OutputError

# -- plan's options (typer reads help and flag names from these) --
Src = Annotated[
    str | None,
    typer.Argument(
        help="config.json, a model directory (its stored tensors when it has "
        "weights) or a preset (kimi-k3, kimi-k2, kimi-k25, ...); optional with a "
        "--recipe whose source.path names the model."
    ),
]
Recipe = Annotated[
    Path | None,
    typer.Option(help="Recipe YAML: its layout and quantize sections are defaults."),
]
Tp = Annotated[int | None, typer.Option(help="Tensor-parallel degree (default 1).")]
Pp = Annotated[int | None, typer.Option(help="Pipeline stages (default 1).")]
Ep = Annotated[int | None, typer.Option(help="Expert-parallel degree, dividing tp (default 1).")]
Scheme = Annotated[
    str | None,
    typer.Option(help="Plan the weights as quantize --scheme NAME would write them."),
]
Context = Annotated[
    str | None,
    typer.Option(
        help="Tokens per sequence: 131072, 128k, 1M (k = 1024, M = 1,048,576); "
        "default: the recipe's target.context, else 131072."
    ),
]
Batch = Annotated[
    int | None,
    typer.Option(help="Sequences served at once (default: the recipe's target, else 1)."),
]
KvDtype = Annotated[str, typer.Option(help="KV cache dtype: bf16, fp8, fp16 or fp32.")]
DeviceMem = Annotated[
    str | None,
    typer.Option(help="Memory per device: 141GB (10^9), 140GiB (2^30), 1.5TB, ..."),
]
Device = Annotated[
    str | None,
    typer.Option(
        help="A device's published memory: a100, h100, h200, b200, mi300x, mi325x, "
        "mtt-s5000 (default: the recipe's target.device)."
    ),
]
PrefillChunk = Annotated[
    str, typer.Option(help="Tokens per prefill chunk, for the activation estimate.")
]
Top = Annotated[int, typer.Option(help="Layouts that fit to list.")]
JsonOut = Annotated[
    Path | None, typer.Option("--json", help="Write the plan as JSON (bytes) here.")
]
Plot = Annotated[
    Path | None, typer.Option(help="Write a PNG of per-rank memory here (matplotlib).")
]
FailIfOver = Annotated[
    bool,
    typer.Option("--fail-if-over", help="Exit 1 when a rank is over the budget."),
]
ServingDevice = Annotated[
    str | None,
    typer.Option(
        help="Check the planned scheme against vLLM on cuda or cpu (default: the "
        "recipe's output.serving_device, else cuda)."
    ),
]


class _StageBar:
    """plan's progress on stderr, one line for its stages (a terminal only; it clears
    itself when the plan is printed)."""

    def __init__(self):
        from tqdm import tqdm

        from .memplan.plan import STAGES

        self.stages = STAGES
        self.bar = tqdm(total=len(STAGES), desc="plan", leave=False, disable=None,
                        bar_format="{desc} [{n}/{total}, {elapsed}]")  # fmt: skip

    def stage(self, name: str) -> None:
        self.bar.n = self.stages.index(name)  # stages a plan does not need are skipped
        self.bar.set_description_str(f"plan: {name}")

    def close(self) -> None:
        self.bar.close()


def register(app: typer.Typer) -> None:
    """Add the ``plan`` command to ``app``."""

    @app.command("plan", epilog=examples("plan"))
    def plan(
        src: Src = None,
        recipe: Recipe = None,
        tp: Tp = None,
        pp: Pp = None,
        ep: Ep = None,
        redundant_experts: RedundantExperts = None,
        pp_layers: PPLayers = None,
        expert_load: ExpertLoad = None,
        scheme: Scheme = None,
        context: Context = None,
        batch: Batch = None,
        kv_dtype: KvDtype = "bf16",
        device_mem: DeviceMem = None,
        device: Device = None,
        prefill_chunk: PrefillChunk = "8192",
        top: Top = 5,
        json_out: JsonOut = None,
        plot: Plot = None,
        fail_if_over: FailIfOver = False,
        serving_device: ServingDevice = None,
        strict_serving: StrictServing = False,
    ):
        """Memory per rank for a layout and a workload, and the layouts that fit.

        Weights (as shard writes them), KV cache, KDA state and activations (an estimate)
        against a device's memory; lists the smallest layouts that fit. Exit 0 (over-budget
        ranks are flagged), 1 with --fail-if-over when one is over, 2 bad input."""
        from .config_parse import int_list
        from .memplan import plan_memory, plot_plan
        from .recipe import load_recipe

        if fail_if_over and device_mem is None and device is None and recipe is None:
            raise ConfigError("--fail-if-over needs a budget: give --device-mem or --device.")
        if plot is not None:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:
                raise ConfigError(
                    "--plot needs matplotlib, which is not installed; `pip install "
                    "matplotlib` (or the project's test extra), or leave --plot out."
                )
        for opt, p in (("--json", json_out), ("--plot", plot)):
            if p is not None and not Path(p).parent.is_dir():
                raise OutputError(f"{opt} {p}: the directory {Path(p).parent} does not exist.")
        layers = int_list(pp_layers, "--pp-layers") if pp_layers else None
        bar = _StageBar()
        try:
            res = plan_memory(
                src=src,
                recipe=load_recipe(recipe) if recipe is not None else None,
                tp=tp,
                pp=pp,
                ep=ep,
                redundant_experts=redundant_experts,
                pp_layers=layers,
                expert_load=expert_load,
                scheme=scheme,
                context=context,
                batch=batch,
                kv_dtype=kv_dtype,
                prefill_chunk=prefill_chunk,
                device_mem=device_mem,
                device=device,
                top=top,
                serving_device=serving_device,
                strict_serving=strict_serving,
                on_stage=bar.stage,
            )
        finally:
            bar.close()
        if fail_if_over and res.budget is None:
            raise ConfigError(
                "--fail-if-over needs a budget: give --device-mem or --device (the recipe "
                "names no target.device)."
            )
        typer.echo(res.table())
        if json_out is not None:
            tmp = Path(f"{json_out}.tmp-{os.getpid()}")
            try:
                tmp.write_text(json.dumps(res.to_json(), indent=2) + "\n")
                os.replace(tmp, json_out)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise OutputError(f"--json {json_out}: cannot write ({e.strerror or e}).") from e
            typer.echo(f"plan written to {json_out}")
        if plot is not None:
            typer.echo(f"chart written to {plot_plan(res, plot)}")
        if fail_if_over and res.over:
            typer.echo(
                f"FAIL: {len(res.over)} rank(s) over the {res.device} budget "
                f"(ranks {res.over[:8]}{'...' if len(res.over) > 8 else ''})",
                err=True,
            )
            raise typer.Exit(1)

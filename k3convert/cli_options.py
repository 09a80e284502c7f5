"""Options several commands take, declared once: the parallel layout's placement options,
the serving check, the compute device and dtype, ``--force``. A command's parameter is
typed with the alias and keeps its own default (``--redundant-experts`` defaults to 0 for
``shard`` and to the recipe's for ``plan``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ComputeDType = Annotated[str, typer.Option("--dtype", help="Compute dtype: fp32 or bf16.")]
Device = Annotated[str, typer.Option("--device", help="torch device: cpu, cuda, musa, ...")]
PPLayers = Annotated[
    str | None,
    typer.Option("--pp-layers", help="Explicit layers per pipeline stage, e.g. '20,21,20'."),
]
ExpertLoad = Annotated[
    Path | None,
    typer.Option(
        "--expert-load",
        help="JSON: layer -> tokens per expert (a calibrated quantize's routing_counts.json), "
        "to balance the experts over the EP ranks.",
    ),
]
RedundantExperts = Annotated[
    int | None,
    typer.Option(
        "--redundant-experts",
        help="Extra replicas of the hottest experts per MoE layer (EPLB); without "
        "--expert-load, the source's routing_counts.json is used when present.",
    ),
]
StrictServing = Annotated[
    bool,
    typer.Option(
        "--strict-serving",
        help="Refuse (exit 2, before any work) when vLLM would not load the result on the "
        "serving device at its tensor-parallel degree, instead of warning.",
    ),
]
NoProgress = Annotated[
    bool, typer.Option("--no-progress", help="No progress bar (keeps a log file clean).")
]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing (complete) OUT.")]


# -- examples (each command's --help ends with its own; tests check every flag exists) --
EXAMPLES: dict[str, tuple[str, ...]] = {
    "inspect": (
        "k3convert inspect /models/Kimi-K3",
        "k3convert inspect /tmp/k3-tiny --json",
    ),
    "synth": (
        "k3convert synth kimi-k3 /tmp/k3-tiny --tiny",
        "k3convert synth llama3-8b /tmp/llama-tiny --tiny --layers 2",
    ),
    "forward": ('k3convert forward /tmp/k3-tiny --ids "1 2 3"',),
    "quantize": (
        "k3convert quantize /models/Kimi-K2 /out/k2-w4a16 --scheme w4a16 --calibrate",
        "k3convert quantize /models/Kimi-K3 /out/k3-nvfp4 --recipe kimi-k3-nvfp4-experts",
        "k3convert quantize /models/llama /out/llama-fp8 --scheme fp8-block --dry-run",
        "k3convert quantize --list-schemes",
    ),
    "shard": (
        "k3convert shard /tmp/k3-tiny /tmp/k3-tp4 --tp 4 --ep 4",
        "k3convert shard /tmp/k3-tp4 --check",
        "k3convert shard /models/llama-w8a8 /models/llama-w8a8-vllm-tp2 --target vllm --tp 2",
    ),
    "demo": ("k3convert demo", "k3convert demo --family kimi-k2 --out /tmp/demo-k2"),
    "verify": (
        "k3convert verify /tmp/k3-tp4 --decode 4",
        "k3convert verify /out/k2-w4a16 --layout tp=8,ep=8 --reference /models/Kimi-K2",
    ),
    "convert": (
        "k3convert convert /models/Kimi-K3 /out/k3-b200 --recipe kimi-k3-nvfp4-experts",
        "k3convert convert /tmp/k3-tiny /tmp/k3-demo --recipe demo --set output.compression=none",
    ),
    "plan": (
        "k3convert plan kimi-k3 --recipe kimi-k3-day0",
        "k3convert plan /tmp/k3-tiny --tp 4 --ep 4 --device h200",
    ),
    "recipe check": ("k3convert recipe check kimi-k3-day0 --model /models/Kimi-K3",),
    "recipe show": ("k3convert recipe show demo",),
    "recipe list": ("k3convert recipe list",),
}


def examples(command: str) -> str:
    """The --help epilog of ``command``: its examples, one per paragraph."""
    return "Examples:\n\n" + "\n\n".join(f"  {line}" for line in EXAMPLES[command])

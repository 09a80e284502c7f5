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
Force = Annotated[bool, typer.Option("--force", help="Replace an existing (complete) OUT.")]

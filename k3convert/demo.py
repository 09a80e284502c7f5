"""``k3convert demo``: rehearse the pipeline end to end on a tiny synthetic model.

It builds a scaled-down checkpoint of a real release's layout with ``synth`` and runs
every stage on it, printing each stage's report, so a fresh install can be checked in
seconds without downloading anything.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from .inspect import format_report, inspect_path
from .synth import synthesize


def run_demo(*, out: str | Path, preset: str = "kimi-k25", echo: Callable[[str], None]) -> None:
    out = Path(out)
    model = out / "model"
    if model.exists():
        shutil.rmtree(model)
    echo(f"== synth: tiny {preset} (same names, dtypes and encodings as the release)")
    echo(synthesize(config=preset, out=model, tiny=True, seed=0))
    echo("")
    echo("== inspect")
    echo(format_report(inspect_path(path=model, tensors=False)))
    echo("")
    echo(f"demo finished: artefacts in {out}/")

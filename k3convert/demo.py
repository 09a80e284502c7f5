"""``k3convert demo``: rehearse the pipeline end to end on a tiny synthetic model.

It builds a scaled-down checkpoint of a real release's layout with ``synth`` and runs
every stage on it, printing each stage's report, so a fresh install can be checked in
seconds without downloading anything.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from .errors import K3Error
from .inspect import format_report, inspect_path
from .quant import quantize
from .recipe import parse_recipe
from .shard import check, shard
from .synth import synthesize

#: the recipe of recipes/kimi-k2-int4-experts.yaml, inline so an installed wheel has it
DEMO_RECIPE = {
    "description": "int4 routed experts, FP8-block attention, rest kept",
    "quantize": {
        "rules": [
            {"roles": ["experts"], "scheme": "w4a16", "options": {"group_size": 32}},
            {"roles": ["attention"], "scheme": "fp8-block"},
        ],
        "default_keep": True,
    },
}


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
    quantized = out / "model-quantized"
    echo("== quantize: routed experts int4 g32 (w4a16), attention FP8 128x128 blocks")
    q = quantize(
        src=model,
        out=quantized,
        recipe=parse_recipe(DEMO_RECIPE, "demo"),
        force=True,
        progress=False,
    )
    echo(q.summary())
    echo("")
    stream = out / "stream-tp2-pp2-ep2"
    echo("== shard: the quantized checkpoint, tp=2 pp=2 ep=2, into the MUSA streaming format")
    res = shard(
        src=quantized,
        out=stream,
        tp=2,
        pp=2,
        ep=2,
        compress="zstd",
        force=True,
        progress=False,
    )
    echo(
        f"wrote {stream}: {res.units_written} units, {res.bytes_written / 2**20:.2f} MiB "
        f"(zstd) in {res.seconds:.2f} s"
    )
    echo("")
    echo("== shard --check")
    report = check(stream)
    echo(str(report))
    if not report.ok:
        raise K3Error(f"demo: the stream written to {stream} failed its own check.")
    echo("")
    echo(f"demo finished: artefacts in {out}/")

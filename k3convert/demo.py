"""``k3convert demo``: rehearse the pipeline end to end on a tiny synthetic model.

It builds a scaled-down checkpoint of a real release's layout with ``synth`` and runs
every stage on it, printing each stage's report, so a fresh install can be checked in
seconds without downloading anything.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from .errors import K3Error
from .inspect import format_report, inspect_path
from .quant import quantize
from .recipe import parse_recipe
from .runtime import Runtime
from .shard import check, shard
from .sources import open_source
from .synth import synthesize
from .verify.report import render_table
from .verify.run import run_verify

#: recipes/kimi-k2-int4-experts.yaml, inline so an installed wheel has it (attention in
#: fp8-dynamic instead of fp8-block: the tiny model's widths are below 128)
DEMO_RECIPE = {
    "description": "int4 routed experts, FP8 attention, rest kept",
    "quantize": {
        "rules": [
            {"roles": ["experts"], "scheme": "w4a16", "options": {"group_size": 32}},
            # per-token FP8: the tiny demo's widths (64) are below fp8-block's 128 groups
            {"roles": ["attention"], "scheme": "fp8-dynamic"},
        ],
        "default_keep": True,
    },
}


def run_demo(*, out: str | Path, preset: str = "kimi-k25", echo: Callable[[str], None]) -> None:
    """synth -> inspect -> quantize -> shard -> check -> forward -> verify on a tiny model."""
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
    echo("== quantize: routed experts int4 g32 (w4a16), attention FP8 (per-token activations)")
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
    single = out / "stream-tp1"
    echo("== shard: tp=1 (one rank) so the runtime can stream it layer by layer")
    shard(src=quantized, out=single, force=True, progress=False)
    echo("")
    echo("== forward: embedded runtime, layer by layer, on the same 2 sequences")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35], [27, 18, 28, 18, 28, 45]])
    logits = {}
    for label, src in (("original", model), ("quantized", quantized), ("stream tp1", single)):
        with Runtime(open_source(src)) as rt:
            logits[label] = rt.forward(ids)
    ref = logits["original"]
    scale = ref.abs().max().item()
    echo(f"{'source':<12} {'max|dlogit|/max|logit|':>24} {'argmax agree':>13}")
    for label, lg in logits.items():
        rel = (lg - ref).abs().max().item() / scale
        agree = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
        echo(f"{label:<12} {rel:>24.2e} {agree:>12.0%}")
    if not torch.equal(logits["stream tp1"], logits["quantized"]):
        raise K3Error("demo: the stream's logits differ from the checkpoint it was made from.")
    echo("stream tp1 == quantized checkpoint: bit-identical logits")
    echo("")
    echo("== verify: the tp=2 pp=2 ep=2 stream, every rank simulated, vs the original")
    rep = run_verify(candidate=stream, seq_len=24, decode=4, progress=False)
    echo(render_table(rep))
    if not rep["passed"]:
        raise K3Error(f"demo: verify failed on {stream}: {rep['failure']}")
    echo("")
    echo(f"demo finished: artefacts in {out}/")

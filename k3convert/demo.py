"""``k3convert demo``: the whole pipeline, end to end, on a tiny synthetic Kimi K3.

It builds a scaled-down checkpoint of the release's layout with ``synth`` (same tensor
names, dtypes and encodings: MXFP4 routed experts, KDA + MLA attention, MoonViT3d), then
runs ``convert`` with the ``demo`` preset recipe (``recipes/demo.yaml``: FP8 attention
and MLPs, experts as released, tp2 pp2 ep2) - quantize, shard and verify in one streaming
pass - and prints the summary. A fresh install is checked in seconds, offline.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .errors import K3Error, OutputError
from .pipeline.convert import convert
from .synth import synthesize

DEMO_PRESET = "demo"
#: in --out: the demo's own earlier outputs may be replaced
MARKER = ".k3convert-demo"


def run_demo(
    *, out: str | Path, preset: str = "kimi-k3", echo: Callable[[str], None], progress: bool = True
):
    """synth (tiny ``preset``) -> convert with the demo recipe; returns the result. Every
    path it prints is absolute (``out`` resolved once), the first line says where."""
    out = Path(out).resolve()
    model = out / "model"
    marker = out / MARKER
    if model.exists() and not marker.is_file():
        raise OutputError(
            f"{model}: exists and was not written by `k3convert demo` (no {marker}); "
            f"choose another --out directory."
        )
    echo(f"demo: writing into {out}/ (model/, stream/, report.html; --out to change)")
    echo("")
    echo(f"== synth: tiny {preset} (same names, dtypes and encodings as the release)")
    summary = synthesize(config=preset, out=model, tiny=True, seed=0, force=model.exists())
    marker.write_text("k3convert demo: model/, stream/, report.html are replaced on rerun\n")
    echo(summary)
    echo("")
    echo(f"== convert: recipe '{DEMO_PRESET}' (k3convert recipe show {DEMO_PRESET})")
    # the demo recipe is written for Kimi K3; its rules name roles every family has
    res = convert(src=model, out=out / "stream", recipe=DEMO_PRESET, force=True,
                  overrides=["source.model_type=null"], progress=progress,
                  report_html=out / "report.html")  # fmt: skip
    echo(res.summary())
    echo(f"  html        {out / 'report.html'}")
    if not res.passed:
        raise K3Error(f"demo: verify failed on {out / 'stream'}: {res.report['verify']}")
    echo("")
    echo(f"demo finished: artefacts in {out}/")
    return res

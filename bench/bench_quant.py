"""Quantization throughput and peak memory on a multi-GB synthetic checkpoint.

Writes a plain bf16 llama3-8b-shaped checkpoint (scaled by --layers / --hidden /
--intermediate) and, each in its own process so peak RSS is per stage:

- copy:       read every tensor (mmap) and write the same bytes with SafetensorsWriter
              (the I/O floor of a streaming rewrite);
- fp8-block:  quantize --scheme fp8-block (128x128 blocks);
- w4a16:      quantize --scheme w4a16 (RTN, group 128, packed int4).

Prints GB/s of source bytes read and peak RSS next to the checkpoint size. Goal on 2
cores: fp8-block >= 0.5x the copy, and peak RSS bounded by a few tensors (independent
of checkpoint size). Page cache is warm for all stages (the source is read once before).

    python bench/bench_quant.py [--gb 2] [--workers 2] [--keep-files] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def stage_copy(src: Path, out: Path) -> dict:
    from k3convert.checkpoint import open_checkpoint
    from k3convert.checkpoint.safetensors_io import SafetensorsWriter

    t0 = time.perf_counter()
    ck = open_checkpoint(src)
    out.mkdir(parents=True)
    total = 0
    entries = []
    for n in ck.names():
        for p in ck.meta(n).parts.values():
            entries.append((p.name, p.dtype, p.shape))
    with SafetensorsWriter(out / "model-00001-of-00001.safetensors", entries) as w:
        for n in ck.names():
            for p in ck.meta(n).parts.values():
                t = ck._load_part(p)
                w.write(p.name, t)
                total += p.nbytes
                del t
    return {"seconds": time.perf_counter() - t0, "bytes": total, "rss_mb": _rss_mb()}


def stage_quantize(src: Path, out: Path, scheme: str, workers: int) -> dict:
    from k3convert.quant import quantize

    t0 = time.perf_counter()
    res = quantize(src=src, out=out, scheme=scheme, workers=workers, progress=False)
    before, after = res.plan.totals()
    big = max(r.src_bytes for r in res.plan.rows)
    return {
        "seconds": time.perf_counter() - t0,
        "bytes": before,
        "out_bytes": after,
        "largest_tensor": big,
        "rss_mb": _rss_mb(),
    }


def _child(args: list[str]) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, check=False
    )
    if r.returncode:
        sys.stderr.write(r.stderr)
        raise SystemExit(f"stage {args} failed")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="approximate checkpoint size")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--keep-files", action="store_true")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.stage == "copy":
        print(json.dumps(stage_copy(a.src, a.out)))
        return
    if a.stage == "quantize":
        print(json.dumps(stage_quantize(a.src, a.out, a.scheme, a.workers)))
        return

    from k3convert.synth import synthesize

    root = a.dir or Path(tempfile.mkdtemp(prefix="bench_quant_"))
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    # llama3-8b shapes scaled: one layer at hidden 4096 / intermediate 14336 is ~0.44 GB
    # bf16; vocab kept small so the (kept) embeddings do not dominate.
    layers = max(1, round(a.gb / 0.436))
    if not src.exists():
        t0 = time.perf_counter()
        synthesize(
            config="llama3-8b",
            out=src,
            overrides=dict(layers=layers, vocab=32768),
            encoding="plain",
            shard_mb=1024,
        )
        print(f"synthesized {src} in {time.perf_counter() - t0:.1f} s")
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    for p in src.glob("*.safetensors"):  # warm the page cache for every stage alike
        with open(p, "rb") as fh:
            while fh.read(64 << 20):
                pass

    rows = []
    for name, args in (
        ("copy (read+write)", ["--stage", "copy"]),
        ("fp8-block", ["--stage", "quantize", "--scheme", "fp8-block"]),
        ("w4a16 (RTN g128)", ["--stage", "quantize", "--scheme", "w4a16"]),
    ):
        out = root / f"out_{name.split()[0]}"
        shutil.rmtree(out, ignore_errors=True)
        r = _child([*args, "--src", str(src), "--out", str(out), "--workers", str(a.workers)])
        shutil.rmtree(out, ignore_errors=True)
        rows.append((name, r))

    copy_gbs = rows[0][1]["bytes"] / rows[0][1]["seconds"] / 1e9
    print(
        f"\ncheckpoint: {size / 2**30:.2f} GiB bf16, {layers} llama3-8b layers; workers={a.workers}"
    )
    hdr = f"{'stage':<20} {'seconds':>8} {'GB/s':>7} {'x copy':>7} {'out GiB':>8} {'peak RSS':>10}"
    print(hdr)
    print("-" * len(hdr))
    for name, r in rows:
        gbs = r["bytes"] / r["seconds"] / 1e9
        outb = r.get("out_bytes", r["bytes"]) / 2**30
        print(
            f"{name:<20} {r['seconds']:>8.2f} {gbs:>7.2f} {gbs / copy_gbs:>7.2f} "
            f"{outb:>8.2f} {r['rss_mb']:>7.0f} MiB"
        )
    big = rows[1][1]["largest_tensor"] / 2**20
    print(f"largest source tensor: {big:.0f} MiB; checkpoint: {size / 2**20:.0f} MiB")
    if not a.keep_files and a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

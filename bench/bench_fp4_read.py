"""Read throughput of an MXFP4-expert checkpoint, dequantized to bf16 one expert at a time,
next to reading a bf16 checkpoint of the same logical size with safetensors' ``safe_open``.

Two synthetic checkpoints are written into a temporary directory (default: 64 experts x
gate / up / down of [1024, 1536] / [1536, 1024], 302 M values: 604 MB as bf16, 160 MB as
MXFP4): the MXFP4 one in the Kimi K3 release's layout (``weight_packed`` uint8 [out,
in/2] + ``weight_scale`` uint8 [out, in/32], random E2M1 bytes and E8M0 exponents
around 2**-7), the bf16 one with the same names and logical shapes. Stages, each run in
a fresh process (``bench/_harness.measure``: peak RSS is the command's own, from
``os.wait4``), interleaved (A B C A B C ...), median of ``--repeats`` (3):

  k3convert mxfp4 -> bf16   open_checkpoint; get(name, torch.bfloat16) per expert; sum; drop
  k3convert bf16            open_checkpoint; get(name) per tensor (a mapped view); sum; drop
  safe_open bf16            safe_open(f); get_tensor(name) per tensor; sum; drop

The page cache is warm (every file read once first). "read s" is the time the worker
measures around its loop (no interpreter start, no imports); "stored GB/s" divides the
bytes stored on disk by it, "bf16 GB/s" the bf16 bytes handed out (the same for all
three). Usage: python bench/bench_fp4_read.py [--experts 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _harness import PY, STARTUP, measure, warm

_WORKER = """
import json, sys, time, torch
from pathlib import Path
root, how = Path(sys.argv[1]), sys.argv[2]
torch.zeros(4).sum()
t0 = time.perf_counter()
n = 0
if how == "safe_open":
    from safetensors import safe_open
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                t.sum()
                n += t.numel()
                del t
else:
    from k3convert.checkpoint import open_checkpoint
    ck = open_checkpoint(root)
    for k in ck.names():
        t = ck.get(k, torch.bfloat16)
        t.sum()
        n += t.numel()
        del t
print(json.dumps({"read_s": time.perf_counter() - t0, "values": n}))
"""


def build(root: Path, experts: int, hidden: int, moe: int) -> dict:
    """The two checkpoints (written by a child process: its RSS stays out of the runs)."""
    code = f"""
import json, torch
from pathlib import Path
from safetensors.torch import save_file
root = Path({str(root)!r})
g = torch.Generator().manual_seed(0)
fp4, bf = {{}}, {{}}
def flush(i):
    if fp4:
        save_file(fp4, root / "mxfp4" / f"model-{{i:05d}}.safetensors", metadata={{"format": "pt"}})
        save_file(bf, root / "bf16" / f"model-{{i:05d}}.safetensors", metadata={{"format": "pt"}})
        fp4.clear(); bf.clear()
(root / "mxfp4").mkdir(); (root / "bf16").mkdir()
for e in range({experts}):
    for w, (o, i) in (("w1", ({moe}, {hidden})), ("w3", ({moe}, {hidden})),
                      ("w2", ({hidden}, {moe}))):
        base = f"model.layers.0.experts.{{e}}.{{w}}"
        fp4[base + ".weight_packed"] = torch.randint(0, 256, (o, i // 2), generator=g,
                                                     dtype=torch.uint8)
        fp4[base + ".weight_scale"] = torch.randint(117, 124, (o, i // 32), generator=g
                                                    ).to(torch.uint8)
        bf[base + ".weight"] = (torch.randn(o, i, generator=g) * 0.02).bfloat16()
    if (e + 1) % 16 == 0:
        flush(e // 16)
flush({experts})
size = lambda d: sum(p.stat().st_size for p in (root / d).glob("*.safetensors"))
print(json.dumps({{"mxfp4": size("mxfp4"), "bf16": size("bf16"),
                  "values": {experts} * 3 * {hidden} * {moe}}}))
"""
    _, _, out, _ = measure([PY, "-c", code])
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--moe", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="k3fp4_"))
    try:
        info = build(tmp, args.experts, args.hidden, args.moe)
        print(
            f"{info['values'] / 1e6:.0f} M values: mxfp4 {info['mxfp4'] / 1e6:.0f} MB, "
            f"bf16 {info['bf16'] / 1e6:.0f} MB, at {tmp}",
            flush=True,
        )
        stages = [
            ("k3convert mxfp4 -> bf16", tmp / "mxfp4", "k3convert", info["mxfp4"]),
            ("k3convert bf16", tmp / "bf16", "k3convert", info["bf16"]),
            ("safe_open bf16", tmp / "bf16", "safe_open", info["bf16"]),
        ]
        warm(p for d in ("mxfp4", "bf16") for p in (tmp / d).glob("*.safetensors"))
        _, floor, _, _ = measure(STARTUP)
        runs: dict[str, list[tuple[float, float]]] = {s[0]: [] for s in stages}
        for r in range(args.repeats):
            for name, root, how, _ in stages:
                _, rss, out, _ = measure([PY, "-c", _WORKER, str(root), how])
                res = json.loads(out.strip().splitlines()[-1])
                assert res["values"] == info["values"], (name, res)
                runs[name].append((res["read_s"], rss))
                print(f"  round {r + 1}/{args.repeats}  {name:<24} {res['read_s']:7.3f} s "
                      f"{rss:6.0f} MiB", flush=True)  # fmt: skip
        table(stages, runs, info, floor)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def table(stages, runs, info, floor: float) -> None:
    ref = statistics.median(w for w, _ in runs["safe_open bf16"])
    bf16_bytes = 2 * info["values"]
    cols = ["stage", "stored MB", "read s", "stored GB/s", "bf16 GB/s", "x safe_open",
            "peak RSS MiB"]  # fmt: skip
    rows = []
    for name, _, _, stored in stages:
        m = statistics.median(w for w, _ in runs[name])
        rss = max(r for _, r in runs[name])
        rows.append([
            name, f"{stored / 1e6:.0f}", f"{m:.3f}", f"{stored / m / 1e9:.2f}",
            f"{bf16_bytes / m / 1e9:.2f}", f"{ref / m:.2f}", f"{rss:.0f}",
        ])  # fmt: skip
    w = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def line(cells):
        rest = (f"{c:>{n}}" for c, n in zip(cells[1:], w[1:], strict=True))
        return "  ".join([f"{cells[0]:<{w[0]}}", *rest])

    print()
    print(line(cols))
    for r in rows:
        print(line(r))
    print(
        f"\nmedian of {len(runs['safe_open bf16'])} interleaved runs, warm page cache; "
        f"x safe_open > 1: faster than safe_open reading the bf16 copy; peak RSS is each "
        f"process's own (interpreter + torch import alone: {floor:.0f} MiB)."
    )


if __name__ == "__main__":
    sys.exit(main())

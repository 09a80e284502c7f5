"""FP4 expert read and requantization rates against a raw read of the same bytes.

The K3 release holds ~1.4 TB of MXFP4 routed experts, so how fast they decode (and
requantize) next to just reading their bytes decides the conversion's wall time.

Three synthetic checkpoints are written into a temporary directory (default: 16 experts of
the Kimi K3 release's routed shape, gate / up [3072, 3584] and down [3584, 3072]: 528 M
values, 1057 MB as bf16, 264 MB as MXFP4 / 280 MB as NVFP4): the MXFP4 one in the
release's layout (``weight_packed`` uint8 [out, in/2] + ``weight_scale`` uint8 [out,
in/32], random E2M1 bytes and E8M0 exponents around 2**-7), an NVFP4 one with the same
bytes (e4m3 scales per 16, a global scale), and a bf16 one with the same names and logical
shapes. Stages, each in a fresh process (``bench/_harness.measure``: peak RSS is the
command's own), interleaved (A B C ... A B C ...), median of ``--repeats`` (3), page cache warm:

  cp -r mxfp4              the MXFP4 files copied (whole process: no interpreter)
  safe_open bf16           safe_open(f).get_tensor(name).clone() per tensor of the bf16 copy
                           (get_tensor hands out a view of its memory map: the clone is
                           what reads every byte, once)
  safe_open mxfp4 (raw)    the same on the MXFP4 files: the raw read of the same bytes
  k3convert mxfp4 -> bf16  open_checkpoint; get(name, bf16) per expert tensor (a new tensor
                           holding every value), dropped (its memory then serves the next
                           one: k3convert.native.outbuf, as in every k3convert run)
  k3convert nvfp4 -> bf16  the same on the NVFP4 copy
  mxfp4 -> nvfp4 (exact)   quantize_stored(ck, name, nvfp4a16): what `k3convert quantize`
                           runs per tensor, the exact transcode (k3convert.quant.fp4_requant),
                           with its loss report (from the transcode's own figures where it
                           has them, else the decode of source and output compared, as the
                           writer does)
  mxfp4 -> fp8-block (exact)  the same with fp8-block (power-of-two 128 x 128 block scales
                           on the bfloat16 decode)
  mxfp4 -> int4 g128 minmax   w4a16 (int4, group 128, bf16 scales) with the minmax
                           observer (--weight-observer minmax)
  mxfp4 -> int4 g32 search    int4-g32 with each group's scale searched, the default for an
                           MXFP4 source (k3convert.quant.mx_int4)

"read s" is the time the worker measures around its loop (no interpreter start, no
imports; cp -r: the whole command); "stored GB/s" divides the bytes stored on disk by it;
"x raw" is that rate over the raw read's at the same thread count. The python stages run
torch with each of ``--threads`` (default 1: as convert's workers do; on 2 cores shared
with other jobs a 2-thread OpenMP team waiting on a descheduled thread was measured 10-50x
slower), the k3convert kernels with as many pthreads (k3convert.native.threads_for); with
several counts (``--threads 1 2``) every python stage runs at each, interleaved (A1 A2 B1
B2 ...), raw read included, and the table has a row per (stage, threads). "RSS/expert" is
the peak RSS above the bare interpreter + torch floor over one expert (gate + up + down)
in bf16.
Usage: python bench/bench_fp4_read.py [--experts 16] [--hidden 3584] [--moe 3072]
       [--repeats 3] [--threads 1 [2 ...]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _harness import PY, STARTUP, measure, warm

_WORKER = """
import json, sys, time, torch
from pathlib import Path
root, how, threads = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
torch.ones(1 << 22).sum()  # large enough for a parallel region: a team starts before the clock
if how != "safe_open":  # imports before the clock, as the requant stages' scheme warm-up
    import k3convert.formats.fp4, k3convert.native
    k3convert.native.library()
scheme = None
if how.startswith("requant:"):
    from k3convert.quant import get_scheme
    from k3convert.quant import fidelity
    from k3convert.quant.writer import quantize_stored
    name, _, observer = how.partition(":")[2].partition(":")
    scheme = get_scheme(name)
    if observer:  # e.g. int4-g32:search, the default for an MXFP4 source
        import dataclasses
        scheme = dataclasses.replace(scheme, observer=observer)
    scheme.quantize(torch.randn(64, 256))
t0 = time.perf_counter()
n = 0
if how == "safe_open":
    from safetensors import safe_open
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k).clone()  # get_tensor maps; the clone reads every byte
                n += t.numel() * t.element_size()  # bytes: raw reads hand out what is stored
                del t
else:
    from k3convert.checkpoint import open_checkpoint
    ck = open_checkpoint(root)
    for k in ck.names():
        if scheme is None:
            t = ck.get(k, torch.bfloat16)
            n += t.numel()
        else:  # with the loss report, as quantize's writer computes it
            stats = {}
            parts = quantize_stored(ck, k, scheme, stats=stats)
            if not stats.get("exact") and "loss" not in stats:  # measured by decoding again
                fidelity.measure(k, "mxfp4", scheme.name, ck.get(k), scheme.dequantize(parts),
                                 (1, 32))
            n += ck.meta(k).shape[0] * ck.meta(k).shape[1]
            t = parts
        del t
print(json.dumps({"read_s": time.perf_counter() - t0, "values": n}))
"""


def build(root: Path, experts: int, hidden: int, moe: int) -> dict:
    """The three checkpoints (written by a child process: its RSS stays out of the runs)."""
    code = f"""
import json, torch
from pathlib import Path
from safetensors.torch import save_file
root = Path({str(root)!r})
g = torch.Generator().manual_seed(0)
dirs = ("mxfp4", "nvfp4", "bf16")
out = {{d: {{}} for d in dirs}}
def flush(i):
    for d in dirs:
        if out[d]:
            f = root / d / f"model-{{i:05d}}.safetensors"
            save_file(out[d], f, metadata={{"format": "pt"}})
            out[d].clear()
for d in dirs:
    (root / d).mkdir()
for e in range({experts}):
    for w, (o, i) in (("w1", ({moe}, {hidden})), ("w3", ({moe}, {hidden})),
                      ("w2", ({hidden}, {moe}))):
        base = f"model.layers.0.experts.{{e}}.{{w}}"
        packed = torch.randint(0, 256, (o, i // 2), generator=g, dtype=torch.uint8)
        out["mxfp4"][base + ".weight_packed"] = packed
        out["mxfp4"][base + ".weight_scale"] = torch.randint(117, 124, (o, i // 32), generator=g
                                                             ).to(torch.uint8)
        out["nvfp4"][base + ".weight_packed"] = packed
        out["nvfp4"][base + ".weight_scale"] = (torch.rand(o, i // 16, generator=g) * 400 + 1
                                                ).to(torch.float8_e4m3fn)
        out["nvfp4"][base + ".weight_global_scale"] = torch.tensor([2688.0 / 0.05])
        out["bf16"][base + ".weight"] = (torch.randn(o, i, generator=g) * 0.02).bfloat16()
    if (e + 1) % 4 == 0:
        flush(e // 4)
flush({experts})
size = lambda d: sum(p.stat().st_size for p in (root / d).glob("*.safetensors"))
print(json.dumps({{**{{d: size(d) for d in dirs}}, "values": {experts} * 3 * {hidden} * {moe}}}))
"""
    _, _, out, _ = measure([PY, "-c", code])
    return json.loads(out.strip().splitlines()[-1])


def stages(tmp: Path, info: dict, threads: list[int]) -> list[tuple]:
    """(name, threads (None: cp), argv, stored bytes it reads, whether it hands out every
    value), each python stage once per thread count, next to each other."""
    mx, nv = info["mxfp4"], info["nvfp4"]
    python = [
        ("safe_open bf16", "bf16", "safe_open", info["bf16"], False),
        (RAW, "mxfp4", "safe_open", mx, False),
        ("k3convert mxfp4 -> bf16", "mxfp4", "decode", mx, True),
        ("k3convert nvfp4 -> bf16", "nvfp4", "decode", nv, True),
        ("mxfp4 -> nvfp4 (exact)", "mxfp4", "requant:nvfp4a16", mx, True),
        ("mxfp4 -> fp8-block (exact)", "mxfp4", "requant:fp8-block", mx, True),
        ("mxfp4 -> int4 g128 minmax", "mxfp4", "requant:w4a16", mx, True),
        ("mxfp4 -> int4 g32 search", "mxfp4", "requant:int4-g32:search", mx, True),
    ]
    st = [("cp -r mxfp4", None, ["cp", "-r", str(tmp / "mxfp4"), str(tmp / "copy")], mx, False)]
    for name, d, how, stored, every in python:
        for t in threads:
            argv = [PY, "-c", _WORKER, str(tmp / d), how, str(t)]
            st.append((name, t, argv, stored, every))
    return st


RAW = "safe_open mxfp4 (raw)"
#: what the k3convert stages ran on: the kernels' status and vector ISA level
_KERNELS = """
import k3convert.native as n
names = {0: "portable loops", 1: "AVX2", 2: "AVX-512 BW + VBMI (bfloat16 decode), AVX2"}
print(f"{n.status()}; vector ISA {names[n.simd_level()]} (CPU: {names[n.cpu_level()]})")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=3584, help="the release's routed width")
    ap.add_argument("--moe", type=int, default=3072, help="the release's expert width")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1],
        help="torch (and kernel) threads of the python stages; several: a row each",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="k3fp4_", dir=os.environ.get("TMPDIR")))
    try:
        info = build(tmp, args.experts, args.hidden, args.moe)
        print(
            f"{info['values'] / 1e6:.0f} M values: mxfp4 {info['mxfp4'] / 1e6:.0f} MB, "
            f"nvfp4 {info['nvfp4'] / 1e6:.0f} MB, bf16 {info['bf16'] / 1e6:.0f} MB, at {tmp}",
            flush=True,
        )
        st = stages(tmp, info, args.threads)
        warm(p for d in ("mxfp4", "nvfp4", "bf16") for p in (tmp / d).glob("*.safetensors"))
        _, floor, _, _ = measure(STARTUP)
        runs: dict[tuple, list[tuple[float, float]]] = {s[:2]: [] for s in st}
        loads = [os.getloadavg()]
        for r in range(args.repeats):
            for name, t, argv, _, every in st:
                shutil.rmtree(tmp / "copy", ignore_errors=True)
                wall, rss, out, _ = measure(argv)
                if argv[0] == "cp":
                    sec = wall
                else:
                    res = json.loads(out.strip().splitlines()[-1])
                    assert not every or res["values"] == info["values"], (name, res)
                    sec = res["read_s"]
                runs[name, t].append((sec, rss))
                print(f"  round {r + 1}/{args.repeats}  {name:<24} t{t or '-'} {sec:7.3f} s "
                      f"{rss:6.0f} MiB", flush=True)  # fmt: skip
            loads.append(os.getloadavg())
        expert = 3 * args.hidden * args.moe * 2
        table(st, runs, floor, expert, args.threads, loads)
        _, _, out, _ = measure([PY, "-c", _KERNELS])
        print(f"k3convert kernels: {out.strip().splitlines()[-1]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def table(st, runs, floor: float, expert: int, threads: list[int], loads) -> None:
    raw_stored = next(s[3] for s in st if s[0] == RAW)
    # x raw: over the raw read at the same thread count (cp -r: at the first count)
    raw_rate = {t: raw_stored / statistics.median(w for w, _ in runs[RAW, t]) for t in threads}
    raw_rate[None] = raw_rate[threads[0]]
    several = len(threads) > 1  # then also against the raw read at the first count
    first = f"x raw t{threads[0]}"
    cols = ["stage", "threads", "stored MB", "read s", "stored GB/s", "x raw",
            *([first] if several else []), "peak RSS MiB", "RSS/expert"]  # fmt: skip
    rows = []
    for name, t, _, stored, _ in st:
        m = statistics.median(w for w, _ in runs[name, t])
        rss = max(r for _, r in runs[name, t])
        above = max(0.0, rss - floor) if t is not None else rss
        rate = stored / m
        rows.append([
            name, "-" if t is None else str(t), f"{stored / 1e6:.0f}", f"{m:.3f}",
            f"{rate / 1e9:.2f}", f"{rate / raw_rate[t]:.2f}",
            *([f"{rate / raw_rate[None]:.2f}"] if several else []), f"{rss:.0f}",
            f"{above * 2**20 / expert:.1f}",
        ])  # fmt: skip
    w = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def line(cells):
        rest = (f"{c:>{n}}" for c, n in zip(cells[1:], w[1:], strict=True))
        return "  ".join([f"{cells[0]:<{w[0]}}", *rest])

    print()
    print(line(cols))
    for r in rows:
        print(line(r))
    la = " | ".join(" ".join(f"{x:.2f}" for x in ld) for ld in loads)
    print(
        f"\nmedian of {len(runs[RAW, threads[0]])} interleaved runs, warm page cache, torch "
        f"threads {' / '.join(map(str, threads))}; x raw: stored GB/s over the raw read's "
        f"({RAW}) at the same threads (cp -r: {threads[0]})"
        f"{f'; {first}: over the raw read at {threads[0]}' if several else ''}; RSS/expert: "
        f"peak RSS above the interpreter + torch floor ({floor:.0f} MiB; cp -r: its whole RSS) "
        f"over one expert's 3 tensors in bf16 ({expert / 2**20:.1f} MiB). Load average (1 5 15 "
        f"min) before and after each round: {la}; {os.cpu_count()} cores."
    )


if __name__ == "__main__":
    sys.exit(main())

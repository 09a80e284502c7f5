"""End-to-end ``convert`` (bf16 -> fp8-block, tp 4 stream) with 1 and 2 processes, next to
``cp -r`` of the same source, measured in the same run.

The source is a synthetic Kimi-K2-shaped bf16 checkpoint (``k3convert.synth``, plain
encoding, N(0, 0.02)): hidden 2048, 16 heads (MLA), dense intermediate 2048, 16 routed
experts of width 512 (top 4) plus one shared expert, vocab 32768, no MTP, in files of
--file-mb; the layer count is chosen to come closest to each of --sizes (GB). Every
width is a multiple of 128 * 4, so fp8-block's 128x128 blocks split at tp 4. The recipe
(written to the work dir) is ``quantize: {scheme: fp8-block}``, ``layout: {tp: 4}``,
``output: {compression: none}``, ``verify: {enabled: false}`` (verify is not timed here).

For each size, each stage a fresh process, interleaved A B C ... A B C ..., median of
--repeats, page cache warm (the source is read once before, and the interpreter's files by
one untimed startup run; dirty pages are synced before every run):

- startup:          ``python -c "import torch, k3convert.cli"`` (shown, not a baseline);
- torchrun startup: ``python -m torch.distributed.run --standalone --nproc-per-node 2
                    --no-python python -c "import torch, k3convert.cli"``: the launcher and
                    two workers' imports, what the 2-process row pays before converting;
- cp -r:            ``cp -r SRC DST`` (the I/O floor; DST removed before the next run);
- convert 1 proc:   ``python WRAP convert SRC OUT -r R.yaml --no-progress``;
- convert 2 procs:  ``python -m torch.distributed.run --standalone --nproc-per-node 2 WRAP
                    convert ...`` (the processes share the layers' units, balanced by bytes,
                    and the source files' sha256);
- convert 1 proc 1 core: ``taskset -c 0 env OMP_NUM_THREADS=1 python WRAP convert ...
                    --set output.workers=1``: one process on what each torchrun process has
                    here (one core), so "2 procs" against it is the scaling one more core or
                    node gives; on a 2-core machine "1 proc" already uses both cores.

WRAP is ``k3convert.cli.main`` (what ``k3convert`` runs) plus one stderr line per process
at exit with its own peak RSS (``ru_maxrss`` of RUSAGE_SELF), its rank and torch's thread
count; the table's peak RSS per process is the largest of those over runs and ranks. The
threads are what convert does by default: nothing is set here, so one process has torch's
default threads and ``output.workers`` = its cores; torchrun sets OMP_NUM_THREADS=1 in
each process unless the environment already has it, and convert's default workers are
then the node's cores divided by its processes (both are printed). "in-process s"
is convert's own total from OUT/report.json (no interpreter start or torch import; under
torchrun process 0's, which waits for the other).

Goals (the convert issue): 2 processes at least 1.6x faster than one; peak RSS per process
flat as the checkpoint grows. After the rounds, the last 1- and 2-process streams of each
size must have byte-identical manifests and the 2-process one must pass ``shard --check``;
the exit status is 1 otherwise.

    python bench/bench_convert.py [--sizes 1,2.5] [--repeats 3] [--file-mb 256]
        [--dir D] [--keep] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import PY, STARTUP, interleaved, measure, rss_floor, sizes, versions, warm

K3 = [PY, "-m", "k3convert"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
#: the model's fixed dimensions; the layer count sets the size
MODEL = dict(hidden=2048, heads=16, intermediate=2048, vocab=32768, experts=16, topk=4,
             moe_intermediate=512)  # fmt: skip
PRESET = "kimi-k2"
RECIPE = """\
version: 1
description: bench_convert - bf16 -> fp8-block, tp 4, no verify
quantize: {scheme: fp8-block}
layout: {tp: 4}
output: {compression: none}
verify: {enabled: false}
"""
#: cli.main, then this process's peak RSS on stderr, then the fast exit cli.entry makes
WRAP = """\
import os, resource, sys
from k3convert.cli import main
code = main(sys.argv[1:])
import torch
kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"K3BENCH rank={os.environ.get('RANK', '0')} maxrss_kib={kib} "
      f"threads={torch.get_num_threads()} omp={os.environ.get('OMP_NUM_THREADS', '-')}",
      file=sys.stderr)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)
"""
_LINE = re.compile(r"K3BENCH rank=(\d+) maxrss_kib=(\d+) threads=(\d+) omp=(\S+)")
ONE, TWO = "convert 1 proc", "convert 2 procs"
#: one process on one core (taskset, one worker, one thread): what each torchrun process
#: gets here, so TWO against it is the scaling a second core / node brings
CORE = "convert 1 proc 1 core"


def model_bytes(layers: int) -> tuple[int, int]:
    """(total bytes, largest tensor bytes) synth would write for ``layers`` (bf16)."""
    from k3convert.arch import resolve
    from k3convert.synth import apply_overrides, preset_config

    arch, cfg = resolve(apply_overrides(preset_config(PRESET), dict(MODEL, layers=layers), False))
    n = [2 * math.prod(i.shape) for i in arch.instances(cfg)]
    return sum(n), max(n)


def layers_for(gb: float) -> int:
    """The layer count (at least 2) whose checkpoint comes closest to ``gb`` GB."""
    best, layers = None, 2
    while True:
        total = model_bytes(layers)[0]
        if best is None or abs(total - gb * 1e9) < abs(model_bytes(best)[0] - gb * 1e9):
            best = layers
        if total >= gb * 1e9:
            return best
        layers += 1


def build(path: Path, layers: int, file_mb: int) -> tuple[int, int]:
    """The synthetic source, written only if ``path`` is absent; (total, largest) bytes."""
    from k3convert.synth import synthesize

    if not path.exists():
        print(f"synth {path.name} ...", flush=True)
        synthesize(config=PRESET, out=path, overrides=dict(MODEL, layers=layers),
                   dtype="bf16", encoding="plain", shard_mb=file_mb)  # fmt: skip
    return sizes(path)


def ranks_of(err: str) -> list[dict]:
    return [
        dict(rank=int(m[1]), rss_mib=int(m[2]) / 1024, threads=int(m[3]), omp=m[4])
        for m in _LINE.finditer(err)
    ]


def run_size(root: Path, layers: int, a, wrap: Path, recipe: Path) -> dict:
    src = root / f"{PRESET}-{layers}L"
    total, largest = build(src, layers, a.file_mb)
    files = len(list(src.glob("*.safetensors")))
    outs = {n: root / "out" / n.replace(" ", "_") for n in ("cp -r", ONE, TWO, CORE)}
    conv = ["convert", "-r", str(recipe), "--no-progress"]
    pin = shutil.which("taskset")
    core = [pin, "-c", "0", "env", "OMP_NUM_THREADS=1", PY, str(wrap), conv[0], str(src),
            str(outs[CORE]), *conv[1:], "--set", "output.workers=1"] if pin else None  # fmt: skip
    stages = [
        ("startup", STARTUP, ""),
        ("torchrun startup", [*TORCHRUN, "--no-python", *STARTUP], ""),
        ("cp -r", ["cp", "-r", str(src), str(outs["cp -r"])], ""),
        (ONE, [PY, str(wrap), conv[0], str(src), str(outs[ONE]), *conv[1:]], ""),
        (TWO, [*TORCHRUN, str(wrap), conv[0], str(src), str(outs[TWO]), *conv[1:]], ""),
        (CORE, core, "taskset is not installed"),
    ]
    procs: dict[str, list[dict]] = {ONE: [], TWO: [], CORE: []}
    inproc: dict[str, list[float]] = {ONE: [], TWO: [], CORE: []}
    problems: list[str] = []

    def reset(name: str) -> None:
        if name in outs:
            shutil.rmtree(outs[name], ignore_errors=True)

    def on_output(name: str, out: str, err: str) -> None:
        if name in procs:
            ranks = ranks_of(err)
            if len(ranks) != (2 if name == TWO else 1):
                problems.append(f"{name}: not one K3BENCH line per process: {err[-500:]!r}")
            procs[name].append(ranks)
            rep = json.loads((outs[name] / "report.json").read_text())
            inproc[name].append(rep["seconds"]["total"])

    (root / "out").mkdir(exist_ok=True)
    warm(src.iterdir())
    measure(STARTUP)  # untimed: the interpreter's and torch's files into the page cache
    print(f"\n{src.name}: {total / 1e9:.2f} GB in {files} files, {a.repeats} rounds", flush=True)
    load0 = os.getloadavg()
    results = interleaved(stages, a.repeats, reset, on_output)
    load1 = os.getloadavg()

    if all(isinstance(results[n], list) and results[n] for n in (ONE, TWO)):
        m1, m2 = ((outs[n] / "manifest.json").read_bytes() for n in (ONE, TWO))
        if m1 != m2:
            problems.append("the 1- and 2-process manifests differ")
        r = subprocess.run([*K3, "shard", str(outs[TWO]), "--check", "--json"],
                           capture_output=True, text=True, check=False)  # fmt: skip
        status = json.loads(r.stdout)["status"] if r.stdout.strip() else f"exit {r.returncode}"
        if status != "intact":
            problems.append(f"the 2-process stream is {status}")
    else:
        problems.append("a convert stage failed")
    stream_bytes = sum(f.stat().st_size for f in outs[ONE].rglob("*") if f.is_file())
    if not a.keep:
        shutil.rmtree(root / "out", ignore_errors=True)
        if a.dir is None:
            shutil.rmtree(src, ignore_errors=True)

    row: dict = dict(size_gb=total / 1e9, source=src.name, layers=layers, files=files,
                     source_bytes=total, largest_bytes=largest, stream_bytes=stream_bytes,
                     load_before=load0, load_after=load1, problems=problems, stages={})  # fmt: skip
    for name, _, _ in stages:
        runs = results[name]
        if isinstance(runs, str):
            row["stages"][name] = {"failed": runs}
            continue
        walls = [w for w, _ in runs]
        st = dict(walls=walls, median_s=statistics.median(walls), min_s=min(walls))
        if name in procs:
            st["processes"] = procs[name]
            each = [p["rss_mib"] for rs in procs[name] for p in rs]
            st["rss_per_process_mib"] = max(each) if each else None
            st["in_process_s"] = inproc[name]
            st["in_process_median_s"] = statistics.median(inproc[name])
        else:
            st["rss_mib"] = max(r for _, r in runs)
        row["stages"][name] = st
    return row


def print_size(row: dict) -> None:
    st = row["stages"]
    med = {n: s["median_s"] for n, s in st.items() if "median_s" in s}
    cp, one = med.get("cp -r"), med.get(ONE)
    one_in = st.get(ONE, {}).get("in_process_median_s")
    cols = ["stage", "size GB", "median s", "min s", "GB/s", "x cp -r", "speed-up",
            "in-process s", "speed-up in-proc", "peak RSS/proc MiB"]  # fmt: skip
    rows = []
    for name, s in st.items():
        if "failed" in s:
            rows.append([name, s["failed"]])
            continue
        m = s["median_s"]
        r = [name, f"{row['size_gb']:.2f}", f"{m:.2f}", f"{s['min_s']:.2f}"]
        r += ["-" if name.endswith("startup") else f"{row['source_bytes'] / m / 1e9:.3f}"]
        r += [f"{m / cp:.2f}" if cp else "-"]
        r += [f"{one / m:.2f}x" if one and name in (ONE, TWO, CORE) else "-"]
        ip = s.get("in_process_median_s")
        r += [f"{ip:.2f}" if ip else "-", f"{one_in / ip:.2f}x" if ip and one_in else "-"]
        rss = s.get("rss_per_process_mib", s.get("rss_mib"))
        r += [f"{rss:.0f}" if rss else "-"]
        rows.append(r)
    widths = [max(len(c), *(len(r[i]) for r in rows if len(r) > 2)) for i, c in enumerate(cols)]

    def fmt(cells) -> str:
        return "  ".join([f"{cells[0]:<{widths[0]}}", *map("{:>{}}".format, cells[1:], widths[1:])])

    print(f"\n{row['source']}: {row['size_gb']:.2f} GB bf16, {row['layers']} layers, "
          f"{row['files']} files, largest tensor {row['largest_bytes'] / 2**20:.0f} MiB; stream "
          f"{row['stream_bytes'] / 1e9:.2f} GB; load average {row['load_before'][0]:.2f} "
          f"before, {row['load_after'][0]:.2f} after")  # fmt: skip
    print(fmt(cols))
    print("-" * len(fmt(cols)))
    for r in rows:
        print(fmt(r) if len(r) > 2 else f"{r[0]:<{widths[0]}}  {r[1]}")
    for name in (ONE, TWO, CORE):
        if "processes" in st.get(name, {}):
            last = st[name]["processes"][-1]
            each = ", ".join(f"rank {p['rank']} {p['rss_mib']:.0f} MiB threads {p['threads']} "
                             f"OMP_NUM_THREADS {p['omp']}" for p in last)  # fmt: skip
            print(f"  {name}, last run: {each}")
    for p in row["problems"]:
        print(f"  FAILED: {p}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2.5", help="source sizes in GB, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--file-mb", type=int, default=256, help="source safetensors file size")
    ap.add_argument("--dir", type=Path, help="work dir, sources reused (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep sources and outputs")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    try:
        targets = [float(s) for s in a.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be numbers in GB, comma-separated, not {a.sizes!r}")
    if not targets or min(targets) <= 0 or a.repeats < 1 or a.file_mb < 1:
        ap.error("--sizes must be positive GB values; --repeats and --file-mb at least 1")

    root = a.dir or Path(tempfile.mkdtemp(prefix="bench_convert_"))
    root.mkdir(parents=True, exist_ok=True)
    # per size at once: the source, its cp -r copy and two streams (about the source's size)
    total = [model_bytes(layers_for(g))[0] for g in targets]
    need = max(total) * 4.2 + (sum(total) if a.keep or a.dir is not None else 0)
    free = shutil.disk_usage(root).free
    if free < need:
        ap.error(f"{root}: needs about {need / 1e9:.1f} GB free, has {free / 1e9:.1f} GB; "
                 f"give smaller --sizes or another --dir")  # fmt: skip
    wrap, recipe = root / "k3bench_wrap.py", root / "bench_convert.yaml"
    wrap.write_text(WRAP)
    recipe.write_text(RECIPE)

    import torch

    from k3convert.shard.writer import check_write_options

    machine = dict(
        cpus=os.cpu_count(), load_start=os.getloadavg(), versions=versions(PY, "torch"),
        torch_threads=torch.get_num_threads(), omp_env=os.environ.get("OMP_NUM_THREADS"),
        convert_workers=check_write_options("none", "xxh3-128", None),
        rss_floor_mib=rss_floor(),
    )  # fmt: skip
    print(f"cpus {machine['cpus']}, load average {machine['load_start'][0]:.2f}; "
          f"{machine['versions']}; torch threads {machine['torch_threads']}, "
          f"OMP_NUM_THREADS {machine['omp_env'] or 'unset'}, convert's default output.workers "
          f"{machine['convert_workers']} per process; peak RSS floor "
          f"{machine['rss_floor_mib']:.0f} MiB (the launcher's, on `true`)")  # fmt: skip
    layers = sorted({layers_for(g) for g in targets})
    if len(layers) < len(targets):
        print(f"note: --sizes {a.sizes} give {len(layers)} distinct layer count(s) {layers}")
    rows = [run_size(root, n, a, wrap, recipe) for n in layers]
    machine["load_end"] = os.getloadavg()

    for row in rows:
        print_size(row)
    print(
        "\nGB/s: source bytes / median; x cp -r: median / the cp -r median; speed-up: the "
        "1-process median / this one (wall, interpreter start and torch import included); "
        "in-process s: convert's own total (report.json), speed-up in-proc its ratio; peak "
        "RSS/proc: the largest process's ru_maxrss (cp -r, startup: the command's)."
    )
    goals = {}
    both = [r["stages"] for r in rows if all("median_s" in r["stages"][n] for n in (ONE, TWO))]
    speedups = [s[ONE]["median_s"] / s[TWO]["median_s"] for s in both]
    if speedups:
        goals["speedup_2_procs"] = speedups
        met = min(speedups) >= 1.6
        print(f"goal 2 procs >= 1.6x one: {', '.join(f'{s:.2f}x' for s in speedups)} "
              f"({'met' if met else 'NOT met'})")  # fmt: skip
    pinned = [r["stages"] for r in rows if all("median_s" in r["stages"].get(n, {})
                                               for n in (CORE, TWO))]  # fmt: skip
    if pinned:
        per_core = [s[CORE]["median_s"] / s[TWO]["median_s"] for s in pinned]
        inside = [s[CORE]["in_process_median_s"] / s[TWO]["in_process_median_s"] for s in pinned]
        goals["speedup_2_procs_vs_1_core"] = per_core
        print(f"2 procs (a core each) vs 1 proc pinned to 1 core: "
              f"{', '.join(f'{x:.2f}x' for x in per_core)} wall, "
              f"{', '.join(f'{x:.2f}x' for x in inside)} in-process")  # fmt: skip
    for name in (ONE, TWO):
        rss = [r["stages"][name].get("rss_per_process_mib") for r in rows]
        if len(rows) > 1 and all(rss):
            growth = rss[-1] / rss[0]
            goals[f"rss_growth_{name.replace(' ', '_')}"] = growth
            at = zip(rss, rows, strict=True)
            steps = " -> ".join(f"{x:.0f} MiB at {r['size_gb']:.2f} GB" for x, r in at)
            more = rows[-1]["size_gb"] / rows[0]["size_gb"]
            print(f"goal flat peak RSS per process ({name}): {steps} ({growth:.2f}x for "
                  f"{more:.2f}x the bytes)")  # fmt: skip
    print(f"load average at the end {machine['load_end'][0]:.2f}")
    if a.json:
        a.json.write_text(json.dumps(dict(machine=machine, sizes=rows, goals=goals), indent=1))
    if a.dir is None and not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    elif a.keep:
        print(f"kept {root}")
    sys.exit(1 if any(r["problems"] for r in rows) else 0)


if __name__ == "__main__":
    main()

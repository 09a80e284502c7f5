"""Shared helpers of the comparison benchmarks (bench_quant.py, bench_shard.py).

Every measured command runs in a fresh process (peak RSS is that process's own, from
``os.wait4``), stages run interleaved (A B C A B C ...), and the table shows medians and
ratios against ``cp -r`` of the same source, measured in the same run.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PY = sys.executable
#: The fixed interpreter + torch import cost every python tool pays.
STARTUP = [PY, "-c", "import torch, k3convert.cli"]

#: safetensors' own round trip: load_file + save_file of each file, other files copied.
_ST_COPY = """
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True)
for p in sorted(src.iterdir()):
    if p.suffix == ".safetensors":
        save_file(load_file(p), out / p.name, metadata={"format": "pt"})
    elif p.is_file():
        shutil.copyfile(p, out / p.name)
"""


def safetensors_copy(src: Path, out: Path) -> list[str]:
    return [PY, "-c", _ST_COPY, str(src), str(out)]


def sizes(path: Path) -> tuple[int, int]:
    """(total tensor bytes, largest tensor bytes) of a checkpoint, from its headers."""
    from k3convert.checkpoint.safetensors_io import read_header

    n = [t.nbytes for p in path.glob("*.safetensors") for t in read_header(p).tensors.values()]
    return sum(n), max(n)


def build_llama(
    path,
    *,
    layers=12,
    files=3,
    hidden=2048,
    intermediate=5632,
    heads=16,
    kv_heads=8,
    vocab=32000,
) -> tuple[int, int]:
    """A llama-shaped untied bf16 N(0, 0.02) checkpoint in ``files`` files, written only if
    ``path`` is absent; returns (total bytes, largest tensor bytes)."""
    from k3convert.arch import resolve
    from k3convert.checkpoint.output import group_by_size
    from k3convert.synth import apply_overrides, preset_config, synthesize

    path = Path(path)
    if not path.exists():
        o = dict(layers=layers, hidden=hidden, intermediate=intermediate, heads=heads)
        o.update(kv_heads=kv_heads, vocab=vocab)
        arch, cfg = resolve(apply_overrides(preset_config("llama3-8b"), o, False))
        nbytes = [2 * math.prod(i.shape) for i in arch.instances(cfg)]  # synth's file order
        # total / files rounded up to a MiB, plus as many MiB as synth's greedy grouping
        # needs not to spill one tensor into an extra file
        mb = math.ceil(sum(nbytes) / files / 2**20)
        while len(group_by_size(nbytes, int, mb << 20)) > files:
            mb += 1
        synthesize(
            config="llama3-8b", out=path, overrides=o, encoding="plain", dtype="bf16", shard_mb=mb
        )
    return sizes(path)


#: Runs argv[2:] and writes "wall_s maxrss_kib" to argv[1]. measure() starts the command
#: through this small fresh interpreter because a child's ru_maxrss starts at the RSS high
#: water of the process it was spawned from (exec records the old mm's peak): spawned
#: straight from this torch-importing process, even `true` reports hundreds of MiB.
_LAUNCH = """
import os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as fh:
    fh.write(f"{time.perf_counter() - t0} {usage.ru_maxrss}")
sys.exit(os.waitstatus_to_exitcode(status) & 255)
"""


def measure(argv, env=None, cwd=None) -> tuple[float, float, str, str]:
    """Run ``argv`` (``env``: extra variables); (wall s, the command's own peak RSS MiB from
    ``os.wait4``, stdout, stderr). Raises RuntimeError with the stderr tail on failure."""
    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory() as tmp:
        res, fo, fe = (Path(tmp) / n for n in ("res", "out", "err"))
        with open(fo, "wb") as o, open(fe, "wb") as e:
            launch = [PY, "-I", "-S", "-c", _LAUNCH, str(res), *argv]
            rc = subprocess.run(
                launch, stdout=o, stderr=e, cwd=cwd, env={**os.environ, **(env or {})}
            ).returncode
        out, err = (f.read_text(errors="replace") for f in (fo, fe))
        if rc or not res.exists():
            raise RuntimeError(f"`{shlex.join(argv)}` exited {rc}:\n{err[-3000:]}")
        wall, kib = map(float, res.read_text().split())
    return wall, kib / 1024, out, err


def rss_floor() -> float:
    """Peak RSS MiB that measure() reports for `true`: the launcher's floor."""
    return measure(["true"])[1]


def warm(paths) -> None:
    """Read every file once so the page cache is warm for all stages alike."""
    for p in paths:
        with open(p, "rb") as fh:
            while fh.read(64 << 20):
                pass


def interleaved(
    stages, repeats: int, reset, on_output=None
) -> dict[str, list[tuple[float, float]] | str]:
    """Run every available stage once per round, in order, ``repeats`` rounds.

    ``stages``: ordered (name, argv or None if unavailable, note). ``reset(name)`` runs
    before each run, outside the timed region (it deletes the stage's output); dirty pages
    are then synced so no run pays for the previous one's writeback; ``on_output(name,
    stdout, stderr)``, if given, sees every successful run's output. Returns name ->
    [(wall s, peak RSS MiB)], or name -> reason for a stage unavailable or failed.
    """
    res: dict[str, list[tuple[float, float]] | str] = {
        name: [] if argv else note for name, argv, note in stages
    }
    for r in range(repeats):
        for name, argv, _ in stages:
            if not isinstance(res[name], list):
                continue
            reset(name)
            os.sync()
            try:
                wall, rss, out, err = measure(argv)
            except RuntimeError as e:
                print(e, file=sys.stderr)
                tail = [ln for ln in str(e).splitlines() if ln.strip()][-1]
                res[name] = f"{name} failed: {tail.strip()[:150]}"
                continue
            res[name].append((wall, rss))
            if on_output is not None:
                on_output(name, out, err)
            print(f"  round {r + 1}/{repeats}  {name:<26} {wall:8.2f} s {rss:7.0f} MiB", flush=True)
    return res


#: stages that start no python interpreter (no startup to take off)
BASELINES_WITHOUT_PYTHON = ("cp -r", "cp -r + sync")


def print_table(results, *, src_bytes, largest, baseline="cp -r", compare=None, notes=None):
    """Medians and ratios. ``compare``: {our stage: their stage}; its column is their
    median / ours (> 1: ours is faster). ``notes``: {stage: what it does}, printed below."""
    ran = {k: v for k, v in results.items() if isinstance(v, list) and v}
    med = {k: statistics.median(w for w, _ in v) for k, v in ran.items()}
    base = med.get(baseline)
    start = med.get("startup")
    cols = ["stage", "median s", "min s", "GB/s", f"x {baseline}"]
    cols += ["less startup"] if start is not None else []
    cols += ["vs cmp"] if compare else []
    cols += ["peak RSS MiB", "RSS/largest"]
    rows = []
    for name, runs in results.items():
        if isinstance(runs, str):
            rows.append([name, runs])
            continue
        if not runs:
            continue
        m, rss = med[name], max(r for _, r in runs)
        row = [name, f"{m:.2f}", f"{min(w for w, _ in runs):.2f}"]
        row += ["-" if name == "startup" else f"{src_bytes / m / 1e9:.2f}"]
        row += [f"{m / base:.2f}" if base else "-"]
        if start is not None:
            python = name != "startup" and name not in BASELINES_WITHOUT_PYTHON
            row += [f"{max(0.0, m - start) / base:.2f}" if base and python else "-"]
        if compare:
            other = med.get(compare.get(name, ""))
            row += [f"{other / m:.2f}" if other else "-"]
        row += [f"{rss:.0f}", f"{rss * 2**20 / largest:.1f}x"]
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows if len(r) > 2)) for i, c in enumerate(cols)]

    def fmt(cells) -> str:  # the stage name left-aligned, numbers right-aligned
        return "  ".join([f"{cells[0]:<{widths[0]}}", *map("{:>{}}".format, cells[1:], widths[1:])])

    print(fmt(cols))
    print("-" * len(fmt(cols)))
    for r in rows:  # an unavailable stage: its reason instead of numbers
        print(fmt(r) if len(r) > 2 else f"{r[0]:<{widths[0]}}  {r[1]}")
    print(f"GB/s: source bytes / median; x {baseline}: median / the {baseline} median;")
    if start is not None:
        print(f"less startup: (median - the startup median) / the {baseline} median, for the "
              f"python stages (the work once the interpreter and torch are loaded);")  # fmt: skip
    if compare:
        print("vs cmp: the compared tool's median / ours (> 1: ours is faster);")
    print("RSS/largest: peak RSS / the largest source tensor. Stages:")
    for name, note in (notes or {}).items():
        if note and isinstance(results.get(name), list):
            print(f"  {name}: {note}")


def llmc_python(arg=None) -> str | None:
    """An interpreter that can import llmcompressor (optional, never a dependency): ``arg``
    (--llmc-python), else $K3_BENCH_LLMC_PYTHON, else this one if it has it, else None."""
    probe = "import importlib.util as u, sys; sys.exit(u.find_spec('llmcompressor') is None)"
    for py in (arg, os.environ.get("K3_BENCH_LLMC_PYTHON")):
        if py:
            ok = shutil.which(py) and subprocess.run([py, "-c", probe], check=False).returncode == 0
            return py if ok else None
    return PY if importlib.util.find_spec("llmcompressor") else None


def versions(py: str, *dists: str) -> str:
    """'python X, name version, ...' of distributions as seen by interpreter ``py``."""
    code = "import importlib.metadata as m, sys\nprint('python', sys.version.split()[0])\n"
    code += "for d in sys.argv[1:]:\n"
    code += "    try: print(d, m.version(d))\n    except m.PackageNotFoundError: pass"
    r = subprocess.run([py, "-c", code, *dists], capture_output=True, text=True, check=False)
    return ", ".join(r.stdout.split("\n")[:-1])


def print_header(src: Path, total: int, largest: int, layers: int, workers: int, repeats: int):
    """What was measured, above a table."""
    files = len(list(src.glob("*.safetensors")))
    print(
        f"\ncheckpoint: {total / 1e9:.2f} GB bf16, {total / 2e6:.0f} M params, {layers} llama "
        f"layers, {files} files; largest tensor {largest / 2**20:.0f} MiB"
    )
    print(f"workers {workers}, repeats {repeats}; {versions(PY, 'torch', 'safetensors')}")
    print(
        f"peak RSS: per process, floor {rss_floor():.0f} MiB (the launcher's, measured on `true`)"
    )

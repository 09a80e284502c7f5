"""Read throughput and peak memory: k3convert's reader vs safetensors' load_file.

Writes a multi-file synthetic bf16 checkpoint (default ~3 GB, tensors up to 64 MB) with
safetensors' ``save_file`` into a temporary directory, then measures, each in a fresh
subprocess so that peak RSS is the reader's own:

  k3convert    open_checkpoint(dir); for every name: get(name), touch it (sum), drop it
  load_file    safetensors.torch.load_file(f) per file; touch every tensor; drop the dict
  safe_open    safe_open(f); get_tensor(name) per tensor; touch; drop (reference)

Each method runs cold (the files evicted from the page cache with
posix_fadvise(DONTNEED) first) and warm (right after another full read). Peak RSS is
VmHWM from /proc/self/status (reset after imports through /proc/self/clear_refs where
the kernel allows it) and ru_maxrss; "baseline" is VmRSS after the imports, before any
read. Usage: python bench/bench_read.py [--gb 3] [--max-tensor-mb 64] [--file-gb 1]
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

from _common import evict

METHODS = ("k3convert", "load_file", "safe_open")


# -- worker side (runs in a subprocess) --------------------------------------------------


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(method: str, root: Path) -> dict:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from k3convert.checkpoint import open_checkpoint

    files = sorted(root.glob("*.safetensors"))
    torch.zeros(4).sum()  # warm up the kernels before the baseline
    baseline = _status_kb("VmRSS")
    reset = _reset_peak()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    flt0 = (ru0.ru_minflt, ru0.ru_majflt)
    n_bytes = n_tensors = 0
    t0 = time.perf_counter()
    if method == "k3convert":
        ck = open_checkpoint(root)
        for name in ck.names():
            t = ck.get(name)
            t.sum()
            n_bytes += t.numel() * t.element_size()
            n_tensors += 1
            del t
    elif method == "load_file":
        for f in files:
            sd = load_file(f)
            for t in sd.values():
                t.sum()
                n_bytes += t.numel() * t.element_size()
                n_tensors += 1
            del sd, t
    elif method == "safe_open":
        for f in files:
            with safe_open(f, "pt") as sf:
                for name in sf.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    t = sf.get_tensor(name)
                    t.sum()
                    n_bytes += t.numel() * t.element_size()
                    n_tensors += 1
                    del t
    else:
        raise SystemExit(f"unknown method {method}")
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "method": method,
        "wall_s": wall,
        "bytes": n_bytes,
        "tensors": n_tensors,
        "baseline_kb": baseline,
        "vmhwm_kb": _status_kb("VmHWM"),
        "ru_maxrss_kb": ru.ru_maxrss,
        "minflt": ru.ru_minflt - flt0[0],
        "majflt": ru.ru_majflt - flt0[1],
        "peak_reset": reset,
    }


# -- driver ------------------------------------------------------------------------------


def write_checkpoint(root: Path, gb: float, max_tensor_mb: float, file_gb: float) -> dict:
    """bf16 tensors cycling through sizes up to max_tensor_mb, split into ~file_gb files."""
    import torch
    from safetensors.torch import save_file

    total = int(gb * 1e9)
    max_elems = int(max_tensor_mb * 2**20) // 2
    cols = 4096
    fractions = (1.0, 0.5, 0.25, 1.0, 0.125, 1 / 64)  # of the largest tensor
    per_file = int(file_gb * 1e9)
    written = largest = 0
    file_idx, i = 0, 0
    pending: dict = {}
    pending_bytes = 0
    gen = torch.Generator().manual_seed(0)

    def flush():
        nonlocal pending, pending_bytes, file_idx
        if pending:
            save_file(pending, root / f"model-{file_idx:05d}.safetensors")
            file_idx += 1
            pending, pending_bytes = {}, 0

    while written < total:
        rows = max(1, int(max_elems * fractions[i % len(fractions)]) // cols)
        rows = min(rows, max(1, (total - written) // (2 * cols)))
        t = torch.empty(rows, cols, dtype=torch.bfloat16).uniform_(-1, 1, generator=gen)
        pending[f"layers.{i // 4}.w{i % 4}.weight"] = t
        pending[f"layers.{i // 4}.n{i % 4}.weight"] = torch.ones(cols, dtype=torch.bfloat16)
        nb = t.numel() * 2 + cols * 2
        written += nb
        pending_bytes += nb
        largest = max(largest, t.numel() * 2)
        i += 1
        if pending_bytes >= per_file:
            flush()
    flush()
    size = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    return {"files": file_idx, "tensors": 2 * i, "size": size, "largest": largest}


def run_worker(method: str, root: Path, *extra: str) -> dict:
    extra = tuple(a for a in extra if a != "--dir" and a != str(root))
    out = subprocess.run(
        [sys.executable, __file__, *extra, "--worker", method, "--dir", str(root)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=3.0, help="checkpoint size in GB (1e9)")
    ap.add_argument("--max-tensor-mb", type=float, default=64.0)
    ap.add_argument("--file-gb", type=float, default=1.0, help="approximate size per file")
    ap.add_argument("--dir", type=Path, help="use / keep this directory")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--worker", choices=(*METHODS, "write"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker == "write":
        info = write_checkpoint(args.dir, args.gb, args.max_tensor_mb, args.file_gb)
        print(json.dumps(info))
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir)))
        return

    tmp = None
    if args.dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="k3bench_"))
        root = tmp
    else:
        root = args.dir
        root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        # written in a subprocess too: a big parent would leak its RSS into the
        # workers' ru_maxrss (the kernel carries the pre-exec high-water mark over)
        info = run_worker("write", root, *sys.argv[1:])
        print(
            f"checkpoint: {info['size'] / 1e9:.2f} GB in {info['files']} files, "
            f"{info['tensors']} tensors, largest tensor {info['largest'] / 2**20:.0f} MiB "
            f"(written in {time.perf_counter() - t0:.1f} s) at {root}",
            flush=True,
        )
        rows = []
        for method in args.methods.split(","):
            evict(root.glob("*.safetensors"))
            cold = run_worker(method, root)
            warm = run_worker(method, root)
            for cache, r in (("cold", cold), ("warm", warm)):
                rows.append((method, cache, r))
                print(f"  done {method} {cache}: {r['wall_s']:.2f} s", flush=True)
        print_table(rows, info)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def print_table(rows, info) -> None:
    mib = 1024
    print()
    print(
        f"checkpoint {info['size'] / 2**30:.2f} GiB ({info['size'] / 1e9:.2f} GB), "
        f"{info['files']} files, {info['tensors']} tensors, "
        f"largest tensor {info['largest'] / 2**20:.0f} MiB"
    )
    head = (
        f"{'method':<10} {'cache':<5} {'wall s':>7} {'GB/s':>6} {'VmHWM MiB':>10} "
        f"{'ru_maxrss MiB':>14} {'baseline MiB':>13} {'peak-base MiB':>14} "
        f"{'minflt k':>9} {'majflt k':>9}"
    )
    print(head)
    print("-" * len(head))
    for method, cache, r in rows:
        gbs = r["bytes"] / 1e9 / r["wall_s"]
        print(
            f"{method:<10} {cache:<5} {r['wall_s']:>7.2f} {gbs:>6.2f} "
            f"{r['vmhwm_kb'] / mib:>10.0f} {r['ru_maxrss_kb'] / mib:>14.0f} "
            f"{r['baseline_kb'] / mib:>13.0f} {(r['vmhwm_kb'] - r['baseline_kb']) / mib:>14.0f} "
            f"{r['minflt'] / 1e3:>9.0f} {r['majflt'] / 1e3:>9.1f}"
        )
    if not all(r["peak_reset"] for *_, r in rows):
        print("(VmHWM could not be reset after imports; it includes import-time peaks)")
    print("ru_maxrss is never reset: it includes import-time peaks.")


if __name__ == "__main__":
    main()

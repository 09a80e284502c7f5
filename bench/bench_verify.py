"""verify benchmark (a script, not a test): the cost of running a sharded stream.

On a ~100M-parameter random deepseek_v3-shaped checkpoint (bench_runtime's DEEPSEEK_100M)
sharded tp=4 . ep=4, each measured in a fresh process (peak RSS = VmHWM), interleaved
A B C D A B C D ..., median of --reps:

  A  one unsharded streamed forward of the original (Runtime over the checkpoint): the
     baseline;
  B  the same forward executed from the stream's 4 ranks, simulated in one process
     (ParallelRuntime, SimulatedCollectives);
  C  the same under torchrun, 4 processes (gloo), slowest rank's time, largest RSS;
  D  the whole `k3convert verify STREAM` command as a user runs it (up-front hash check
     of every unit, the reference forward in lockstep, metrics), simulated.

Goals (issue): B <= 1.5x A in time, B's peak RSS <= 1.5x A's.

    python bench/bench_verify.py [--seq 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch
from k3convert.checkpoint import open_checkpoint
from k3convert.runtime import Runtime
from k3convert.stream import open_stream
from k3convert.parallel import (SimulatedCollectives, TorchDistributedCollectives,
    init_distributed, under_torchrun)
from k3convert.runtime.parallel import ParallelRuntime
from k3convert.runtime.ranks import stream_ranks

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

mode = {mode!r}
ids = torch.randint(0, 16000, (1, {seq}), generator=torch.Generator().manual_seed(0))
base = hwm()
if mode == "unsharded":
    rt = Runtime(open_checkpoint({src!r}))
else:
    ranks = stream_ranks(open_stream({out!r}, verify_hashes=False))
    if under_torchrun():
        init_distributed(torch.device("cpu"))
        groups = [ranks.tp_group(s.pp_rank) for s in ranks.stages]
        coll = TorchDistributedCollectives(ranks.world, groups, torch.device("cpu"))
    else:
        coll = SimulatedCollectives(ranks.world)
    rt = ParallelRuntime(ranks, collectives=coll)
t = time.perf_counter()
rt.forward(ids)
dt = time.perf_counter() - t
rank = int(os.environ.get("RANK", 0))
print("K3BENCH " + json.dumps(dict(time=dt, base=base, peak=hwm(), rank=rank)))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(mode: str, src: Path, out: Path, seq: int, threads: int, nproc: int = 1):
    code = CHILD.format(root=str(ROOT), mode=mode, src=str(src), out=str(out), seq=seq)
    script = out.parent / f"child_{mode}.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), str(script)]  # fmt: skip
    else:
        cmd = [sys.executable, str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    rows = [json.loads(line[8:]) for line in r.stdout.splitlines() if line.startswith("K3BENCH ")]
    return dict(time=max(x["time"] for x in rows), peak=max(x["peak"] for x in rows),
                base=max(x["base"] for x in rows))  # fmt: skip


def run_verify_cmd(out: Path, seq: int, threads: int):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    rep = out.parent / "report.json"
    cmd = [sys.executable, "-m", "k3convert", "verify", str(out), "--random", "1",
           "--seq-len", str(seq), "--json", str(rep)]  # fmt: skip
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(r.stdout[-2000:] + r.stderr[-2000:])
    j = json.loads(rep.read_text())
    return dict(time=dt, peak=j["peak_rss_mib"] * 2**20, base=0, passed=j["passed"])


def main() -> None:
    from bench_runtime import DEEPSEEK_100M, build

    from k3convert.shard.writer import shard

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="k3bench-verify-") as td:
        tmp = Path(td)
        src = build("deepseek_v3", DEEPSEEK_100M, tmp / "src")
        out = tmp / "stream"
        shard(src=src, out=out, tp=4, ep=4, progress=False)
        nparams = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 4
        res: dict[str, list] = {k: [] for k in "ABCD"}
        for _ in range(args.reps):
            res["A"].append(run_child("unsharded", src, out, args.seq, args.threads))
            res["B"].append(run_child("simulated", src, out, args.seq, args.threads))
            # torchrun: the same cores shared by 4 processes, one thread each
            res["C"].append(run_child("torchrun", src, out, args.seq, 1, nproc=4))
            res["D"].append(run_verify_cmd(out, args.seq, args.threads))
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("time", "peak", "base")}
               for k, v in res.items()}  # fmt: skip
        a = med["A"]
        print(
            f"deepseek_v3-shaped, {nparams / 1e6:.0f}M params fp32, tp=4 ep=4, 1 x {args.seq} "
            f"tokens, {args.threads} threads, median of {args.reps} (interleaved)\n"
        )
        names = {
            "A": "unsharded streamed forward (baseline)",
            "B": "stream, 4 ranks simulated",
            "C": "stream, torchrun 4 procs (gloo)",
            "D": "k3convert verify (check+ref+metrics)",
        }
        print(f"{'run':<40} {'time s':>8} {'vs A':>6} {'peak RSS':>10} {'vs A':>6}")
        for k in "ABCD":
            m = med[k]
            print(
                f"{names[k]:<40} {m['time']:>8.2f} {m['time'] / a['time']:>5.2f}x "
                f"{m['peak'] / 2**20:>7.0f} MiB {m['peak'] / a['peak']:>5.2f}x"
            )
        print("\nper-rep times (s):", {k: [round(r["time"], 2) for r in v] for k, v in res.items()})
        print("verify passed:", all(r["passed"] for r in res["D"]))


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()

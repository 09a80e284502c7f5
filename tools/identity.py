"""Byte-identity check for behaviour-preserving changes.

Runs the pipeline's commands on small synthetic models (synth, quantize with each
calibration algorithm, shard, convert, verify) through ``python -m k3convert`` - so the
tree on ``PYTHONPATH`` is the one measured - and writes the SHA-256 of every output file.
Fields that record wall time, absolute paths or a fresh stream id are dropped from JSON
files before hashing; every other byte must match.

    PYTHONPATH=/path/to/tree python tools/identity.py run WORKDIR > before.json
    python tools/identity.py compare before.json after.json

Run both trees in the same WORKDIR (move the first run's directory away before the second):
a source's config.json names its path, and a stream's manifest hashes the source files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# JSON keys whose values are wall-clock figures or machine paths, not outputs.
VOLATILE = {
    "seconds",
    "elapsed",
    "elapsed_s",
    "wall_s",
    "time_s",
    "duration_s",
    "started",
    "finished",
    "created",
    "timestamp",
    "mtime",
    "mtime_ns",
    "throughput",
    "tokens_per_s",
    "gb_per_s",
    "timings",
    "timing",
    "source_path",
    "path",
    "src",
    "out",
    "reference",
    "candidate",
    "stream_id",  # a fresh id per write
    "stream",
    "units_hash",  # covers the rank file, which names the stream id
    "identity",  # convert's resume key: the source files' mtimes
    "peak_rss_mib",
}

# fmt: off
# Widths that every group size (up to 128) divides.
WIDE = ["--tiny", "--hidden", "256", "--intermediate", "256", "--heads", "4",
        "--kv-heads", "2", "--layers", "2"]
DATA = ["--dataset", "{w}/calib.jsonl", "--num-samples", "4", "--seq-len", "32"]
CAL = ["--calibrate", *DATA]
SMALL_CAL = ["--set", "quantize.calibrate.dataset={w}/calib.jsonl",
             "--set", "quantize.calibrate.num_samples=4",
             "--set", "quantize.calibrate.seq_len=32"]


#: a job whose argv starts with this runs under ``torchrun --nproc-per-node 2``
TORCHRUN = "@torchrun"


def _q(src: str, out: str, *args: str) -> list[str]:
    return ["quantize", "{w}/" + src, "{w}/" + out, *args]


# (name, argv after `k3convert`); {w} is the work dir.
JOBS: list[tuple[str, list[str]]] = [
    ("synth-k3", ["synth", "kimi-k3", "{w}/k3", "--tiny", "--seed", "1"]),
    ("synth-llama", ["synth", "llama3-8b", "{w}/llama", *WIDE, "--seed", "2"]),
    ("synth-dsv3", ["synth", "deepseek-v3", "{w}/dsv3", "--tiny", "--seed", "3"]),
    ("synth-qwen", ["synth", "qwen3-30b-a3b", "{w}/qwen", *WIDE, "--experts", "4",
                    "--topk", "2", "--moe-intermediate", "128", "--seed", "4"]),
    ("q-fp8", _q("dsv3", "q-fp8", "--scheme", "fp8-dynamic")),
    ("q-w4-rtn", _q("llama", "q-w4-rtn", "--scheme", "w4a16")),
    ("q-w4-mse", _q("llama", "q-w4-mse", "--scheme", "w4a16", "--weight-observer", "mse")),
    ("q-gptq", _q("llama", "q-gptq", "--scheme", "w4a16", *CAL)),
    ("q-gptq-fp", _q("qwen", "q-gptq-fp", "--scheme", "w4a16", *CAL,
                     "--gptq-fp-target", "0.5", "--moe-all-experts")),
    ("q-awq", _q("llama", "q-awq", "--scheme", "w4a16", *CAL, "--algorithm", "awq")),
    ("q-awq-moe", _q("qwen", "q-awq-moe", "--scheme", "w4a16", *CAL, "--algorithm", "awq")),
    # two processes (torchrun) sharing the layers' GPTQ solves on the MoE
    ("q-gptq-dist", [TORCHRUN, *_q("qwen", "q-gptq-dist", "--scheme", "w4a16", *CAL)]),
    ("q-sq", _q("llama", "q-sq", "--scheme", "w8a8", *CAL,
                "--algorithm", "smoothquant+gptq", "--alpha-search")),
    ("q-static", _q("dsv3", "q-static", "--scheme", "fp8", *CAL, "--algorithm", "static",
                    "--observer", "mse", "--kv-cache", "fp8")),
    ("q-nvfp4", _q("qwen", "q-nvfp4", "--scheme", "nvfp4", *CAL)),
    ("q-autokeep", _q("llama", "q-autokeep", "--scheme", "w4a16", "--auto-keep", "10%",
                      "--sensitivity", "output", *DATA)),
    ("q-k3-int4", _q("k3", "q-k3-int4", "--recipe", "recipes/kimi-k3-int4-experts.yaml")),
    ("q-k3-nvfp4", _q("k3", "q-k3-nvfp4", "--recipe", "recipes/kimi-k3-nvfp4-experts.yaml")),
    ("shard-gptq", ["shard", "{w}/q-gptq", "{w}/s-gptq", "--tp", "2", "--pp", "2"]),
    ("shard-k3", ["shard", "{w}/k3", "{w}/s-k3", "--tp", "2", "--pp", "2", "--ep", "2",
                  "--compress", "zstd"]),
    ("convert-k3", ["convert", "{w}/k3", "{w}/c-k3", "--recipe", "demo"]),
    ("convert-sq", ["convert", "{w}/llama", "{w}/c-sq",
                    "--recipe", "recipes/w8a8-smoothquant.yaml", *SMALL_CAL]),
    ("verify-k3", ["verify", "{w}/s-k3", "--reference", "{w}/k3", "--random", "2",
                   "--decode", "2", "--json", "{w}/verify-k3.json"]),
    ("verify-gptq", ["verify", "{w}/s-gptq", "--reference", "{w}/llama", "--random", "2",
                     "--json", "{w}/verify-gptq.json"]),
    ("plan-k3", ["plan", "{w}/k3", "--tp", "2", "--pp", "2", "--ep", "2", "--context", "4k",
                 "--device", "h100", "--json", "{w}/plan-k3.json"]),
    ("plan-preset", ["plan", "kimi-k3", "--recipe", "recipes/kimi-k3-int4-experts.yaml",
                     "--json", "{w}/plan-preset.json"]),
    ("plan-dsv3", ["plan", "{w}/dsv3", "--scheme", "w4a16", "--tp", "2", "--device-mem",
                   "1GiB", "--json", "{w}/plan-dsv3.json"]),
]
# fmt: on


def _volatile(key: str) -> bool:
    return key in VOLATILE or key.endswith("_s") or "time" in key


def _scrub(value):
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if not _volatile(k)}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        return "PATH"  # a file of this machine (a recipe, a source)
    return value


def _digest(path: Path, work: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".json":
        try:
            doc = json.loads(data)
        except ValueError:
            pass
        else:
            text = json.dumps(_scrub(doc), sort_keys=True).replace(str(work), "WORK")
            data = text.encode()
    elif path.suffix in (".html", ".txt", ".log"):
        data = data.replace(str(work).encode(), b"WORK")
    return hashlib.sha256(data).hexdigest()


def run(work: Path, only: set[str] | None = None) -> dict:
    if not only and work.exists() and any(work.iterdir()):
        sys.exit(f"{work} is not empty: a full run starts from an empty work dir")
    work.mkdir(parents=True, exist_ok=True)
    # Pre-tokenized calibration rows (the synthetic models have no tokenizer).
    rows = [[(i * 37 + j * 11) % 250 + 1 for j in range(40)] for i in range(6)]
    (work / "calib.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    env = dict(os.environ, OMP_NUM_THREADS="1", K3CONVERT_NO_PROGRESS="1")
    jobs = {}
    for name, argv in JOBS:
        if only and name not in only:
            continue
        args = [a.replace("{w}", str(work)) for a in argv]
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "k3convert", *args]
        if args[0] == TORCHRUN:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", "-m", "k3convert", *args[1:]]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        print(f"{name:14s} rc={proc.returncode} {dt:6.1f}s", file=sys.stderr)
        if proc.returncode not in (0, 1):
            print(proc.stderr[-3000:], file=sys.stderr)
        jobs[name] = {"rc": proc.returncode}
    done = work / "jobs.json"  # an --only run adds to the earlier run's record
    jobs = {**(json.loads(done.read_text()) if done.exists() else {}), **jobs}
    done.write_text(json.dumps(jobs))
    return digest(work)


def digest(work: Path) -> dict:
    """The jobs' exit codes and every output file's digest."""
    jobs = json.loads((work / "jobs.json").read_text())
    files = {}
    for path in sorted(work.rglob("*")):
        if path.is_file() and path.name != "jobs.json":
            files[str(path.relative_to(work))] = _digest(path, work)
    return {"jobs": jobs, "files": files}


def compare(a: dict, b: dict) -> int:
    bad = 0
    for name in sorted(set(a["jobs"]) | set(b["jobs"])):
        ja, jb = a["jobs"].get(name), b["jobs"].get(name)
        if ja != jb:
            bad += 1
            print(f"job {name}: {ja} != {jb}")
    for path in sorted(set(a["files"]) | set(b["files"])):
        ha, hb = a["files"].get(path), b["files"].get(path)
        if ha != hb:
            bad += 1
            print(f"file {path}: {ha} != {hb}")
    n = len(a["files"])
    print(f"{len(a['jobs'])} jobs, {n} files compared: {bad} differ")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("work", type=Path)
    r.add_argument("--only", nargs="*", help="run these jobs alone (their inputs must exist)")
    h = sub.add_parser("hash", help="digest a work dir written by an earlier run")
    h.add_argument("work", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.cmd == "run":
        json.dump(run(args.work.resolve(), set(args.only or ())), sys.stdout, indent=1)
        return 0
    if args.cmd == "hash":
        json.dump(digest(args.work.resolve()), sys.stdout, indent=1)
        return 0
    return compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()))


if __name__ == "__main__":
    sys.exit(main())

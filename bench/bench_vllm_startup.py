"""vLLM start-up from the Hugging Face checkpoint vs the sharded_state directory
``shard --target vllm`` writes (a script, not a test): prints a table.

Each run is a fresh process in the vLLM venv (``tools/vllm-venv.sh``; ``--python`` or
``K3_VLLM_PYTHON`` for another) that imports vLLM, builds ``LLM(model=...)`` and asks for
one token of a 32-token prompt. Measured inside it: vLLM's import, the time to a loaded
engine (``LLM(...)`` returned), and to the first token; vLLM's own "Loading weights took"
line is the weight-loading part of it. The two loads run interleaved (HF, sharded, HF,
...), ``--repeats`` rounds, with the page cache warm for both; the table shows medians
and the ratio to the HF load. The one-time cost of writing the sharded files is timed
against ``cp -r`` of the checkpoint, and ``cp -r`` + ``sync`` (the writer fsyncs every
rank file and directory before the index commits, so that is the floor with the same
guarantee), interleaved too; ``--write-only`` times just that.

The checkpoint is a llama of bench_quant.py's shape (``--layers``, 12: 1.39 GB bf16),
written once under --work.

    python bench/bench_vllm_startup.py [--layers 12] [--tp 1] [--repeats 3] [--write-only]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import build_llama, warm

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = Path.home() / ".cache" / "k3convert" / "vllm-venv" / "bin" / "python"

#: one engine start: argv model load_format tp -> one JSON line
_START = """
import json, os, sys, time
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
t1 = time.perf_counter()
kw = {"load_format": sys.argv[2]} if sys.argv[2] != "auto" else {}
if int(sys.argv[3]) > 1:
    kw["tensor_parallel_size"] = int(sys.argv[3])
llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=256,
          skip_tokenizer_init=True, seed=0, **kw)
t2 = time.perf_counter()
sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
llm.generate([TokensPrompt(prompt_token_ids=list(range(2, 34)))], sp, use_tqdm=False)
t3 = time.perf_counter()
print("K3BENCH " + json.dumps({"import": t1 - t0, "ready": t2 - t1, "first": t3 - t2}))
"""
_LOADING = re.compile(r"Loading weights took ([0-9.]+) seconds")


def engine_env(tp: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_WORKER_MULTIPROC_METHOD="fork",
                   VLLM_CPU_OMP_THREADS_BIND="|".join(str(i) for i in range(tp)))  # fmt: skip
    return env


def start(py: str, model: Path, load_format: str, tp: int) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([py, "-c", _START, str(model), load_format, str(tp)],
                       capture_output=True, text=True, env=engine_env(tp))  # fmt: skip
    wall = time.perf_counter() - t0
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("K3BENCH ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"vLLM ({load_format}) exited {p.returncode}:\n{p.stderr[-3000:]}")
    got = json.loads(line.removeprefix("K3BENCH "))
    m = _LOADING.findall(p.stdout + p.stderr)
    got.update(process=wall, weights=float(m[-1]) if m else float("nan"))
    return got


def timed(argv) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(a) for a in argv], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--python", default=os.environ.get("K3_VLLM_PYTHON") or str(DEFAULT_VENV))
    ap.add_argument("--work", type=Path, default=None, help="Where the checkpoints go.")
    ap.add_argument("--write-only", action="store_true", help="Time the write only.")
    a = ap.parse_args()
    if not a.write_only and not Path(a.python).exists():
        sys.exit(f"no vLLM interpreter at {a.python}: run `bash tools/vllm-venv.sh` first")
    work = a.work or Path(tempfile.gettempdir()) / "k3-bench-vllm"
    work.mkdir(parents=True, exist_ok=True)
    hf = work / f"llama-{a.layers}"
    total, _ = build_llama(hf, layers=a.layers)
    sharded, copy = work / f"llama-{a.layers}-vllm-tp{a.tp}", work / "cp-copy"
    k3 = [sys.executable, "-m", "k3convert", "shard", hf, sharded, "--target", "vllm",
          "--tp", a.tp, "--no-progress"]  # fmt: skip
    writes: dict[str, list[float]] = {"cp -r": [], "cp -r + sync": [], "shard --target vllm": []}
    for _ in range(a.repeats):  # one-time cost, interleaved with cp -r of the same files
        for d in (copy, sharded):  # outside the timed region, synced: no run pays for it
            shutil.rmtree(d, ignore_errors=True)
        os.sync()
        writes["cp -r"].append(timed(["cp", "-r", hf, copy]))
        shutil.rmtree(copy)
        os.sync()
        writes["cp -r + sync"].append(timed(["sh", "-c", f'cp -r "{hf}" "{copy}" && sync']))
        os.sync()
        writes["shard --target vllm"].append(timed(k3))
    shutil.rmtree(copy, ignore_errors=True)
    if a.write_only:
        return _print_writes(writes, a.repeats, a.layers, total, a.tp)
    warm([*hf.iterdir(), *sharded.iterdir()])
    runs: dict[str, list[dict]] = {"HF checkpoint": [], "sharded_state": []}
    for _ in range(a.repeats):
        runs["HF checkpoint"].append(start(a.python, hf, "auto", a.tp))
        runs["sharded_state"].append(start(a.python, sharded, "sharded_state", a.tp))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    base = med["HF checkpoint"]
    print(f"\nvLLM start-up, llama {a.layers} layers ({total / 1e9:.2f} GB bf16), tp {a.tp}, "
          f"median of {a.repeats}, interleaved, page cache warm")  # fmt: skip
    print(f"{'load':<16}{'weights s':>11}{'ready s':>10}{'1st token s':>13}{'process s':>11}"
          f"{'ready vs HF':>13}")  # fmt: skip
    for k, m in med.items():
        print(f"{k:<16}{m['weights']:>11.2f}{m['ready']:>10.2f}{m['first']:>13.2f}"
              f"{m['process']:>11.2f}{m['ready'] / base['ready']:>12.2f}x")  # fmt: skip
    print(f"(vLLM import: {base['import']:.1f} s, in 'process' only)")
    _print_writes(writes, a.repeats, a.layers, total, a.tp)


def _print_writes(writes: dict, repeats: int, layers: int, total: int, tp: int) -> None:
    print(f"\none-time write of the sharded files, llama {layers} layers ({total / 1e9:.2f} GB"
          f" bf16), tp {tp} (process start included: k3convert imports torch), median of "
          f"{repeats}, interleaved")  # fmt: skip
    base = statistics.median(writes["cp -r + sync"])
    for k, v in writes.items():
        m = statistics.median(v)
        print(f"{k:<22}{m:>8.2f} s{total / m / 1e9:>8.2f} GB/s{m / base:>8.2f}x cp -r + sync")


if __name__ == "__main__":
    main()

"""Runtime benchmarks (a script, not a test): speed against transformers, streamed memory.

1. Forward tokens/s of our runtime (streamed with prefetch, and all layers resident)
   vs transformers' resident forward on the same ~100M-parameter random llama- and
   deepseek-shaped checkpoints, fp32 on CPU, in one process. Goals: >= 1.0x streamed,
   >= 1.0x resident (streaming pays for mapping every layer's weights in again on each
   forward: page faults and unmapping, ~3 ms a layer here, out of the speed it has over
   transformers' kernels).
   The engines are raced round-robin (one forward of each per round, so background
   load hits all alike): tok/s is from each engine's median time, "vs tf" is the median
   over the rounds of transformers' time / the engine's time in the same round (paired,
   so a slow stretch of the machine cancels), "spread" is (slowest - fastest) / median
   of the engine's times: the noise of that run.
2. Peak RSS of a streamed forward over a many-layer checkpoint, measured in a fresh
   child process, against the checkpoint's size. Goal: about two layers of weights
   plus activations over the process baseline, whatever the number of layers.

    python bench/bench_runtime.py [--seq 256] [--reps 5] [--threads N] [--quick]

--quick: 128 tokens, 3 rounds (a smoke run; ratios are noisier).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_100M = dict(
    vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
    num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
)  # fmt: skip
DEEPSEEK_100M = dict(
    vocab_size=16000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
    num_hidden_layers=12, first_k_dense_replace=1, num_attention_heads=8,
    num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
    q_lora_rank=256, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64,
    v_head_dim=64, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    max_position_embeddings=4096, num_nextn_predict_layers=0,
)  # fmt: skip
DEEP_LLAMA = dict(  # many thin layers: memory must not grow with depth
    vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=48,
    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096,
)  # fmt: skip


def build(kind: str, cfg: dict, out: Path) -> Path:
    import transformers as tf

    conf = {"llama": tf.LlamaConfig, "deepseek_v3": tf.DeepseekV3Config}[kind](**cfg)
    cls = {"llama": tf.LlamaForCausalLM, "deepseek_v3": tf.DeepseekV3ForCausalLM}[kind]
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = cls(conf).eval()
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(out)
    del model
    gc.collect()
    return out


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))


def race(fns: dict, reps: int) -> dict[str, list[float]]:
    """Wall times of each fn over ``reps`` rounds, run round-robin so background load
    hits all alike."""
    for fn in fns.values():
        fn()  # warm-up (page cache, allocator, one-time init)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return times


def speed(kind: str, cfg: dict, seq: int, batch: int, reps: int, tmp: Path) -> list[tuple]:
    import transformers as tf

    from k3convert.checkpoint import open_checkpoint
    from k3convert.runtime import Runtime

    path = build(kind, cfg, tmp / kind)
    ck = open_checkpoint(path)
    n_params = sum(ck.meta(n).numel for n in ck.names())
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
    tokens = batch * seq
    with contextlib.redirect_stderr(io.StringIO()):
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    streamed = Runtime(open_checkpoint(path))
    resident = Runtime(open_checkpoint(path), resident=True)

    def run_tf(model=model):
        with torch.inference_mode():
            return model(input_ids=ids).logits

    engines = {
        "transformers": run_tf,
        "ours streamed": lambda: streamed.forward(ids),
        "ours resident": lambda: resident.forward(ids),
    }
    times = race(engines, reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = run_tf()
    rows = []
    for name, fn in engines.items():
        err = ((fn() - ref).abs().max() / ref.abs().max()).item()
        t = med[name]
        spread = (max(times[name]) - min(times[name])) / t
        paired = zip(times["transformers"], times[name], strict=True)
        rel = statistics.median(a / b for a, b in paired)
        rows.append((kind, n_params, name, tokens / t, rel, spread, err))
    streamed.close()
    resident.close()
    del model, engines, run_tf
    gc.collect()
    return rows


CHILD = r"""
import json, sys, torch
sys.path.insert(0, {root!r})
torch.set_num_threads({threads})
from k3convert.checkpoint import open_checkpoint
from k3convert.runtime import Runtime

def hwm():  # VmHWM is per address space (ru_maxrss survives exec and would include
    for line in open("/proc/self/status"):  # the parent's pages)
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

rt = Runtime(open_checkpoint({path!r}), prefetch={prefetch})
ids = torch.randint(0, 8000, (1, {seq}))
base = hwm()
rt.forward(ids)
print(json.dumps(dict(base=base, peak=hwm())))
"""


def memory(seq: int, threads: int, tmp: Path) -> list[tuple]:
    from k3convert.checkpoint import open_checkpoint

    path = build("llama", DEEP_LLAMA, tmp / "deep")
    ck = open_checkpoint(path)
    size = dir_bytes(path)
    layer = sum(ck.meta(n).nbytes for n in ck.names() if ".layers.0." in n)
    head = sum(ck.meta(n).nbytes for n in ck.names() if ".layers." not in n)
    rows = []
    for prefetch in (True, False):
        code = CHILD.format(root=str(ROOT), path=str(path), seq=seq, threads=threads,
                            prefetch=prefetch)  # fmt: skip
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr)
        m = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append((prefetch, size, layer, head, m["base"], m["peak"]))
    return rows


def mb(x: float) -> str:
    return f"{x / 2**20:,.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (256)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=None, help="timed rounds (5)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--quick", action="store_true", help="128 tokens, 3 rounds")
    args = ap.parse_args()
    args.seq = args.seq or (128 if args.quick else 256)
    args.reps = args.reps or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 CPU, "
          f"batch {args.batch} x seq {args.seq}, median of {args.reps} rounds\n")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="k3bench-") as td:
        tmp = Path(td)
        rows = speed("llama", LLAMA_100M, args.seq, args.batch, args.reps, tmp)
        rows += speed("deepseek_v3", DEEPSEEK_100M, args.seq, args.batch, args.reps, tmp)
        print(f"{'model':<12} {'params':>8} {'engine':<15} {'tok/s':>9} {'vs tf':>7} "
              f"{'spread':>7} {'max|dlogit| rel':>16}")  # fmt: skip
        for kind, n, mode, tps, rel, spread, err in rows:
            print(f"{kind:<12} {n / 1e6:>7.0f}M {mode:<15} {tps:>9.0f} {rel:>6.2f}x "
                  f"{spread:>6.0%} {err:>16.1e}")  # fmt: skip
        if args.skip_memory:
            return
        print()
        print(f"{'streamed forward, 48-layer llama':<34} {'prefetch':>8} {'ckpt':>10} "
              f"{'1 layer':>9} {'emb+head':>9} {'baseline':>10} {'peak':>10} "
              f"{'peak-base':>10}")  # fmt: skip
        for pf, size, layer, head, base, peak in memory(args.seq, args.threads, tmp):
            print(f"{'':<34} {pf!s:>8} {mb(size):>10} {mb(layer):>9} {mb(head):>9} "
                  f"{mb(base):>10} {mb(peak):>10} {mb(peak - base):>10}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _ = resource  # (used in the child process code)
    main()

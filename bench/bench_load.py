"""Stream loader and zstd benchmarks (a script, not a test): prints tables.

1. Loader throughput of one rank against a raw sequential read of the same unit files,
   in one process, interleaved (A B C D A B C D ...), median of --repeats, with the page
   cache warm and, where ``posix_fadvise`` can evict it, cold. Rows: the raw read
   (``readinto`` a reused 16 MiB buffer, no checks), safetensors' ``load_file`` of the
   source files (the bytes every tensor of the model, for reference), ``rank(r).units()``
   with every unit's hash verified, on a stream with xxh3-128 unit hashes (the default)
   and one with sha256 (``shard --unit-hash sha256``, version 1's only choice), and
   ``units()`` without verification. Every reader touches one byte per 4 KiB page of
   every tensor, so lazy mappings are paid for. Goal: verified ``units()`` >= 0.9x the
   raw read, warm and cold. ``open_stream`` (manifest parse + schema validation, once per
   stream) is timed on its own line.
2. zstd: compression ratio and load slowdown on bf16, fp8 and int4 data.

Sources are synthetic checkpoints with realistic value distributions (normal weights,
e4m3 with per-128x128-block scales, int4 group-128 packed), written by this script; the
loader uses the llama-shaped checkpoint of bench_quant.py (--layers, 12: 1.39 GB) at tp 1,
or at --tp T (rank 0's share).

    python bench/bench_load.py [--layers 12] [--tp 1] [--repeats 3] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import evict
from _harness import build_llama
from safetensors.torch import load_file, save_file

from k3convert.arch import resolve
from k3convert.formats.intn import pack_int32
from k3convert.shard import shard
from k3convert.stream import open_stream, read_manifest_doc

QUANT = ("attention", "dense_mlp", "shared_experts", "routed_experts")


def llama_cfg(scale: float) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": max(1, round(4 * scale)),
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    }


def dsv3_cfg(scale: float) -> dict:
    return {
        "model_type": "deepseek_v3",
        "vocab_size": 8192,
        "hidden_size": 1024,
        "num_hidden_layers": max(2, round(4 * scale)),
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 384,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "intermediate_size": 2048,
        "moe_intermediate_size": 1024,
        "n_routed_experts": 32,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    }


def _fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    out, inp = w.shape
    s0, s1 = math.ceil(out / 128), math.ceil(inp / 128)
    scale = torch.rand(s0, s1) * 1e-3 + 1e-4
    q = (w / scale.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]).to(
        torch.float8_e4m3fn
    )
    return {"weight": q, "weight_scale_inv": scale}


def _int4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    out, inp = w.shape
    q = (w / w.std() * 2.5).round().clamp(-8, 7).to(torch.int8)
    return {
        "weight_packed": pack_int32(q, 4),
        "weight_scale": torch.rand(out, inp // 128).to(torch.bfloat16),
        "weight_shape": torch.tensor([out, inp], dtype=torch.int64),
    }


def synth(cfg: dict, out: Path, encode: str, shard_bytes: int = 256 << 20) -> Path:
    """A checkpoint of ``cfg`` with ``encode`` in (bf16, fp8, int4) for linear weights."""
    out.mkdir(parents=True)
    arch, c = resolve(cfg)
    g = torch.Generator().manual_seed(0)
    files: list[dict] = [{}]
    size = 0
    wm = {}
    for inst in arch.instances(c):
        w = torch.randn(inst.shape, generator=g) * 0.02
        if encode != "bf16" and inst.role.component in QUANT and len(inst.shape) == 2:
            parts = _fp8(w) if encode == "fp8" else _int4(w)
            base = inst.name.removesuffix(".weight")
            tensors = {f"{base}.{k}" if k != "weight" else inst.name: v for k, v in parts.items()}
        else:
            tensors = {inst.name: w.to(torch.bfloat16)}
        nb = sum(t.numel() * t.element_size() for t in tensors.values())
        if size + nb > shard_bytes and files[-1]:
            files.append({})
            size = 0
        files[-1].update(tensors)
        size += nb
    for i, sd in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(sd, out / name, metadata={"format": "pt"})
        wm.update({k: name for k in sd})
    cfg = dict(cfg)
    if encode == "int4":
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                "strategy": "group", "group_size": 128},
                }
            },
        }  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return out


def weight_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def dir_bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths)


def best(fn, repeat: int = 2, before=None) -> float:
    ts = []
    for _ in range(repeat):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def table(title: str, head: list[str], rows: list[list]) -> None:
    cells = [head, *[[str(x) for x in r] for r in rows]]
    w = [max(len(r[i]) for r in cells) for i in range(len(head))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
    print("  ".join("-" * x for x in w))
    for r in cells[1:]:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)))


def gbs(nbytes: int, s: float) -> str:
    return f"{nbytes / s / 1e9:.2f}"


def _touch(unit) -> int:
    n = 0
    for t in unit.tensors.values():
        if t.numel():
            n += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return n


def bench_loader(src: Path, tmp: Path, tp: int, repeats: int) -> None:
    streams = {}
    for algo in ("xxh3-128", "sha256"):
        streams[algo] = tmp / f"load-{algo}"
        shard(src=src, out=streams[algo], tp=tp, force=True, progress=False, unit_hash=algo)
    t0 = time.perf_counter()
    st = {algo: open_stream(p) for algo, p in streams.items()}
    t_open = (time.perf_counter() - t0) / len(st)
    man = st["xxh3-128"].manifest
    units = [streams["xxh3-128"] / u["file"] for u in man["ranks"][0]["units"]]
    n_entries = sum(len(u["tensors"]) for r in man["ranks"] for u in r["units"])
    nbytes = dir_bytes(units)
    srcf = weight_files(src)

    def raw():
        buf = bytearray(16 << 20)
        for p in units:
            with open(p, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass

    def st_load():
        for p in srcf:
            for t in load_file(p).values():  # touch: load_file may map lazily
                if t.numel():
                    int(t.reshape(-1).view(torch.uint8)[::4096].sum())

    def stream(algo: str, verify: bool):
        def f():
            for u in st[algo].rank(0).units(verify_hashes=verify, prefetch=2):
                _touch(u)

        return f

    cases = [
        ("raw sequential read", raw, units),
        ("safetensors load_file (source)", st_load, srcf),
        ("units() verified, xxh3-128", stream("xxh3-128", True), units),
        ("units() verified, sha256", stream("sha256", True), units),
        ("units() not verified", stream("xxh3-128", False), units),
    ]
    all_units = units + [streams["sha256"] / u["file"] for u in man["ranks"][0]["units"]]
    can_evict = evict(all_units + srcf)
    rows = []
    for cache in ("warm", "cold") if can_evict else ("warm",):
        times: dict[str, list[float]] = {label: [] for label, _, _ in cases}
        for _ in range(repeats):
            for label, fn, paths in cases:
                if cache == "cold":
                    evict(paths)
                else:
                    fn()  # warm: the files were just read
                t = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t)
        raw_t = statistics.median(times["raw sequential read"])
        for label, _, paths in cases:
            t = statistics.median(times[label])
            size = dir_bytes(paths) if paths is srcf else nbytes
            rows.append([cache, label, f"{size / 1e6:.0f}", f"{t:.3f}", gbs(size, t),
                         f"{raw_t / t * size / nbytes:.2f}x"])  # fmt: skip
    table(
        f"loader throughput, rank 0 of tp={tp} (median of {repeats}, interleaved; goal: "
        f"verified units() >= 0.9x raw read)",
        ["cache", "reader", "MB", "s", "GB/s", "vs raw"],
        rows,
    )
    print(f"open_stream: {t_open * 1e3:.0f} ms for a manifest of {n_entries} tensor entries "
          f"(once per stream, not in the rows above)")  # fmt: skip
    for p in streams.values():
        shutil.rmtree(p, ignore_errors=True)


def bench_zstd(srcs: dict, tmp: Path) -> None:
    rows = []
    for label, src in srcs.items():
        outs = {}
        for c in ("none", "zstd"):
            outs[c] = tmp / f"z-{label}-{c}"
            t0 = time.perf_counter()
            shard(src=src, out=outs[c], compress=c, force=True, workers=2, progress=False)
            outs[c, "w"] = time.perf_counter() - t0
        man = read_manifest_doc(outs["zstd"])
        us = [u for r in man["ranks"] for u in r["units"]]
        raw, stored = sum(u["raw_bytes"] for u in us), sum(u["bytes"] for u in us)
        times = {}
        for c in ("none", "zstd"):
            st = open_stream(outs[c])

            def load(st=st):
                for u in st.rank(0).units():
                    _touch(u)

            load()
            times[c] = best(load)
        rows.append(
            [label, f"{raw / 1e6:.0f}", f"{stored / 1e6:.0f}", f"{raw / stored:.3f}",
             f"{outs['none', 'w']:.2f}", f"{outs['zstd', 'w']:.2f}",
             f"{times['none']:.3f}", f"{times['zstd']:.3f}",
             f"{times['zstd'] / times['none']:.2f}x"]
        )  # fmt: skip
        for c in ("none", "zstd"):
            shutil.rmtree(outs[c], ignore_errors=True)
    table(
        "zstd (level 3) at tp=1: ratio, write time and load slowdown (warm cache, verify on)",
        ["data", "raw MB", "zstd MB", "ratio", "write none s", "write zstd s",
         "load none s", "load zstd s", "slowdown"],
        rows,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12, help="llama layers of the loader source")
    ap.add_argument("--tp", type=int, default=1, help="load rank 0 of this tp degree")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="zstd sources' size multiplier")
    ap.add_argument("--workdir", default=None, help="scratch directory (default: system tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--skip-zstd", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-", dir=a.workdir))
    try:
        src = tmp / "llama"
        build_llama(src, layers=a.layers)
        print(f"loader source: {dir_bytes(weight_files(src)) / 1e9:.2f} GB bf16; "
              f"{os.cpu_count()} CPUs, scratch {tmp}")  # fmt: skip
        bench_loader(src, tmp, a.tp, a.repeats)
        if not a.skip_zstd:
            srcs = {
                "bf16": synth(llama_cfg(a.scale), tmp / "bf16", "bf16"),
                "fp8": synth(dsv3_cfg(a.scale), tmp / "fp8", "fp8"),
                "int4": synth(llama_cfg(a.scale), tmp / "int4", "int4"),
            }
            bench_zstd(srcs, tmp)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

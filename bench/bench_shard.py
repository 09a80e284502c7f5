"""Shard / stream benchmarks: prints tables (not a test).

1. shard throughput vs ``shutil.copyfile`` of the same source bytes, same run:
   bf16 -> tp8 and fp8-block -> tp8 x ep8 (goal: shard <= 1.5x the copy's time), and vs
   a second floor, "copy + sha256 of the source + fsync" (the work the format's
   provenance hashes and durability require of any writer, before hashing the units);
2. loader throughput for one rank (``rank(0).units()``, hashes verified and not) vs
   ``safetensors.torch.load_file`` and a raw sequential read (goal >= 0.8x raw read),
   with the page cache warm and, where ``posix_fadvise`` can evict it, cold;
3. zstd: compression ratio and load slowdown on bf16, fp8 and int4 data.

Sources are synthetic checkpoints with realistic value distributions (normal weights,
e4m3 with per-128x128-block scales, int4 group-128 packed), written by this script.

    python bench/bench_shard.py [--scale 1.0] [--workers 2] [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _common import evict
from safetensors.torch import load_file, save_file

from k3convert.arch import resolve
from k3convert.quant.packing import pack_int32
from k3convert.shard import shard
from k3convert.stream import open_stream

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


def copy_hash_sync(files: list[Path], dst: Path, workers: int) -> None:
    """The least work the format asks of ``shard``, as a floor: every source byte read,
    sha256-hashed (once, in the buffer that was read), written and fsynced; files spread
    over ``workers`` threads as shard spreads its work."""

    def one(f: Path) -> None:
        buf = bytearray(1 << 20)
        mv = memoryview(buf)
        h = hashlib.sha256()
        with open(f, "rb", buffering=0) as src, open(dst / f.name, "wb", buffering=0) as out:
            while n := src.readinto(buf):
                out.write(mv[:n])
                h.update(mv[:n])
            os.fsync(out.fileno())
        h.hexdigest()

    dst.mkdir(exist_ok=True)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, sorted(files, key=lambda f: -f.stat().st_size)))


def bench_shard(srcs: dict, tmp: Path, workers: int) -> None:
    rows = []
    for label, src, kw in (
        ("bf16 -> tp8", srcs["bf16"], dict(tp=8)),
        ("fp8 -> tp8 x ep8", srcs["fp8"], dict(tp=8, ep=8)),
    ):
        files = weight_files(src)
        nbytes = dir_bytes(files)
        cdir = tmp / "copy"

        def copy(files=files, cdir=cdir):
            cdir.mkdir(exist_ok=True)
            for f in files:
                shutil.copyfile(f, cdir / f.name)
            for f in files:
                fd = os.open(cdir / f.name, os.O_RDONLY)
                os.fsync(fd)  # the shard output is fsynced too
                os.close(fd)

        def run(src=src, kw=kw):
            shard(src=src, out=tmp / "s", workers=workers, progress=False, **kw)

        def floor(files=files, cdir=cdir):
            copy_hash_sync(files, cdir, workers)

        def clean(cdir=cdir):
            shutil.rmtree(cdir, ignore_errors=True)

        t_copy = best(copy, repeat=3, before=clean)
        t_floor = best(floor, repeat=3, before=clean)
        clean()
        t_shard = best(run, repeat=3, before=lambda: shutil.rmtree(tmp / "s", ignore_errors=True))
        ratio = t_shard / t_copy
        rows.append(
            [label, f"{nbytes / 1e6:.0f}", f"{t_copy:.2f}", f"{t_floor:.2f}", f"{t_shard:.2f}",
             gbs(nbytes, t_shard), f"{ratio:.2f}x", f"{t_shard / t_floor:.2f}x",
             "ok" if ratio <= 1.5 else "MISSED"]
        )  # fmt: skip
        shutil.rmtree(tmp / "s", ignore_errors=True)
    buf = os.urandom(64 << 20)
    t = best(lambda: hashlib.sha256(buf).digest(), repeat=3)
    print(f"\n(sha256 on this CPU: {len(buf) / t / 1e9:.2f} GB/s per core. 'copy+sha' reads, "
          f"hashes once, writes and fsyncs the source bytes: the least a copy that records "
          f"the provenance hashes must do; shard also hashes every unit it writes, twice "
          f"the sha256 work)")  # fmt: skip
    table(
        f"shard throughput (workers={workers}; best of 3; goal: shard <= 1.5x copy)",
        ["case", "MB", "copy s", "copy+sha s", "shard s", "shard GB/s", "shard/copy",
         "shard/copy+sha", "goal"],
        rows,
    )  # fmt: skip


def _touch(unit) -> int:
    n = 0
    for t in unit.tensors.values():
        if t.numel():
            n += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return n


def bench_loader(src: Path, tmp: Path) -> None:
    out = tmp / "load"
    shard(src=src, out=out, force=True, workers=2, progress=False)
    st = open_stream(out)
    units = [out / u["file"] for u in st.manifest["ranks"][0]["units"]]
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

    def stream(verify: bool):
        def f():
            for u in st.rank(0).units(verify_hashes=verify, prefetch=2):
                _touch(u)

        return f

    cases = [
        ("raw sequential read", raw, units),
        ("safetensors load_file (source)", st_load, srcf),
        ("rank(0).units() verify", stream(True), units),
        ("rank(0).units() no verify", stream(False), units),
    ]
    can_evict = evict(units)
    rows = []
    res = {}
    for cache in ("warm", "cold") if can_evict else ("warm",):
        for label, fn, paths in cases:
            before = (lambda ps=paths: evict(ps)) if cache == "cold" else None
            if cache == "warm":
                fn()
            t = best(fn, before=before)
            res[(cache, label)] = t
            rel = res[(cache, "raw sequential read")] / t
            rows.append([cache, label, f"{nbytes / 1e6:.0f}", f"{t:.3f}", gbs(nbytes, t),
                         f"{rel:.2f}x"])  # fmt: skip
    table(
        "loader throughput, one rank (tp=1 bf16 stream; goal: units() >= 0.8x raw read)",
        ["cache", "reader", "MB", "s", "GB/s", "vs raw"],
        rows,
    )
    shutil.rmtree(out, ignore_errors=True)


def bench_zstd(srcs: dict, tmp: Path) -> None:
    rows = []
    for label, src in srcs.items():
        outs = {}
        for c in ("none", "zstd"):
            outs[c] = tmp / f"z-{label}-{c}"
            t0 = time.perf_counter()
            shard(src=src, out=outs[c], compress=c, force=True, workers=2, progress=False)
            outs[c, "w"] = time.perf_counter() - t0
        man = json.loads((outs["zstd"] / "manifest.json").read_text())
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
    ap.add_argument("--scale", type=float, default=1.0, help="model size multiplier")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workdir", default=None, help="scratch directory (default: system tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-", dir=a.workdir))
    try:
        t0 = time.perf_counter()
        srcs = {
            "bf16": synth(llama_cfg(a.scale), tmp / "bf16", "bf16"),
            "fp8": synth(dsv3_cfg(a.scale), tmp / "fp8", "fp8"),
            "int4": synth(llama_cfg(a.scale), tmp / "int4", "int4"),
        }
        sizes = ", ".join(f"{k} {dir_bytes(weight_files(v)) / 1e6:.0f} MB" for k, v in srcs.items())
        print(f"sources ({sizes}) written in {time.perf_counter() - t0:.1f}s; "
              f"{os.cpu_count()} CPUs, scratch {tmp}")  # fmt: skip
        bench_shard(srcs, tmp, a.workers)
        bench_loader(srcs["bf16"], tmp)
        bench_zstd(srcs, tmp)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

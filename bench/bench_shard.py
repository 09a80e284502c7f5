"""Resharding (bf16 -> tp 8 stream) against baselines, measured in the same run.

On the llama-shaped bf16 checkpoint of bench_quant.py (--layers 12 is 1.39 GB in 3
files), each stage a fresh process, interleaved A B C ... A B C ..., median of
--repeats, page cache warm (the source is read once before; dirty pages are synced
before every run):

- startup:          ``python -c "import torch, k3convert.cli"`` (shown, not a baseline);
- cp -r:            the I/O floor;
- cp -r + sync:     the same, then ``sync`` of the copied files (``cp`` leaves writeback
                    to the kernel; ``shard`` makes its output durable, so this is the floor
                    with the same guarantee);
- safetensors:      safetensors' own load_file + save_file of each file;
- k3convert shard:  ``k3convert shard SRC OUT --tp 8 --workers W``. Unlike the two
                    baselines it fsyncs every unit and the directories before writing
                    the manifest (its output is durable), so that writeback is in its time;
- k3convert check:  ``k3convert shard OUT --check`` on the stream the shard run of the same
                    round just wrote (from the page cache): it re-reads every unit of
                    every rank, hashes it (xxh3-128), parses its header against the manifest, and
                    hashes the carried files; it does not read the source.

llm-compressor has no resharding verb, so there is no third-party row. After the rounds
the last stream is checked once more and its size printed.

    python bench/bench_shard.py [--repeats 3] [--workers 2] [--layers 12]
        [--dir D] [--keep] [--only "cp -r,k3convert shard"]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from _harness import (
    PY,
    STARTUP,
    build_llama,
    interleaved,
    measure,
    print_header,
    print_table,
    safetensors_copy,
    warm,
)

K3 = [PY, "-m", "k3convert", "shard"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12, help="scale: 12 = 1.39 GB, 36 = 3.66 GB")
    ap.add_argument("--dir", type=Path, help="work dir (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the default temp dir")
    ap.add_argument("--only", help="comma-separated stage names to run")
    a = ap.parse_args()

    root = a.dir or Path(tempfile.mkdtemp(prefix="bench_shard_"))
    src = root / f"llama-{a.layers}L"
    outs = {
        n: root / "out" / n.replace(" ", "_").replace("+", "p")
        for n in ("cp -r", "cp -r + sync", "safetensors", "shard")
    }
    cp_sync = ["sh", "-c", 'cp -r "$0" "$1" && sync "$1"/*', str(src), str(outs["cp -r + sync"])]
    stream = outs["shard"]
    shard = [*K3, str(src), str(stream), "--tp", "8", "--workers", str(a.workers)]
    stages = [
        ("startup", STARTUP, "python -c 'import torch, k3convert.cli' (not a baseline)"),
        ("cp -r", ["cp", "-r", str(src), str(outs["cp -r"])], "cp -r SRC OUT (the I/O floor)"),
        ("cp -r + sync", cp_sync, "cp -r SRC OUT && sync OUT/* (durable, like shard)"),
        ("safetensors", safetensors_copy(src, outs["safetensors"]), "load_file + save_file"),
        ("k3convert shard", shard, "shard SRC OUT --tp 8 (fsyncs its units)"),
        ("k3convert check", [*K3, str(stream), "--check"], "shard OUT --check (reads OUT)"),
        ("llm-compressor", None, "llm-compressor has no resharding verb: n/a"),
    ]
    if a.only:
        only = [s.strip() for s in a.only.split(",")]
        if unknown := set(only) - {s[0] for s in stages}:
            ap.error(f"unknown stage(s) {sorted(unknown)}; stages: {[s[0] for s in stages]}")
        stages = [s for s in stages if s[0] in only]
    total, largest = build_llama(src, layers=a.layers)
    names = [s[0] for s in stages]

    def reset(name: str) -> None:
        if name in ("cp -r", "cp -r + sync", "safetensors"):
            shutil.rmtree(outs[name], ignore_errors=True)
        elif name == "k3convert shard":
            shutil.rmtree(stream, ignore_errors=True)

    (root / "out").mkdir(exist_ok=True)
    if "k3convert check" in names and "k3convert shard" not in names:
        reset("k3convert shard")
        measure(shard)  # something to check, untimed
    warm(src.iterdir())
    results = interleaved(stages, a.repeats, reset)

    print_header(src, total, largest, a.layers, a.workers, a.repeats)
    print()
    notes = {name: note for name, _, note in stages}
    print_table(results, src_bytes=total, largest=largest, notes=notes)
    print()
    ok = True
    if "k3convert shard" in names or "k3convert check" in names:
        try:
            rep = json.loads(measure([*K3, str(stream), "--check", "--json"])[2])
        except RuntimeError as e:  # exit 1 (damaged) or 2 (not a stream)
            rep = {"status": "damaged or missing", "problems": [str(e)[-500:]]}
        ok = rep["status"] == "intact"
        print(
            f"k3convert shard: {'ok' if ok else 'FAILED'}: stream {rep['status']}"
            + (
                f", {rep['units_checked']} units, {rep['bytes_checked'] / 1e9:.2f} GB checked"
                if ok
                else f": {rep['problems'][:3]}"
            )
        )
    if a.dir is None and not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    elif a.keep:
        print(f"kept {root}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Quantization throughput and peak memory against baselines, measured in the same run.

On a llama-shaped bf16 checkpoint (N(0, 0.02) weights, untied, 3 files; --layers 12 is
1.39 GB / 697 M params, --layers 36 is 3.66 GB), each stage a fresh process, interleaved
A B C ... A B C ..., median of --repeats, page cache warm (the source is read once
before; dirty pages are synced before every run):

- startup:             ``python -c "import torch, k3convert.cli"``: the interpreter +
                       torch import every python tool pays (shown, not a baseline);
- cp -r:               the I/O floor;
- safetensors:         safetensors' own load_file + save_file of each file (one file's
                       tensors at a time), config.json and index copied;
- k3convert fp8-block: ``k3convert quantize SRC OUT --scheme fp8-block --workers W``;
- llm-compressor FP8_BLOCK: ``model_free_ptq(SRC, OUT, scheme="FP8_BLOCK",
                       ignore=["lm_head", "model.embed_tokens"], max_workers=W,
                       device="cpu")``, when an interpreter with llmcompressor is found
                       (--llmc-python, $K3_BENCH_LLMC_PYTHON, or this one); optional;
- k3convert w4a16 / llm-compressor W4A16: the same with RTN int4, group 128, packed.

Both tools quantize the same tensors: every q/k/v/o/gate/up/down projection; they keep
embed_tokens, lm_head and the norms (llm-compressor skips modules ending in "norm" by
itself and is told to ignore the other two; the script checks that the sets match).
What differs: k3convert writes fp8-block scales as float32 (llm-compressor: bf16) and
repacks into --shard-size-gb files (one file here), where llm-compressor keeps the source
file layout; w4a16 outputs have the same tensors and dtypes.

Targets (the performance issue; ratios to cp -r in the same run): fp8-block <= 3x and
w4a16 <= 4x the cp -r time, each at least 1.5x faster than llm-compressor's
model_free_ptq with the same scheme ("vs cmp"), and peak RSS <= 3x the largest tensor,
flat as the checkpoint grows (compare --layers 12 with --layers 36). cp -r pays no
interpreter: every python row includes the startup row (about 2-3 s of interpreter and
torch import on 2 cores), so the table also shows each python row less the startup
median. After the rounds the outputs are checked (quantization_config format, the
quantized set), one line each; the exit status is 1 if one is wrong.

    python bench/bench_quant.py [--repeats 3] [--workers 2] [--layers 12] [--dir D]
        [--keep] [--llmc-python PY] [--only "cp -r,k3convert fp8-block"]
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
    llmc_python,
    print_header,
    print_table,
    safetensors_copy,
    versions,
    warm,
)

from k3convert.checkpoint.safetensors_io import read_header

#: (k3convert scheme, llm-compressor scheme, compressed-tensors format)
SCHEMES = (("fp8-block", "FP8_BLOCK", "float-quantized"), ("w4a16", "W4A16", "pack-quantized"))
LLMC_IGNORE = ["lm_head", "model.embed_tokens"]  # what k3convert keeps besides the norms


def llmc_argv(py: str, src: Path, out: Path, scheme: str, workers: int) -> list[str]:
    code = (
        "from llmcompressor import model_free_ptq; "
        f"model_free_ptq({str(src)!r}, {str(out)!r}, scheme={scheme!r}, "
        f"ignore={LLMC_IGNORE!r}, max_workers={workers}, device='cpu')"
    )
    return [py, "-c", code]


def inspect_output(out: Path, fmt: str) -> tuple[str | None, set[str], str]:
    """(problem or None, quantized module names, summary) of a quantized checkpoint."""
    if not (out / "config.json").is_file():
        return f"{out} has no config.json", set(), ""
    qc = json.loads((out / "config.json").read_text()).get("quantization_config") or {}
    files = sorted(out.glob("*.safetensors"))
    tensors = [t for p in files for t in read_header(p).tensors.values()]
    scales = {
        t.name.removesuffix(".weight_scale"): t.st_dtype
        for t in tensors
        if t.name.endswith(".weight_scale")
    }
    summary = (
        f"{len(scales)} modules quantized (scales {'/'.join(sorted(set(scales.values())))}), "
        f"{sum(t.nbytes for t in tensors) / 1e9:.2f} GB in {len(files)} file(s)"
    )
    if qc.get("format") != fmt:
        return (
            f"quantization_config format {qc.get('format')!r}, expected {fmt!r}",
            set(scales),
            summary,
        )
    return None, set(scales), f"quantization_config format {fmt}, {summary}"


def verify(results, outs) -> bool:
    ok = True
    for ours, theirs, fmt in SCHEMES:
        mine = None
        for name in (f"k3convert {ours}", f"llm-compressor {theirs}"):
            if not isinstance(results.get(name), list) or not results[name]:
                continue
            problem, quantized, summary = inspect_output(outs[name], fmt)
            if name.startswith("k3convert"):
                mine = quantized
            elif problem is None and mine is not None:
                if quantized == mine:
                    summary += ", the same set as k3convert"
                else:
                    a, b = sorted(mine - quantized)[:3], sorted(quantized - mine)[:3]
                    problem = f"a different set: only k3convert {a}, only llm-compressor {b}"
            ok &= problem is None
            print(f"{name}: {'FAILED: ' + problem if problem else 'ok'}: {summary}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12, help="scale: 12 = 1.39 GB, 36 = 3.66 GB")
    ap.add_argument("--dir", type=Path, help="work dir (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the default temp dir")
    ap.add_argument("--llmc-python", help="an interpreter that can import llmcompressor")
    ap.add_argument("--only", help="comma-separated stage names to run")
    a = ap.parse_args()

    root = a.dir or Path(tempfile.mkdtemp(prefix="bench_quant_"))
    src = root / f"llama-{a.layers}L"
    llmc = llmc_python(a.llmc_python)
    w = str(a.workers)
    outs = {}

    def out(name: str) -> Path:
        outs[name] = root / "out" / name.replace(" ", "_")
        return outs[name]

    stages = [
        ("startup", STARTUP, "python -c 'import torch, k3convert.cli' (not a baseline)"),
        ("cp -r", ["cp", "-r", str(src), str(out("cp -r"))], "cp -r SRC OUT (the I/O floor)"),
        ("safetensors", safetensors_copy(src, out("safetensors")), "load_file + save_file"),
    ]
    for ours, theirs, _ in SCHEMES:
        name = f"k3convert {ours}"
        k3 = [PY, "-m", "k3convert", "quantize", str(src), str(out(name))]
        stages.append((name, [*k3, "--scheme", ours, "--workers", w], f"quantize --scheme {ours}"))
        name = f"llm-compressor {theirs}"
        argv = llmc and llmc_argv(llmc, src, out(name), theirs, a.workers)
        why = "llm-compressor not installed: skipped (--llmc-python or $K3_BENCH_LLMC_PYTHON)"
        stages.append((name, argv, f"model_free_ptq scheme={theirs}" if llmc else why))
    if a.only:
        only = [s.strip() for s in a.only.split(",")]
        if unknown := set(only) - {s[0] for s in stages}:
            ap.error(f"unknown stage(s) {sorted(unknown)}; stages: {[s[0] for s in stages]}")
        stages = [s for s in stages if s[0] in only]
    total, largest = build_llama(src, layers=a.layers)

    def reset(name: str) -> None:
        if name in outs:
            shutil.rmtree(outs[name], ignore_errors=True)

    (root / "out").mkdir(exist_ok=True)
    warm(src.iterdir())
    results = interleaved(stages, a.repeats, reset)

    print_header(src, total, largest, a.layers, a.workers, a.repeats)
    if llmc:
        print(f"llm-compressor: {versions(llmc, 'llmcompressor', 'compressed-tensors', 'torch')}")
    print()
    compare = {f"k3convert {o}": f"llm-compressor {t}" for o, t, _ in SCHEMES}
    notes = {name: note for name, _, note in stages}
    print_table(results, src_bytes=total, largest=largest, compare=compare, notes=notes)
    print()
    ok = verify(results, outs)
    if a.dir is None and not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    elif a.keep:
        print(f"kept {root}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Are the vLLM target's rank files the same bytes as another tree's? (a restructuring's proof)

    git worktree add /tmp/base REV
    python bench/vllm_bytes_identity.py sources /tmp/vbi            # once, with this tree
    python bench/vllm_bytes_identity.py write /tmp/base /tmp/vbi base
    python bench/vllm_bytes_identity.py write . /tmp/vbi new
    python bench/vllm_bytes_identity.py compare /tmp/vbi base new

``sources`` synthesizes the cases (llama in bf16 and seven schemes, qwen3_moe in bf16 and
four, deepseek_v3, kimi_k3 as released); ``write`` writes each at tp1, tp2, tp1 pp2,
tp2 ep2, tp4 and tp2 pp2 with the tree given (its ``write_vllm``, wherever that tree keeps it) and
records the sha256 of every rank file (or the refusal); ``compare`` prints a table and
exits 1 on any difference. Each rank file is deleted once hashed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

#: tp 4 over the tiny models' 2 KV heads: each replicated on two ranks
LAYOUTS = [dict(tp=1), dict(tp=2), dict(tp=1, pp=2), dict(tp=2, ep=2), dict(tp=4),
           dict(tp=2, pp=2)]  # fmt: skip
LLAMA_SCHEMES = ["w8a8", "fp8-dynamic", "w4a16", "nvfp4", "fp8-block", "int4-g32-asym",
                 "int8-g32-asym"]  # fmt: skip
MOE_SCHEMES = ["w8a8", "nvfp4", "int4-g32-asym", "w4a16"]


def sources(root: Path) -> None:
    import warnings

    from k3convert.pipeline import quantize
    from k3convert.synth import synthesize

    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)

    def syn(name: str, preset: str, **over) -> Path:
        out = src / name
        if not out.exists():
            synthesize(config=preset, out=out, tiny=True, encoding="plain", overrides=over)
        return out

    def quant(base: Path, scheme: str) -> None:
        out = src / f"{base.name}-{scheme}"
        if not out.exists():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize(src=base, out=out, scheme=scheme, progress=False)

    llama = syn("llama", "llama3-8b", layers=2, vocab=500)
    for s in LLAMA_SCHEMES:
        quant(llama, s)
    moe = syn("qwen3moe", "qwen3-30b-a3b")
    for s in MOE_SCHEMES:
        quant(moe, s)
    syn("dsv3", "deepseek-v3")
    k3 = src / "k3"
    if not k3.exists():  # as released: MXFP4 experts, with the processor config vLLM reads
        synthesize(config="kimi-k3", out=k3, tiny=True)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.test_vllm_kimi_k3 import PREPROCESSOR

        (k3 / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    print(f"{len(list(src.iterdir()))} sources in {src}")


def write(tree: Path, root: Path, tag: str) -> None:
    sys.path.insert(0, str(tree.resolve()))
    try:
        from k3convert.engines.vllm_write import write_vllm
    except ImportError:  # trees before the writer had its own module
        from k3convert.engines.vllm_sharded import write_vllm
    outs = root / f"out-{tag}"
    shutil.rmtree(outs, ignore_errors=True)
    outs.mkdir(parents=True)
    res: dict = {}
    for src in sorted((root / "src").iterdir()):
        for lay in LAYOUTS:
            name = f"{src.name}-" + "-".join(f"{k}{v}" for k, v in lay.items())
            out = outs / name
            try:
                write_vllm(src=src, out=out, **lay)
            except Exception as e:
                res[name] = f"refused: {type(e).__name__}"
                continue
            res[name] = {
                p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(out.glob("model-*.safetensors"))
            }
            shutil.rmtree(out)
    (root / f"{tag}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"{tag}: {sum(isinstance(v, dict) for v in res.values())} written, "
          f"{sum(isinstance(v, str) for v in res.values())} refused")  # fmt: skip


def compare(root: Path, a: str, b: str) -> int:
    ra = json.loads((root / f"{a}.json").read_text())
    rb = json.loads((root / f"{b}.json").read_text())
    diff = sorted(k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k))
    same = [k for k in ra if k not in diff and isinstance(ra[k], dict)]
    refused = [k for k in ra if k not in diff and isinstance(ra[k], str)]
    print(f"{'case':<34} {a:>10} {b:>10}")
    for k in sorted(ra.keys() | rb.keys()):
        va, vb = ra.get(k), rb.get(k)
        show = ("same" if va == vb else "DIFFERS") if isinstance(va, dict) else str(va)[:10]
        print(f"{k:<34} {show:>10} {('' if va == vb else str(vb)[:10]):>10}")
    print(f"identical: {len(same)}, refused by both: {len(refused)}, differing: {len(diff)}")
    return 1 if diff else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sources")
    s.add_argument("root", type=Path)
    w = sub.add_parser("write")
    w.add_argument("tree", type=Path)
    w.add_argument("root", type=Path)
    w.add_argument("tag")
    c = sub.add_parser("compare")
    c.add_argument("root", type=Path)
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "sources":
        sources(args.root)
    elif args.cmd == "write":
        write(args.tree, args.root, args.tag)
    else:
        return compare(args.root, args.a, args.b)
    return 0


if __name__ == "__main__":
    sys.exit(main())

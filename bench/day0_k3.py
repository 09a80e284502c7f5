"""Day 0 at the release's bytes: Kimi K3 at its real widths, converted as a user runs it,
against ``cp -r`` of the same files in the same run.

The source is ``k3convert synth kimi-k3`` without ``--tiny``: the release's widths
(hidden 7168, MLA and KDA with 96 heads, the latent MoE's routed experts 3072 x 3584 in
MXFP4, the vocabulary of 163840, the vision tower) and all 896 routed experts, for
``--layers`` layers (2: the first, dense layer and one MoE layer, about 20 GB; each
further MoE layer adds about 15 GB). ``--experts`` / ``--vocab`` shrink it for a quick
look; the table says what was measured.

Stages, each a fresh process (``_harness.measure``: wall time and the process's own peak
RSS), interleaved A B C ... A B C ..., median of ``--repeats``; the output is deleted and
dirty pages synced before every run:

- ``startup``: ``python -c "import torch, k3convert.cli"``, the memory floor every python
  stage pays (its peak RSS is subtracted in the "over startup" column);
- ``cp -r``: the same files, the floor every stage is a ratio to; ``cp -r + sync`` the same
  until the copy is on disk (quantize fsyncs its files before it renames OUT);
- ``quantize <scheme>``: ``k3convert quantize SRC OUT --scheme S --keep NON_EXPERTS``, the
  routed experts transcoded from their MXFP4 bytes and everything else copied as stored,
  for the schemes of the K3 presets: ``nvfp4a16`` (exact, ``kimi-k3-nvfp4-experts``),
  ``fp8-block`` (exact, ``kimi-k3-fp8-experts``: twice the expert bytes),
  ``int4-g32`` (searched scales, ``kimi-k3-int4-experts``);
- ``convert <preset>`` (``--convert``): ``k3convert convert SRC OUT --recipe PRESET`` with
  verify off, the whole pipeline to the stream at the preset's layout (``--layout`` to
  override it for this machine), the presets named in ``--presets``;
- ``shard vllm`` and ``convert vllm`` (``--vllm``): vLLM's rank files of the release as it
  ships (the only K3 layout vLLM 0.32 serves: MXFP4 experts, the rest bf16) at tp 2 + EP,
  by ``shard --target vllm`` and by ``convert`` with ``output.format: vllm`` in one pass
  (the experts kept as stored; verify off);
- ``... xN`` (``--procs N``): each quantize / convert / shard stage again under
  ``torchrun --standalone --nproc-per-node N`` (its peak RSS: the largest process's).

Per stage: median and min wall time, GB/s of source bytes read and of output bytes
written, the ratio to ``cp -r``, the peak RSS, that less the startup's and over one expert.

Targets (issue 51): each quantize stage <= 1.5x ``cp -r`` (fp8-block <= 2x), peak RSS
<= 3x the largest expert. Disk: the source plus one output at a time (``--root`` must
hold about 2.2x the source); ``--keep-source`` leaves the source for another run.

    python bench/day0_k3.py --root /work/scratch/day0 [--layers 2] [--experts 896]
        [--repeats 3] [--workers N] [--only "cp -r,quantize nvfp4a16"] [--convert]
        [--vllm] [--procs 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from _harness import PY, interleaved, measure

#: every tensor but the routed experts' (what --keep leaves as stored)
NON_EXPERTS = r"re:^(?!.*\.experts\.\d+\.).*"
SCHEMES = ("nvfp4a16", "fp8-block", "int4-g32")
PRESETS = ("kimi-k3-nvfp4-experts", "kimi-k3-fp8-experts", "kimi-k3-int4-experts",
           "kimi-k3-day0")  # fmt: skip
K3 = [PY, "-m", "k3convert"]
#: convert to vLLM's rank files in one pass: the release as it ships, tp 2 + EP
VLLM_RECIPE = """version: 1
quantize: {rules: [{roles: [experts], scheme: keep}]}
layout: {tp: 2, moe_ep: 2}
output: {format: vllm}
verify: {enabled: false}
"""


def workers(n: int) -> list:
    return ["--workers", n] if n else []


def drop_workers(argv: list) -> list:
    i = argv.index("--workers") if "--workers" in argv else -1
    return argv if i < 0 else argv[:i] + argv[i + 2 :]


def tree_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def largest_expert(src: Path) -> tuple[int, int]:
    """(bytes of the largest routed-expert tensor, of the largest expert: its w1 + w2 + w3),
    every stored part counted."""
    import re

    from k3convert.checkpoint import open_checkpoint

    ck = open_checkpoint(src)
    per: dict[str, int] = {}
    top = 1
    for n in ck.names():
        m = re.match(r"(.*\.experts\.\d+)\.", n)
        if m:
            b = sum(p.nbytes for p in ck.meta(n).parts.values())
            top = max(top, b)
            per[m.group(1)] = per.get(m.group(1), 0) + b
    return top, max(per.values(), default=1)


def synth(src: Path, a) -> None:
    if (src / "config.json").exists():
        print(f"source: {src} (made before)")
        return
    argv = [*K3, "synth", "kimi-k3", src, "--layers", a.layers, "--experts", a.experts,
            "--shard-mb", 4000, "--no-progress"]  # fmt: skip
    if a.vocab:
        argv += ["--vocab", a.vocab]
    wall, rss, out, _ = measure(argv)
    print(out.strip().splitlines()[-1] if out.strip() else "")
    print(f"synth: {wall:.0f} s, peak RSS {rss:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="work directory")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=0, help="0: the release's (163840)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0,
                    help="quantize --workers (0: k3convert's default, one per core, divided "
                    "among torchrun processes)")  # fmt: skip
    ap.add_argument("--only", help="comma-separated stage names")
    ap.add_argument("--convert", action="store_true", help="also convert with --presets")
    ap.add_argument("--presets", default=",".join(PRESETS[:3]))
    ap.add_argument("--layout", default="", help="convert --set overrides, e.g. layout.tp=2")
    ap.add_argument("--keep-source", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="also write vLLM's rank files")
    ap.add_argument(
        "--procs",
        type=int,
        default=0,
        help="also run each k3convert stage under torchrun with N processes",
    )
    a = ap.parse_args()

    a.root.mkdir(parents=True, exist_ok=True)
    src, out = a.root / "src", a.root / "out"
    synth(src, a)
    total = tree_bytes(src)
    big, expert = largest_expert(src)
    stages = [
        ("startup", [*K3[:1], "-c", "import torch, k3convert.cli"], ""),
        ("cp -r", ["cp", "-r", src, out], ""),
        ("cp -r + sync", ["sh", "-c", f'cp -r "{src}" "{out}" && sync'], ""),
    ]
    for s in SCHEMES:
        stages.append((f"quantize {s}", [*K3, "quantize", src, out, "--scheme", s, "--keep",
                                         NON_EXPERTS, *workers(a.workers), "--no-progress"],
                       ""))  # fmt: skip
    if a.convert:
        recipes = Path(__file__).resolve().parents[1] / "recipes"
        for p in a.presets.split(","):
            sets = [x for kv in a.layout.split(",") if kv for x in ("--set", kv)]
            stages.append((f"convert {p}", [*K3, "convert", src, out, "--recipe",
                                            recipes / f"{p}.yaml", "--set", "verify.enabled=false",
                                            *sets, "--no-progress"], ""))  # fmt: skip
    if a.vllm:
        recipe = a.root / "vllm.yaml"
        recipe.write_text(VLLM_RECIPE)
        stages.append(("shard vllm", [*K3, "shard", src, out, "--target", "vllm", "--tp", 2,
                                      "--ep", 2, "--no-progress"], ""))  # fmt: skip
        stages.append(("convert vllm", [*K3, "convert", src, out, "--recipe", recipe,
                                        "--no-progress"], ""))  # fmt: skip
    if a.procs > 1:
        run = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", a.procs]
        per = workers(max(1, a.workers // a.procs)) if a.workers else []
        stages += [(f"{n} x{a.procs}", [*run, *drop_workers(argv[1:]), *per], note)
                   for n, argv, note in stages if argv[:3] == K3]  # fmt: skip
    if a.only:
        keep = {s.strip() for s in a.only.split(",")}
        stages = [s for s in stages if s[0] in keep]
    stages = [(n, [str(x) for x in argv], note) for n, argv, note in stages]
    written: dict[str, int] = {}

    def reset(_name: str) -> None:
        stage = out.with_name(f".{out.name}.vllm-partial")  # (a failed vLLM write's)
        for p in (out, out.with_name(out.name + ".calib"), stage):
            shutil.rmtree(p, ignore_errors=True)

    def seen(name: str, _out: str, _err: str) -> None:
        written[name] = tree_bytes(out)

    print(f"source: {total / 1e9:.2f} GB in {src}; largest expert tensor {big / 2**20:.1f} MiB, "
          f"expert {expert / 2**20:.1f} MiB; "
          f"{a.layers} layers, {a.experts} routed experts; "
          f"quantize --workers {a.workers or 'default'}; "
          f"repeats {a.repeats}")  # fmt: skip
    res = interleaved(stages, a.repeats, reset, on_output=seen)
    reset("")
    base = statistics.median(w for w, _ in res["cp -r"]) if isinstance(res.get("cp -r"), list) \
        and res["cp -r"] else None  # fmt: skip
    floor = max(r for _, r in res["startup"]) if isinstance(res.get("startup"), list) \
        and res["startup"] else 0.0  # fmt: skip
    cols = ["stage", "median s", "min s", "read GB/s", "write GB/s", "x cp -r", "peak RSS MiB",
            "over startup", "/ expert"]  # fmt: skip
    rows = []
    for name, runs in res.items():
        if isinstance(runs, str) or not runs:
            rows.append([name, str(runs) or "not run"])
            continue
        m = statistics.median(w for w, _ in runs)
        rss = max(r for _, r in runs)
        rows.append([name, f"{m:.2f}", f"{min(w for w, _ in runs):.2f}", f"{total / m / 1e9:.2f}",
                     f"{written.get(name, 0) / m / 1e9:.2f}", f"{m / base:.2f}" if base else "-",
                     f"{rss:.0f}", f"{max(0.0, rss - floor):.0f}",
                     f"{max(0.0, rss - floor) * 2**20 / expert:.1f}x"])  # fmt: skip
    w = [max(len(c), *(len(r[i]) for r in rows if len(r) > 2)) for i, c in enumerate(cols)]
    line = "  ".join(f"{c:>{w[i]}}" if i else f"{c:<{w[0]}}" for i, c in enumerate(cols))
    print("\n" + line + "\n" + "-" * len(line))
    for r in rows:
        print("  ".join(f"{c:>{w[i]}}" if i else f"{c:<{w[0]}}" for i, c in enumerate(r))
              if len(r) > 2 else f"{r[0]:<{w[0]}}  {r[1]}")  # fmt: skip
    print(
        "read GB/s: source bytes / median; write GB/s: output bytes / median; over startup: "
        "peak RSS less the startup row's (python + torch + k3convert imported); / expert: "
        "that over one routed expert (w1 + w2 + w3, every part)"
    )
    doc = {"source_bytes": total, "largest_expert_tensor": big, "expert": expert,
           "layers": a.layers, "experts": a.experts, "workers": a.workers, "results": res,
           "written": written}  # fmt: skip
    (a.root / "day0.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if not a.keep_source:
        shutil.rmtree(src, ignore_errors=True)
    sys.exit(0 if all(isinstance(v, list) for v in res.values()) else 1)


if __name__ == "__main__":
    main()

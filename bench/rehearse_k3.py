"""Full-shape rehearsal of the Kimi K3 release: 93 layers, 896 routed experts (16 active, 2
shared), the release's head counts (96 attention / KDA heads) and vocabulary (163840),
converted with the ``kimi-k3-day0`` preset at its layout (tp8 pp2 ep8, 64 redundant experts)
and verified.

Why: the tests use a handful of experts and layers; what breaks or is slow at 896 experts
x 93 layers (83k expert triples, a manifest of hundreds of MB, per-tensor overheads) only
shows at that count. Only widths shrink (``synth --tiny`` widths: hidden 64, expert
widths 32, head dims 16): never layers, experts, heads or vocab.

Stages, each a fresh process (``_harness.measure``: wall time, the process's own peak
RSS): ``synth``, ``convert`` (its plan / calibrate / write / verify times from
report.json), ``plan`` (``k3convert plan --recipe kimi-k3-day0 --expert-load`` the
routing counts convert measured), then ``open_stream`` of each rank alone. The plan's
weights per rank must equal the tensor bytes the manifest lists for that rank, and the
bytes the unit files hold (asserted). Calibration and verify are run on fewer / shorter
sequences than the preset's (``--calib-samples`` ...): the layout is the preset's.

Usage: python bench/rehearse_k3.py --root /work/scratch23/rehearse [--layers 93]
       [--keep] [--only-open]   (re-measure open_stream of an existing rehearsal)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _harness import PY, measure

_OPEN = """
import json, sys, time
t0 = time.perf_counter()
from k3convert.stream import open_stream
t1 = time.perf_counter()
s = open_stream(sys.argv[1], ranks=[int(sys.argv[2])]) if sys.argv[3] == "rank" else \\
    open_stream(sys.argv[1])
t2 = time.perf_counter()
r = s.rank(int(sys.argv[2]))
n = len(r.names())
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "rank_s": time.perf_counter() - t2,
                  "names": n}))
"""

_BYTES = """
import json, sys
from pathlib import Path
from safetensors import safe_open
root = Path(sys.argv[1])
m = json.loads((root / "manifest.json").read_text())
for r in m["ranks"]:  # version 3: a rank's units are in its rank file
    if "units" not in r:
        r["units"] = json.loads((root / r["units_file"]).read_text())["units"]
size = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
        "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
def prod(s):
    n = 1
    for d in s:
        n *= d
    return n
listed, stored, units = [], [], 0
for r in m["ranks"]:
    a = b = 0
    for u in r["units"]:
        units += 1
        a += sum(size[t["dtype"]] * prod(t["shape"]) for t in u["tensors"])
        with safe_open(str(root / u["file"]), "pt") as f:
            for k in f.keys():
                if not k.startswith("__pad__"):
                    t = f.get_slice(k)
                    b += size[t.get_dtype()] * prod(t.get_shape())
    listed.append(a)
    stored.append(b)
print(json.dumps({"listed": listed, "stored": stored, "units": units}))
"""


def _k3(*args) -> list[str]:
    return [PY, "-m", "k3convert", *map(str, args)]


def _run(name: str, argv) -> tuple[float, float, str]:
    wall, rss, out, _ = measure(argv)
    print(f"  {name:<10} {wall:9.1f} s  peak RSS {rss:7.0f} MiB", flush=True)
    return wall, rss, out


def build(root: Path, a) -> dict:
    """synth + convert + plan; their times, RSS and what plan says per rank."""
    src, out = root / "k3", root / "k3.stream"
    ids = root / "ids.jsonl"
    ids.write_text("".join(
        json.dumps({"input_ids": [(7919 * i + 104729 * s) % 163840 for i in range(a.calib_seq)]})
        + "\n" for s in range(a.calib_samples)))  # fmt: skip
    res = {}
    res["synth"] = _run("synth", _k3("synth", "kimi-k3", src, "--tiny", "--layers", a.layers,
                                     "--experts", 896, "--topk", 16, "--heads", 96,
                                     "--vocab", 163840, "--force"))  # fmt: skip
    sets = {"quantize.calibrate.dataset": ids, "quantize.calibrate.num_samples": a.calib_samples,
            "quantize.calibrate.seq_len": a.calib_seq, "verify.samples": a.verify_samples,
            "verify.seq_len": a.verify_seq, "verify.decode": a.decode}  # fmt: skip
    argv = _k3("convert", src, out, "--recipe", "kimi-k3-day0", "--no-progress", "--force")
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    res["convert"] = _run("convert", argv)
    plan_json = root / "plan.json"
    res["plan"] = _run("plan", _k3("plan", src, "--recipe", "kimi-k3-day0", "--expert-load",
                                   out / "routing_counts.json", "--json", plan_json))  # fmt: skip
    return res


def open_times(out: Path, ranks, mode: str) -> list[dict]:
    """open_stream of ``out`` for each rank in a fresh process: of that rank alone
    (``mode`` "rank") or of the whole stream (``"all"``, what every rank paid before
    ``ranks=``), then ``rank(r)``."""
    got = []
    for r in ranks:
        _, rss, o, _ = measure([PY, "-c", _OPEN, str(out), str(r), mode])
        d = json.loads(o.strip().splitlines()[-1])
        d["rss"] = rss
        got.append(d)
        print(f"  open_stream rank {r} ({mode}): {d['open_s']:.2f} s + rank {d['rank_s']:.2f} s, "
              f"peak RSS {rss:.0f} MiB", flush=True)  # fmt: skip
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=93)
    ap.add_argument("--calib-samples", type=int, default=4)
    ap.add_argument("--calib-seq", type=int, default=32)
    ap.add_argument("--verify-samples", type=int, default=1)
    ap.add_argument("--verify-seq", type=int, default=16)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="leave the checkpoint and stream")
    ap.add_argument("--only-open", action="store_true", help="re-measure open_stream only")
    a = ap.parse_args()
    a.root.mkdir(parents=True, exist_ok=True)
    out = a.root / "k3.stream"
    print(f"load before: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    t0 = time.perf_counter()
    res = {} if a.only_open else build(a.root, a)
    report(a, res, out)
    print(f"load after: {Path('/proc/loadavg').read_text().strip()}; "
          f"{time.perf_counter() - t0:.0f} s in all")  # fmt: skip
    if not a.keep and not a.only_open:
        shutil.rmtree(a.root, ignore_errors=True)
    return 0


def report(a, res: dict, out: Path) -> None:
    man = out / "manifest.json"
    world = len(json.loads(man.read_text())["ranks"])
    for name, (wall, rss, _) in res.items():
        print(f"{name:<8} wall {wall:8.1f} s  peak RSS {rss:7.0f} MiB")
    if res:
        rep = json.loads((out / "report.json").read_text())
        print(f"\nconvert stages (report.json): {rep['seconds']}")
        print(f"verify: passed={rep['passed']}  sizes: {rep['sizes']}")
        assert rep["passed"], "verify failed"
    print(f"manifest: {man.stat().st_size / 1e6:.1f} MB")
    sizes = [f.stat().st_size / 1e6 for f in sorted(out.glob("rank*/units.json"))]
    if sizes:  # version 3: each rank's units in its own rank file
        print(f"rank files: {min(sizes):.1f} .. {max(sizes):.1f} MB each, {sum(sizes):.1f} MB")
    _, _, o, _ = measure([PY, "-c", _BYTES, str(out)])
    b = json.loads(o.strip().splitlines()[-1])
    print(f"units: {b['units']} ({b['units'] // world} per rank)")
    print(f"stream bytes per rank (listed): {b['listed']}")
    assert b["listed"] == b["stored"], (b["listed"], b["stored"])
    plan_json = a.root / "plan.json"
    if plan_json.exists():
        planned = [r["weights"] for r in json.loads(plan_json.read_text())["ranks"]]
        print(f"plan weights per rank:           {planned}  equal: {planned == b['listed']}")
        assert planned == b["listed"], "plan != the stream's per-rank bytes"
    for mode, ranks in (("rank", range(world)), ("all", [0])):
        try:
            open_times(out, ranks, mode)
        except RuntimeError as e:  # an older open_stream without ranks=
            print(f"  open_stream ({mode}): {str(e).splitlines()[-1]}")
    du = subprocess.run(["du", "-sb", str(out)], capture_output=True, text=True).stdout.split()[0]
    print(f"stream on disk: {int(du) / 1e6:.0f} MB")


if __name__ == "__main__":
    sys.exit(main())

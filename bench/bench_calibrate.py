"""Calibration (GPTQ) time per layer, peak RSS and quantized quality, against llm-compressor.

Speed / memory, on a llama-shaped bf16 checkpoint built by bench/_harness.py's
``build_llama`` (as bench_quant.py's; N(0, 0.02) weights, untied: hidden 768,
intermediate 2048, 12 heads, 4 KV heads, vocab 32000; --layers 8 = 99.5 M params, the
half depth 4 layers = 74.3 M),
calibrated on a pre-tokenized jsonl (``input_ids``, --samples x --seq-len random ids, each
row ending in EOS so k3convert's packing keeps the rows as they are: both tools see the
same tokens). Each stage a fresh process, interleaved A B C ... A B C ..., median of
--repeats (bench/_harness.py):

- k3convert gptq:       ``k3convert quantize SRC OUT --scheme w4a16 --calibrate --algorithm
                        gptq --dataset D --num-samples N --seq-len S`` (--layers and half of it);
                        time per layer: the median of the per-layer seconds it prints;
- llm-compressor GPTQ:  ``oneshot(model=SRC, dataset=<the same rows>, recipe=GPTQModifier(
                        scheme="W4A16", targets="Linear", ignore=["lm_head"]),
                        max_seq_length=S, num_calibration_samples=N)`` (its sequential
                        pipeline, on CPU); time per layer: the oneshot() call / layers;
- k3convert rtn:        ``quantize --scheme w4a16`` without calibration (a reference);
- ``--speed-scheme nvfp4a16 --speed-algorithm gptq+mse``: the same stages for NVFP4
  (llm-compressor's ``GPTQModifier(scheme="NVFP4A16")``; k3convert with
  ``--weight-observer mse``, its three sweeps a Linear).

Quality, on the trained llama fixture (tests/trained.py: a 4-layer hidden-128 model
trained on the built-in corpus, with its own tokenizer), calibrated on --q-samples x 128
tokens of the *training* documents (pre-tokenized, the same rows for both tools), judged
on the held-out documents (heldout_blocks, 128 tokens): per-token KL(bf16 || quantized)
mean, its standard error ("se": bootstrap over the held-out blocks; two rows whose means
differ by less than about twice it are not told apart by this text) and p99, top-1
agreement with the bf16 model, perplexity. Every output is evaluated
the same way: transformers loading OUT through its compressed-tensors integration (the
default ``from_pretrained``: weights dequantized, activations fake-quantized as the
checkpoint says, so static / dynamic input scales count); the "KLD w-only" column loads
it with ``CompressedTensorsConfig(dequantize=True)`` (weights only). A row that does not
load that way says so. Schemes x algorithms: w4a16 rtn/gptq/awq, w4a16-asym rtn/awq,
w8a8 rtn/smoothquant/smoothquant+gptq, fp8 static, fp8-dynamic rtn, and "+mse" rows
(``--weight-observer mse``: every group's range searched) of rtn / gptq (awq runs its
clip step, the activation-aware form of that search, by default), "+fpt" rows of gptq
(``--gptq-fp-target 0.5``: GPTAQ-style, the target moved half way to the full-precision
model's outputs);
llm-compressor where it has the same scheme + algorithm: GPTQ W4A16, AWQ W4A16_ASYM,
SmoothQuant+GPTQ W8A8, FP8 (static) via QuantizationModifier, NVFP4A16 / NVFP4 (RTN via
QuantizationModifier, GPTQ), each with its default
observer ("x llmc": a row's KLD over that llm-compressor row's, same seed; "s x llmc"
the same for the wall time).

NVFP4 rows (k3convert nvfp4a16 / nvfp4 with rtn, gptq, "+mse", "+fpt"; on the MoE
fixture also "+all": ``--moe-all-experts``, every expert calibrated on every token as
llm-compressor's default ``moe_calibrate_all_experts`` does) are evaluated by
k3convert's runtime for both tools (weights dequantized, NVFP4 activations
fake-quantized as compressed-tensors' ``forward_quantize``, against its own logits of the
unquantized model): transformers cannot run compressed FP4 in float32 on CPU and loads
NVFP4 MoE experts without their global scale; "KLD w-only" stays transformers'
(meaningless on the MoE fixture for that reason).

Seeds and repeats: ``--seeds 0 1`` calibrates every row on each seed's windows (seed 0:
the first 127-token windows of the training stream; another seed: windows drawn by
``random.Random(seed)``), written once per seed to a jsonl both tools read;
``--q-repeats 3`` runs each seed's rows interleaved three times, wall = the median
(the KLD is the last run's: both tools are deterministic on CPU). ``--fixture llama
deepseek_v3`` adds the MoE fixture (MLA, routed + shared experts; its widths need
group 32, so its rows use the int4-g32 schemes, and llm-compressor W4A16 group 128 cannot
run on it: its llm-compressor rows are the same modifiers with int4 group-32
``config_groups``; the per-channel W8A8 rows run on it as they are). ``--fixture
deepseek_v3+outliers`` / ``llama+outliers``: that fixture with outlier channels
(tests/outliers.py: 4 of its residual channels 32x larger at every norm's output, the
same function bit for bit), the structure SmoothQuant moves into the weights; the
trained 4-layer fixtures have little of it. "+as" rows: SmoothQuant with
``--alpha-search``; "+g0": with ``--sq-min-gain 0``. Smoothing with FP4: k3convert AWQ
(nvfp4a16, nvfp4) and SmoothQuant + GPTQ (nvfp4) against llm-compressor's AWQ NVFP4A16
and SmoothQuant (strength 0.5) + GPTQ NVFP4.

Targets (issue 9): k3convert GPTQ time <= llm-compressor's on the same model; KLD <=
llm-compressor's for the same scheme and algorithm; peak RSS flat as layers are added
(--layers vs half of it).

Caveats: llm-compressor is optional, never a dependency (--llmc-python,
$K3_BENCH_LLMC_PYTHON, or this interpreter; 0.14 needs ``accelerate`` installed beside it);
it is given the fixture tokenizer as processor (it requires one; the data is already
tokenized, so it only decides that). Random weights make the speed rows meaningful for
time and memory only. On a shared
2-core machine the per-layer time is dominated by torch's Cholesky calls (MKL/OpenMP
under CPU contention: 10x slower than on an idle machine) and varies between runs; use
--repeats >= 3 on a quiet machine. llm-compressor 0.14's GPTQModifier defaults to
actorder="static", as k3convert's act_order (on by default). Its AWQModifier pins its cached
activations for an accelerator copy, which raises "Cannot access accelerator device" on a
CPU-only machine: without an accelerator the script makes that pinning a no-op (pinning
only speeds a host-to-device copy up; no value changes).

    python bench/bench_calibrate.py [--repeats 3] [--samples 16] [--seq-len 256]
        [--quick] [--dir D] [--keep] [--llmc-python PY] [--skip-speed] [--skip-quality]
        [--only "w8a8,fp8"] [--reuse] [--json FILE]
        [--fixture llama deepseek_v3 deepseek_v3+outliers]
        [--seeds 0 1] [--q-repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from _harness import (
    PY,
    build_llama,
    interleaved,
    llmc_python,
    measure,
    rss_floor,
    versions,
    warm,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.trained: the trained fixture and its held-out split

#: the speed model's shape (bench/_harness.py build_llama: k3convert's synthesizer with
#: the llama3-8b layout, untied, BOS 0 / EOS 1)
SPEED_CFG = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_attention_heads=12,
    num_key_value_heads=4,
)
EOS = 1  # of the speed model and of the trained fixtures' tokenizer
Q_SEQ = 128  # the trained fixtures' context

#: llm-compressor recipes by key: (imports, recipe expression)
LLMC_RECIPES = {
    "GPTQ W4A16": (
        "from llmcompressor.modifiers.gptq import GPTQModifier",
        'GPTQModifier(scheme="W4A16", targets="Linear", ignore=["lm_head"])',
    ),
    "AWQ W4A16_ASYM": (
        "from llmcompressor.modifiers.awq import AWQModifier",
        'AWQModifier(scheme="W4A16_ASYM", targets=["Linear"], ignore=["lm_head"])',
    ),
    "SmoothQuant+GPTQ W8A8": (
        "from llmcompressor.modifiers.gptq import GPTQModifier\n"
        "from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier",
        '[SmoothQuantModifier(smoothing_strength=0.5), GPTQModifier(scheme="W8A8", '
        'targets="Linear", ignore=["lm_head"])]',
    ),
    "FP8 static": (
        "from llmcompressor.modifiers.quantization import QuantizationModifier",
        'QuantizationModifier(scheme="FP8", targets="Linear", ignore=["lm_head"])',
    ),
    # NVFP4: its presets (group 16 under a global scale; NVFP4 also quantizes the
    # activations, their global scale calibrated); the RTN rows are QuantizationModifier's
    "RTN NVFP4A16": (
        "from llmcompressor.modifiers.quantization import QuantizationModifier",
        'QuantizationModifier(scheme="NVFP4A16", targets="Linear", ignore=["lm_head"])',
    ),
    "GPTQ NVFP4A16": (
        "from llmcompressor.modifiers.gptq import GPTQModifier",
        'GPTQModifier(scheme="NVFP4A16", targets="Linear", ignore=["lm_head"])',
    ),
    "RTN NVFP4": (
        "from llmcompressor.modifiers.quantization import QuantizationModifier",
        'QuantizationModifier(scheme="NVFP4", targets="Linear", ignore=["lm_head"])',
    ),
    "GPTQ NVFP4": (
        "from llmcompressor.modifiers.gptq import GPTQModifier",
        'GPTQModifier(scheme="NVFP4", targets="Linear", ignore=["lm_head"])',
    ),
    # smoothing with NVFP4: AWQ (its scale search takes tensor_group) and SmoothQuant
    # (at its default strength) before GPTQ
    "AWQ NVFP4A16": (
        "from llmcompressor.modifiers.awq import AWQModifier",
        'AWQModifier(scheme="NVFP4A16", targets=["Linear"], ignore=["lm_head"])',
    ),
    "SmoothQuant+GPTQ NVFP4": (
        "from llmcompressor.modifiers.gptq import GPTQModifier\n"
        "from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier",
        '[SmoothQuantModifier(smoothing_strength=0.5), GPTQModifier(scheme="NVFP4", '
        'targets="Linear", ignore=["lm_head"])]',
    ),
}
#: the NVFP4 rows (group 16 tiles both fixtures' widths: the same recipes on the MoE one)
NVFP4_KEYS = ("RTN NVFP4A16", "GPTQ NVFP4A16", "RTN NVFP4", "GPTQ NVFP4", "AWQ NVFP4A16",
              "SmoothQuant+GPTQ NVFP4")  # fmt: skip


def _g32(modifier: str, symmetric: bool) -> str:
    """An llm-compressor modifier with int4 group-32 weights (the deepseek_v3 fixture's
    widths, 32 and 64, do not divide by its presets' 128)."""
    w = (f'{{"num_bits": 4, "type": "int", "symmetric": {symmetric}, "strategy": "group", '
         f'"group_size": 32}}')  # fmt: skip
    return (f'{modifier}(config_groups={{"group_0": {{"targets": ["Linear"], "weights": {w}}}}}, '
            f'ignore=["lm_head"])')  # fmt: skip


#: the deepseek_v3 fixture's recipes: the same algorithms at group 32
LLMC_RECIPES_G32 = {
    "GPTQ W4A16": (LLMC_RECIPES["GPTQ W4A16"][0], _g32("GPTQModifier", True)),
    "AWQ W4A16_ASYM": (LLMC_RECIPES["AWQ W4A16_ASYM"][0], _g32("AWQModifier", False)),
    "SmoothQuant+GPTQ W8A8": LLMC_RECIPES["SmoothQuant+GPTQ W8A8"],  # per channel: as is
    **{k: LLMC_RECIPES[k] for k in NVFP4_KEYS},
}
#: k3convert's schemes on the deepseek_v3 fixture (group 32, as its llm-compressor rows)
G32_SCHEMES = {"w4a16": "int4-g32", "w4a16-asym": "int4-g32-asym"}

#: quality rows: (k3convert scheme, algorithm, llm-compressor recipe key or None); an
#: algorithm "X+mse" is X with ``--weight-observer mse``, "X+fpt" X with
#: ``--gptq-fp-target 0.5``, "X+as" X with ``--alpha-search`` (the ratio column compares
#: them with the same llm-compressor row)
QUALITY = (
    ("w4a16", "rtn", None),
    ("w4a16", "rtn+mse", None),
    ("w4a16", "gptq", "GPTQ W4A16"),
    ("w4a16", "gptq+mse", "GPTQ W4A16"),
    ("w4a16", "gptq+fpt", "GPTQ W4A16"),
    ("w4a16", "gptq+mse+fpt", "GPTQ W4A16"),
    ("w4a16", "awq", None),
    ("w4a16-asym", "rtn", None),
    ("w4a16-asym", "rtn+mse", None),
    ("w4a16-asym", "awq", "AWQ W4A16_ASYM"),
    ("w8a8", "rtn", None),
    ("w8a8", "smoothquant", None),
    ("w8a8", "smoothquant+as", None),
    ("w8a8", "smoothquant+gptq", "SmoothQuant+GPTQ W8A8"),
    ("w8a8", "smoothquant+gptq+as", "SmoothQuant+GPTQ W8A8"),
    ("fp8", "static", "FP8 static"),
    ("fp8-dynamic", "rtn", None),
    ("nvfp4a16", "rtn", "RTN NVFP4A16"),
    ("nvfp4a16", "rtn+mse", "RTN NVFP4A16"),
    ("nvfp4a16", "gptq", "GPTQ NVFP4A16"),
    ("nvfp4a16", "gptq+mse", "GPTQ NVFP4A16"),
    ("nvfp4a16", "gptq+mse+fpt", "GPTQ NVFP4A16"),
    ("nvfp4", "static", "RTN NVFP4"),
    ("nvfp4", "gptq", "GPTQ NVFP4"),
    ("nvfp4", "gptq+mse", "GPTQ NVFP4"),
    ("nvfp4", "gptq+mse+fpt", "GPTQ NVFP4"),
    # smoothing with FP4 ("+g0": --sq-min-gain 0, every mapping that gains smoothed)
    ("nvfp4a16", "awq", "AWQ NVFP4A16"),
    ("nvfp4a16", "awq+mse", "AWQ NVFP4A16"),
    ("nvfp4", "awq", "GPTQ NVFP4"),
    ("nvfp4", "smoothquant+gptq", "SmoothQuant+GPTQ NVFP4"),
    ("nvfp4", "smoothquant+gptq+mse+as", "SmoothQuant+GPTQ NVFP4"),
    ("nvfp4", "smoothquant+gptq+mse+as+g0", "SmoothQuant+GPTQ NVFP4"),
    ("nvfp4", "smoothquant+gptq+mse+fpt+as+g0", "SmoothQuant+GPTQ NVFP4"),
    # MoE only: every expert calibrated on every token, as llm-compressor's default
    # (moe_calibrate_all_experts=True) does
    ("nvfp4a16", "gptq+all", "GPTQ NVFP4A16"),
    ("nvfp4a16", "gptq+mse+all", "GPTQ NVFP4A16"),
    ("nvfp4a16", "gptq+mse+fpt+all", "GPTQ NVFP4A16"),
    ("nvfp4", "gptq+mse+all", "GPTQ NVFP4"),
)

#: run in the llm-compressor interpreter: SRC OUT DATA N S PROCESSOR RECIPE-KEY
_LLMC = """
import json, sys, time
src, out, data, n, s, proc, key = sys.argv[1:8]
from datasets import Dataset
from transformers import AutoTokenizer
from llmcompressor import oneshot
import torch
if not torch.accelerator.is_available():  # 0.14 pins its cached activations for the copy
    # to an accelerator, which raises on a CPU-only machine (AWQ): pinning only speeds
    # that copy up, so without an accelerator it is skipped; the values are unchanged
    from llmcompressor.pipelines import cache as _cache
    _cache.IntermediatesCache.pin_memory = lambda self, *a, **k: None
{imports}
rows = [json.loads(line)["input_ids"] for line in open(data)]
ds = Dataset.from_dict({{"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}})
t0 = time.perf_counter()
oneshot(model=src, dataset=ds, recipe={recipe}, max_seq_length=int(s),
        num_calibration_samples=int(n), processor=AutoTokenizer.from_pretrained(proc),
        output_dir=out)
print(f"K3BENCH oneshot_s {{time.perf_counter() - t0}}")
"""


def llmc_argv(py, src, out, data, n, s, processor, key, recipes=None) -> list[str]:
    imports, recipe = (recipes or LLMC_RECIPES)[key]
    code = _LLMC.format(imports=imports, recipe=recipe)
    return [py, "-c", code, str(src), str(out), str(data), str(n), str(s), str(processor), key]


def k3_argv(src, out, scheme, algorithm=None, data=None, n=None, s=None) -> list[str]:
    argv = [PY, "-m", "k3convert", "quantize", str(src), str(out), "--scheme", scheme]
    if algorithm is not None and algorithm.endswith("+g0"):
        algorithm = algorithm.removesuffix("+g0")
        argv += ["--sq-min-gain", "0"]
    if algorithm is not None and algorithm.endswith("+as"):
        algorithm = algorithm.removesuffix("+as")
        argv += ["--alpha-search"]
    if algorithm is not None and algorithm.endswith("+all"):
        algorithm = algorithm.removesuffix("+all")
        argv += ["--moe-all-experts"]
    if algorithm is not None and algorithm.endswith("+fpt"):
        algorithm = algorithm.removesuffix("+fpt")
        argv += ["--gptq-fp-target", "0.5"]
    if algorithm is not None and algorithm.endswith("+mse"):
        algorithm = algorithm.removesuffix("+mse")
        argv += ["--weight-observer", "mse"]
    if algorithm not in (None, "rtn"):
        argv += ["--calibrate", "--algorithm", algorithm, "--dataset", str(data)]
        argv += ["--num-samples", str(n), "--seq-len", str(s)]
    return argv


# -- inputs ------------------------------------------------------------------------------
def build_speed_model(path: Path, layers: int) -> int:
    """The llama-shaped bf16 checkpoint (bench/_harness.py's builder, one file, written
    once); returns its parameter count."""
    c = SPEED_CFG
    total, _ = build_llama(path, layers=layers, files=1, hidden=c["hidden_size"],
                           intermediate=c["intermediate_size"], heads=c["num_attention_heads"],
                           kv_heads=c["num_key_value_heads"], vocab=c["vocab_size"])  # fmt: skip
    return total // 2  # bf16


def write_rows(path: Path, rows: list[list[int]]) -> None:
    """Pre-tokenized rows, each ending in EOS (k3convert's packing then appends nothing and
    cuts the stream back into the same rows)."""
    for r in rows:
        if len(r) != len(rows[0]) or r[-1] != EOS:
            raise ValueError("calibration rows must have one length and end in EOS")
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))


def speed_rows(n: int, s: int) -> list[list[int]]:
    rng = random.Random(0)
    vocab = SPEED_CFG["vocab_size"]
    return [[rng.randrange(3, vocab) for _ in range(s - 1)] + [EOS] for _ in range(n)]


#: --fixture choices: the trained fixtures, and the MoE one with outlier channels
FIXTURES = ("llama", "deepseek_v3", "llama+outliers", "deepseek_v3+outliers")


def fixture_model(kind: str, root: Path) -> Path:
    """The model directory of a --fixture choice. ``deepseek_v3+outliers`` (and
    ``llama+outliers``): the fixture with 4 of its residual channels 32x larger at every
    norm's output
    (tests/outliers.py: the same function bit for bit, the activation structure of
    larger trained models that SmoothQuant exists for), written under ``root`` once."""
    from tests.outliers import with_outlier_channels
    from tests.trained import trained_model

    base, _, variant = kind.partition("+")
    model = trained_model(base)
    if not variant:
        return model
    out = root / f"fixture-{base}-{variant}"
    if not (out / "outliers.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        with_outlier_channels(model, out)
    return out


def fixture_data(fixture: Path, n: int, seed: int = 0):
    """(calibration rows from the training documents, held-out [B, 128] blocks). The
    training stream is cut into 127-token windows (+ EOS); seed 0 takes the first ``n``,
    another seed ``n`` windows drawn by ``random.Random(seed)``, in stream order."""
    from transformers import AutoTokenizer

    from tests.trained import corpus_documents, heldout_blocks, split_corpus, token_stream

    tok = AutoTokenizer.from_pretrained(fixture)
    if tok.eos_token_id != EOS:
        raise ValueError(f"{fixture}: EOS id {tok.eos_token_id}, expected {EOS}")
    train, held = split_corpus(corpus_documents())
    stream = token_stream(tok, train).tolist()
    step = Q_SEQ - 1
    if len(stream) < n * step:
        raise ValueError(f"the training stream has {len(stream)} tokens, fewer than {n} rows")
    picks = range(n) if seed == 0 else sorted(random.Random(seed).sample(
        range(len(stream) // step), n))  # fmt: skip
    rows = [[*stream[i * step : (i + 1) * step], EOS] for i in picks]
    return rows, heldout_blocks(tok, held, Q_SEQ)


# -- quality -----------------------------------------------------------------------------
@torch.no_grad()
def logits_of(path: Path, blocks: torch.Tensor, **kw) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    return torch.cat(
        [model(input_ids=blocks[i : i + 16]).logits for i in range(0, len(blocks), 16)]
    )


#: bootstrap resamples of the held-out blocks for the KLD mean's standard error
BOOTSTRAP = 1000


def metrics(ref: torch.Tensor, q: torch.Tensor, blocks: torch.Tensor) -> dict:
    """Per-token KL(ref || q) mean, its standard error, p99, top-1 agreement, perplexity
    of ``q``. The standard error resamples whole held-out blocks (a block's tokens are
    not independent), with a fixed generator: the same logits give the same figure."""
    lp, lq = ref.log_softmax(-1), q.log_softmax(-1)
    per_block = (lp.exp() * (lp - lq)).sum(-1)
    kl = per_block.flatten()
    nll = -lq[:, :-1].gather(-1, blocks[:, 1:, None]).mean()
    g = torch.Generator().manual_seed(0)
    pick = torch.randint(0, len(per_block), (BOOTSTRAP, len(per_block)), generator=g)
    return {
        "kld_mean": kl.mean().item(),
        "kld_se": per_block.double().mean(1)[pick].mean(1).std().item(),
        "kld_p99": torch.quantile(kl, 0.99).item(),
        "top1": (ref.argmax(-1) == q.argmax(-1)).float().mean().item(),
        "ppl": math.exp(nll.item()),
    }


_RUNTIME_REF: dict = {}


def evaluate(out: Path, ref, blocks, src: Path | None = None, fp4: bool = False) -> dict:
    from transformers import CompressedTensorsConfig

    row: dict = {}
    if fp4 and src is not None:
        # NVFP4: transformers cannot run compressed FP4 in float32 on CPU (bf16 weights
        # against float32 inputs) and loads MoE experts without their global scale;
        # k3convert's runtime runs both tools' outputs the same way (weights dequantized,
        # NVFP4 activations fake-quantized as compressed-tensors' forward_quantize:
        # tests/test_formats_fp4.py holds it to transformers' bf16 logits), against its
        # own logits of the unquantized model; "KLD w-only" stays transformers'
        try:
            row.update(runtime_metrics(out, src, blocks))
            row["loaded"] = "k3convert runtime (NVFP4 activations fake-quantized)"
            q = logits_of(out, blocks,
                          quantization_config=CompressedTensorsConfig(dequantize=True))  # fmt: skip
            row["kld_wonly"] = metrics(ref, q, blocks)["kld_mean"]
        except Exception as e:
            row["loaded"] = row.get("loaded", "") + f"; failed: {type(e).__name__}: {str(e)[:80]}"
        return row
    try:
        row.update(metrics(ref, logits_of(out, blocks), blocks), loaded="transformers + ct")
    except Exception as e:
        row["loaded"] = f"default load failed: {type(e).__name__}"
        row["load_error"] = str(e)[:300]
    try:
        q = logits_of(out, blocks, quantization_config=CompressedTensorsConfig(dequantize=True))
        row["kld_wonly"] = metrics(ref, q, blocks)["kld_mean"]
        if "kld_mean" not in row:  # keep why the default load failed
            why = row["loaded"].removeprefix("default load failed: ")
            row.update(metrics(ref, q, blocks), loaded=f"transformers dequantize=True ({why})")
    except Exception as e:
        row["loaded"] = row.get("loaded", "") + f"; dequantize=True failed: {type(e).__name__}"
    if "kld_mean" not in row and src is not None and (out / "config.json").is_file():
        # transformers 5.24 cannot load an asymmetric int4 MoE (its fused experts meet
        # the packed zero points): k3convert's runtime evaluates it, weights dequantized
        # and activations fake-quantized as the checkpoint says (the agreement of the two
        # evaluators on what both load: tests/test_quant_oracle.py)
        try:  # against the runtime's own logits of the unquantized model
            row.update(runtime_metrics(out, src, blocks))
            row["loaded"] = f"k3convert runtime ({row['loaded']})"
        except Exception as e:
            row["loaded"] += f"; runtime failed: {type(e).__name__}: {str(e)[:80]}"
    return row


def runtime_metrics(out: Path, src: Path, blocks: torch.Tensor) -> dict:
    """:func:`metrics` of k3convert's runtime logits of ``out`` against its logits of the
    unquantized ``src`` (computed once per source)."""
    key = str(src)
    if key not in _RUNTIME_REF:
        _RUNTIME_REF[key] = runtime_logits(src, blocks)
    return metrics(_RUNTIME_REF[key], runtime_logits(out, blocks), blocks)


@torch.no_grad()
def runtime_logits(path: Path, blocks: torch.Tensor) -> torch.Tensor:
    from k3convert.checkpoint import open_checkpoint
    from k3convert.runtime.runtime import Runtime

    rt = Runtime(open_checkpoint(path), dtype="fp32", prefetch=False)
    try:
        return torch.cat([rt.forward(blocks[i : i + 16]) for i in range(0, len(blocks), 16)])
    finally:
        rt.close()


def quality(
    root: Path,
    llmc: str | None,
    n: int,
    only=None,
    reuse=False,
    save=None,
    *,
    fixture_kind: str = "llama",
    seeds=(0,),
    repeats: int = 1,
) -> tuple[list, str]:
    """Every quality row for every seed: each seed's calibration rows written once and
    given to both tools; the runs of one seed interleaved (A B C ... A B C ...)
    ``repeats`` times, wall the median, the last repeat's output evaluated."""
    fixture = fixture_model(fixture_kind, root)
    table: list = []
    blocks = None
    for seed in seeds:
        rows, blocks = fixture_data(fixture, n, seed)
        data = root / f"quality-{fixture_kind}-s{seed}.jsonl"
        write_rows(data, rows)
        ref = logits_of(fixture, blocks)
        runs = []
        moe = fixture_kind.startswith("deepseek_v3")
        recipes = LLMC_RECIPES_G32 if moe else LLMC_RECIPES
        for scheme, algo, key in QUALITY:
            if algo.endswith("+all") and not moe:
                continue
            if moe:  # group-wise schemes at group 32; per-channel W8A8 as it is
                if scheme not in G32_SCHEMES and scheme not in ("w8a8", "nvfp4a16", "nvfp4"):
                    continue
                scheme = G32_SCHEMES.get(scheme, scheme)
            runs.append((f"k3convert {scheme} {algo}",
                         k3_argv(fixture, None, scheme, algo, data, n, Q_SEQ), key))  # fmt: skip
            if key and llmc and not any(r[0].startswith("llm-compressor ") and r[2] == key
                                        for r in runs):  # fmt: skip
                argv = llmc_argv(llmc, fixture, None, data, n, Q_SEQ, fixture, key, recipes)
                runs.append((f"llm-compressor {key}" + (" g32" if moe else ""), argv, key))
        if only:
            runs = [r for r in runs if any(o in r[0] for o in only)]
        got: dict[str, dict] = {}
        for rep in range(repeats):
            for name, argv, key in runs:
                out = root / "q" / f"{fixture_kind}-s{seed}" / re.sub(r"[ +]", "_", name)
                row = got.setdefault(name, {"name": name, "seed": seed, "key": key, "walls": []})
                if "loaded" in row and row["loaded"].startswith("failed"):
                    continue
                print(f"  quality [{fixture_kind} seed {seed} run {rep + 1}/{repeats}]: "
                      f"{name} ...", flush=True)  # fmt: skip
                if reuse and (out / "config.json").is_file():
                    row["reused"] = True  # an earlier run's output: no wall / RSS
                    continue
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(Path(f"{out}.calib"), ignore_errors=True)
                cmd = [str(out) if a == "None" else a for a in argv]
                try:
                    wall, rss, _, _ = measure(cmd)
                except RuntimeError as e:
                    tail = [ln for ln in str(e).splitlines() if ln.strip()][-1].strip()
                    row["loaded"] = f"failed: {tail[:120]}"
                    continue
                row["walls"].append(wall)
                row["rss_mib"] = max(rss, row.get("rss_mib", 0))
        for name, _argv, _key in runs:
            row = got[name]
            out = root / "q" / f"{fixture_kind}-s{seed}" / re.sub(r"[ +]", "_", name)
            if row["walls"]:
                row["wall_s"] = statistics.median(row["walls"])
            if "loaded" not in row:
                fp4 = "nvfp4" in name.lower()
                row.update(evaluate(out, ref, blocks, fixture, fp4=fp4))
            table.append(row)
        for row in table:  # KLD over llm-compressor's for the same recipe and seed
            ref_row = next((r for r in table if r["seed"] == row["seed"] and r["key"]
                            and r["name"].startswith(f"llm-compressor {r['key']}")
                            and r["key"] == row["key"]), None)  # fmt: skip
            if ref_row is not None and "kld_mean" in row and "kld_mean" in ref_row:
                row["x_llmc"] = row["kld_mean"] / ref_row["kld_mean"]
                if "wall_s" in row and "wall_s" in ref_row:
                    row["t_x_llmc"] = row["wall_s"] / ref_row["wall_s"]
        if save:
            save(table)
    note = (
        f"trained {fixture_kind} fixture {fixture.name}; calibration {n} x {Q_SEQ} training "
        f"tokens per seed (seed 0: the first windows; others: a random sample), the same "
        f"rows file given to both tools; held-out {blocks.shape[0]} x {Q_SEQ} tokens; "
        f"wall: median of {repeats} interleaved run(s)"
    )
    return table, note


def print_quality(table: list, note: str) -> None:
    print(f"\n### Quality ({note})\n")
    cols = ["output", "seed", "KLD mean", "se", "x llmc", "KLD p99", "top-1", "ppl", "KLD w-only",
            "s", "s x llmc", "loaded by"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in table:
        if "kld_mean" not in r:
            print(f"| {r['name']} | {r['seed']} |" + " - |" * 9 + f" {r.get('loaded', '-')} |")
            continue
        wonly = f"{r['kld_wonly']:.5f}" if "kld_wonly" in r else "-"
        ratio = f"{r['x_llmc']:.3f}" if "x_llmc" in r else "-"
        se = f"{r['kld_se']:.5f}" if "kld_se" in r else "-"
        cells = [r["name"], str(r["seed"]), f"{r['kld_mean']:.5f}", se, ratio,
                 f"{r['kld_p99']:.4f}", f"{r['top1']:.4f}"]  # fmt: skip
        wall = f"{r['wall_s']:.1f}" if "wall_s" in r else "-"
        tx = f"{r['t_x_llmc']:.2f}" if "t_x_llmc" in r else "-"
        cells += [f"{r['ppl']:.3f}", wonly, wall, tx, r["loaded"]]
        print("| " + " | ".join(cells) + " |")


# -- speed -------------------------------------------------------------------------------
_PER_LAYER = re.compile(
    r"calibration \((\w[\w+]*)\): (\d+) layer\(s\), ([\d.]+) s; per layer: (.*)"
)


#: --speed-scheme -> the llm-compressor recipe timed against it
SPEED_LLMC = {"w4a16": "GPTQ W4A16", "nvfp4a16": "GPTQ NVFP4A16", "nvfp4": "GPTQ NVFP4"}


def speed(root: Path, llmc: str | None, a) -> tuple[dict, dict, str]:
    from tests.trained import trained_model

    depths = (a.layers, a.layers // 2)
    srcs, params = {}, {}
    for d in depths:
        srcs[d] = root / f"llama-{d}L"
        params[d] = build_speed_model(srcs[d], d)
    data = root / "speed.jsonl"
    write_rows(data, speed_rows(a.samples, a.seq_len))
    processor = trained_model("llama")  # llm-compressor requires a processor; see the doc
    outs: dict = {}

    def out(name: str) -> Path:
        outs[name] = root / "out" / name.replace(" ", "_")
        return outs[name]

    n, s = a.samples, a.seq_len
    scheme, algo = a.speed_scheme, a.speed_algorithm
    key = SPEED_LLMC[scheme]
    stages = []
    for d in depths:
        name = f"k3convert gptq {d}L"
        argv = k3_argv(srcs[d], out(name), scheme, algo, data, n, s)
        stages.append((name, argv, " ".join(argv[3:4] + argv[6:8]) + f" ({algo})"))
        if d == a.layers or a.llmc_both_depths:
            name = f"llm-compressor GPTQ {d}L"
            why = "llm-compressor: not available (no interpreter imports llmcompressor)"
            argv = llmc and llmc_argv(llmc, srcs[d], out(name), data, n, s, processor, key)
            stages.append((name, argv, f"oneshot {key}" if llmc else why))
    name = f"k3convert rtn {a.layers}L"
    stages.append((name, k3_argv(srcs[a.layers], out(name), scheme), f"quantize --scheme {scheme}"))

    per_layer: dict[str, list[float]] = {}

    def on_output(name: str, stdout: str, stderr: str) -> None:
        layers = int(re.search(r"(\d+)L$", name).group(1))
        if m := _PER_LAYER.search(stdout):
            secs = [float(x.split(": ")[1].removesuffix(" s")) for x in m.group(4).split(", ")]
            per_layer.setdefault(name, []).append(statistics.median(secs))
        elif m := re.search(r"K3BENCH oneshot_s ([\d.]+)", stdout):
            per_layer.setdefault(name, []).append(float(m.group(1)) / layers)

    def reset(name: str) -> None:
        shutil.rmtree(outs.get(name, root / "none"), ignore_errors=True)
        shutil.rmtree(Path(f"{outs.get(name, root / 'none')}.calib"), ignore_errors=True)

    (root / "out").mkdir(exist_ok=True)
    warm(p for d in depths for p in srcs[d].iterdir())
    results = interleaved(stages, a.repeats, reset, on_output=on_output)
    note = (
        f"{scheme}, k3convert {algo}; llama-shaped bf16, hidden 768, intermediate 2048, "
        "vocab 32000; "
        + ", ".join(f"{d} layers = {params[d] / 1e6:.1f} M params" for d in depths)
        + f"; calibration {n} x {s} tokens; repeats {a.repeats}; "
        f"peak RSS floor {rss_floor():.0f} MiB (the launcher's)"
    )
    return results, per_layer, note


def print_speed(results: dict, per_layer: dict, note: str) -> None:
    print(f"\n### Speed / memory ({note})\n")
    cols = ["stage", "median s", "min s", "s / layer (median)", "peak RSS MiB", "vs cmp"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    med = {
        k: statistics.median(w for w, _ in v)
        for k, v in results.items()
        if isinstance(v, list) and v
    }
    for name, runs in results.items():
        if isinstance(runs, str) or not runs:
            print(f"| {name} | {runs or 'no run'} | | | | |")
            continue
        pl = per_layer.get(name)
        cmp = "-"
        if name.startswith("k3convert gptq"):
            other = med.get(name.replace("k3convert gptq", "llm-compressor GPTQ"))
            cmp = f"{other / med[name]:.2f}" if other else "-"
        cells = [name, f"{med[name]:.1f}", f"{min(w for w, _ in runs):.1f}"]
        cells += [
            f"{statistics.median(pl):.2f}" if pl else "-",
            f"{max(r for _, r in runs):.0f}",
            cmp,
        ]
        print("| " + " | ".join(cells) + " |")
    print(
        "\ns / layer: k3convert's printed per-layer calibration seconds (median over layers, "
        "then over runs); llm-compressor's oneshot() call (load + calibrate + save) / layers. "
        "vs cmp: llm-compressor's median / k3convert's (> 1: k3convert faster)."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8, help="the full depth (half also run)")
    ap.add_argument("--samples", type=int, default=16, help="speed: calibration samples")
    ap.add_argument("--seq-len", type=int, default=256, help="speed: tokens per sample")
    ap.add_argument("--q-samples", type=int, default=32, help="quality: samples of 128 tokens")
    ap.add_argument(
        "--fixture",
        nargs="+",
        default=["llama"],
        choices=list(FIXTURES),
        help="quality: the trained fixture(s)",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="quality: calibration window seeds (0: the first windows)",
    )
    ap.add_argument(
        "--q-repeats",
        type=int,
        default=1,
        help="quality: interleaved runs per row (wall: their median)",
    )
    ap.add_argument("--quick", action="store_true", help="1 repeat, 4 layers, 4 x 128 tokens")
    ap.add_argument(
        "--speed-scheme",
        default="w4a16",
        choices=sorted(SPEED_LLMC),
        help="speed: the scheme (llm-compressor's GPTQ preset of it alongside)",
    )
    ap.add_argument(
        "--speed-algorithm",
        default="gptq",
        help="speed: k3convert's algorithm row (gptq, gptq+mse, gptq+mse+fpt)",
    )
    ap.add_argument("--llmc-both-depths", action="store_true", help="llm-compressor at both")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--only", help="quality: comma-separated substrings of the rows to run")
    ap.add_argument("--reuse", action="store_true", help="quality: keep outputs already in --dir")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--dir", type=Path, help="work dir (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the default temp dir")
    ap.add_argument("--llmc-python", help="an interpreter that can import llmcompressor")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.layers, a.samples, a.seq_len, a.q_samples = 1, 4, 4, 128, 8

    root = a.dir or Path(tempfile.mkdtemp(prefix="bench_calibrate_"))
    root.mkdir(parents=True, exist_ok=True)
    llmc = llmc_python(a.llmc_python)
    print(f"k3convert: {versions(PY, 'k3convert', 'torch', 'transformers', 'compressed-tensors')}")
    if llmc:
        print(f"llm-compressor: {versions(llmc, 'llmcompressor', 'compressed-tensors', 'torch')}")
    else:
        print("llm-compressor: not available (no interpreter imports llmcompressor; "
              "--llmc-python or $K3_BENCH_LLMC_PYTHON)")  # fmt: skip
    report: dict = {}

    def save() -> None:  # after each part, so a later failure keeps what was measured
        if a.json:
            a.json.write_text(json.dumps(report, indent=1))

    if not a.skip_speed:
        results, per_layer, note = speed(root, llmc, a)
        report["speed"] = {"note": note, "runs": results, "seconds_per_layer": per_layer}
        save()
        print_speed(results, per_layer, note)
    if not a.skip_quality:

        def partial(rows: list) -> None:  # the fixture being measured, so far
            report["quality_partial"] = {"rows": rows}
            save()

        only = [o.strip() for o in a.only.split(",")] if a.only else None
        report["quality"] = {}
        for kind in a.fixture:
            table, note = quality(
                root,
                llmc,
                a.q_samples,
                only,
                a.reuse,
                partial,
                fixture_kind=kind,
                seeds=a.seeds,
                repeats=a.q_repeats,
            )
            report["quality"][kind] = {"note": note, "rows": table}
            save()
            print_quality(table, note)
    if a.dir is None and not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    elif a.keep:
        print(f"kept {root}")


if __name__ == "__main__":
    main()

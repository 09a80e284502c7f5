"""The trained fixtures (tests/trained.py): they load like a release, learned the corpus
(held-out perplexity far below the unigram baseline), grew outlier channels, and a
second call is a cache hit. The first run on a machine trains both models (minutes)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from k3convert.arch import resolve, validate_source
from k3convert.checkpoint.reader import open_checkpoint
from tests.trained import (  # noqa: F401  (fixtures)
    DETERMINISTIC_ENV,
    MARKER,
    RECIPES,
    REFERENCE,
    VOCAB,
    corpus_documents,
    heldout_blocks,
    outlier_ratios,
    perplexity,
    split_corpus,
    token_stream,
    trained_dsv3,
    trained_llama,
    trained_model,
    unigram_perplexity,
    versions_key,
)

ROOT = Path(__file__).resolve().parents[1]
#: least growth of the largest down_proj outlier ratio, random init -> trained
GROWTH = {"llama": 1.6, "deepseek_v3": 1.1}


@pytest.fixture(params=["llama", "deepseek_v3"])
def trained(request) -> tuple[str, Path]:
    fixture = {"llama": "trained_llama", "deepseek_v3": "trained_dsv3"}[request.param]
    return request.param, request.getfixturevalue(fixture)


def test_loads_like_a_release(trained):
    name, d = trained
    ck = open_checkpoint(d)
    arch, cfg = resolve(ck.config)
    matched = validate_source(arch, cfg, ck, str(d))
    assert len(matched) == len(ck.names()) > 0
    assert ck.config["model_type"] == name
    dtypes = {p.dtype for n in ck.names() for p in ck.meta(n).parts.values()}
    assert dtypes == {torch.bfloat16}, dtypes

    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert len(tok) == VOCAB
    text = "def f(x):\n    return x ** 2  # a comment"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is a list?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<|user|>\nWhat is a list?<|eos|>\n<|assistant|>\n"


def test_heldout_perplexity_beats_unigram(trained):
    name, d = trained
    train_docs, held_docs = split_corpus(corpus_documents())
    rows = [json.loads(line) for line in (d / "heldout.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == held_docs
    assert not set(held_docs) & set(train_docs)

    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    blocks = heldout_blocks(tok, held_docs)
    assert blocks.shape[0] >= 50
    ppl = perplexity(model, blocks)
    uni = unigram_perplexity(token_stream(tok, train_docs), blocks)
    metrics = json.loads((d / MARKER).read_text())
    assert ppl == pytest.approx(metrics["heldout_ppl"], rel=1e-3)
    assert uni == pytest.approx(metrics["unigram_ppl"], rel=1e-9)
    assert 100 < uni < 1000  # a byte-level BPE-1024 unigram model of English + code
    assert ppl < 0.35 * uni, (name, ppl, uni)


def test_trained_down_proj_has_outlier_channels(trained):
    """max/median of the per-channel input absmax at down_proj (dense MLPs, shared
    experts) on 32 held-out blocks: about 2.5-3.5 at random init. Training must raise the
    largest one by GROWTH (measured: llama 3.5 -> 7.0; the tiny MoE only 2.7 -> 3.3, its
    300 steps grow no strong outlier channels yet)."""
    name, d = trained
    _, held_docs = split_corpus(corpus_documents())
    tok = transformers.AutoTokenizer.from_pretrained(d)
    blocks = heldout_blocks(tok, held_docs)[:32]
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    trained_r = outlier_ratios(model, blocks)
    torch.manual_seed(RECIPES[name].seed)
    init = transformers.AutoModelForCausalLM.from_config(model.config).float().eval()
    init_r = outlier_ratios(init, blocks)
    assert trained_r.keys() == init_r.keys() and trained_r
    assert max(init_r.values()) < 5
    assert max(trained_r.values()) > GROWTH[name] * max(init_r.values()), (trained_r, init_r)


def test_second_call_is_a_cache_hit(request):
    for name, fixture in (("llama", "trained_llama"), ("deepseek_v3", "trained_dsv3")):
        d = request.getfixturevalue(fixture)
        t0 = time.perf_counter()
        again = trained_model(name)
        dt = time.perf_counter() - t0
        assert again == d and dt < 2.0, (name, dt)
        assert d.name.startswith(f"{name}-")


def test_concurrent_builds_train_once(tmp_path):
    """Two processes asking for the same (3-step) recipe at once: one trains, the other
    waits on the lock and reuses it; no temporary directory is left behind."""
    code = (
        "import dataclasses, sys; from tests.trained import RECIPES, trained_model; "
        "r = dataclasses.replace(RECIPES['llama'], name='smoke', steps=3, warmup=1, batch=2); "
        "print(trained_model(r))"
    )
    env = dict(os.environ, K3_FIXTURE_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    d = Path(outs[0])
    assert d.parent == tmp_path and (d / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [d.name, d.name + ".lock"]
    built = json.loads((d / MARKER).read_text())
    assert built["recipe"] == dataclasses.asdict(
        dataclasses.replace(RECIPES["llama"], name="smoke", steps=3, warmup=1, batch=2)
    )


def test_weights_are_the_reference_bytes(trained):
    """Training is independent of ATen's kernels, threads and the caller's settings
    (tests/trained.py, DETERMINISTIC_ENV): with the library versions of a reference entry,
    a machine builds exactly the bytes of one of its variants. Variants (``measured_on``)
    are CPU families whose MKL still rounds differently under ``MKL_CBWR=COMPATIBLE``: the
    AMD EPYCs (AVX2, AVX-512) give one model, an Intel Xeon with AMX another (its own
    builds agree under ATen capability default / avx2 / avx512). A digest in no variant
    fails: the fixture changed."""
    name, d = trained
    metrics = json.loads((d / MARKER).read_text())
    for f, digest in metrics["sha256"].items():
        assert hashlib.sha256((d / f).read_bytes()).hexdigest() == digest, f
    refs = json.loads(REFERENCE.read_text())
    key = versions_key()
    if key not in refs:
        pytest.skip(f"no reference digests for {key} in {REFERENCE.name} (add this machine's)")
    variants = refs[key] if isinstance(refs[key], list) else [refs[key]]
    got = [v.get("measured_on", "?") for v in variants if v.get(name) == metrics["sha256"]]
    assert got, (name, key, metrics["sha256"], [v.get("measured_on") for v in variants])


def test_training_ignores_the_callers_cpu_settings(tmp_path):
    """The trainer's environment overrides the caller's: a 3-step recipe trained from a
    parent with ATen's AVX2 kernels and 2 threads, and from one with the portable kernels
    and 1 thread, gives the same weights; build() refuses to run outside that environment."""
    code = (
        "import dataclasses; from tests.trained import RECIPES, trained_model; "
        "r = dataclasses.replace(RECIPES['llama'], name='iso', steps=3, warmup=1, batch=2); "
        "print(trained_model(r))"
    )
    procs = []  # the two parents side by side (each trainer pins its own threads)
    for i, (cap, threads) in enumerate((("avx2", "2"), ("default", "1"))):
        env = dict(os.environ, K3_FIXTURE_CACHE=str(tmp_path / str(i)), PYTHONPATH=str(ROOT),
                   ATEN_CPU_CAPABILITY=cap, OMP_NUM_THREADS=threads, MKL_CBWR="AUTO")  # fmt: skip
        pipe = subprocess.PIPE
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                                      stdout=pipe, stderr=pipe, text=True))  # fmt: skip
    digests = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        d = Path(out.strip())
        digests.append(hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest())
        assert json.loads((d / MARKER).read_text())["environment"] == DETERMINISTIC_ENV
    assert digests[0] == digests[1]
    env = {k: v for k, v in os.environ.items() if k not in DETERMINISTIC_ENV}
    r = subprocess.run(
        [sys.executable, "-m", "tests.trained", json.dumps({"name": "x", "model_class": "x"}),
         str(tmp_path / "x")], env=dict(env, PYTHONPATH=str(ROOT)), cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0 and "DETERMINISTIC_ENV" in r.stderr, r.stderr[-2000:]

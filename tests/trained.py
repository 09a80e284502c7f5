"""Small TRAINED test models (llama and deepseek_v3 families) for calibration quality tests.

Random weights have no outlier channels and no preferred directions, so GPTQ / AWQ /
SmoothQuant cannot be judged on them. These models learned something: each is a tiny
transformers model (``LlamaForCausalLM``, ``DeepseekV3ForCausalLM``) trained for a few
hundred AdamW steps on the CPython ``pydoc_data.topics`` corpus, with its own byte-level
BPE tokenizer (vocab 1024, trained with ``tokenizers``).

The trained weights are the same bytes on every x86-64 machine: training runs in a
subprocess whose environment pins every CPU-dependent choice of the float arithmetic
(:data:`DETERMINISTIC_ENV`: ATen's portable kernels instead of its AVX2 / AVX512 ones,
MKL's conditional-numerical-reproducibility mode ``COMPATIBLE``, one thread), and
``trained.json`` records the sha256 of the weights, which ``tests/test_trained_fixture.py``
compares with the reference digests in ``tests/trained_reference.json`` (measured for
the library versions named there). The quality figures measured on the fixtures then differ between
machines only by what the code under test computes, never by the model it starts from.

Each model is trained once per machine and cached in
``$K3_FIXTURE_CACHE/<name>-<key>`` (default root ``~/.cache/k3convert/fixtures``). The key
hashes the recipe, the corpus text, the torch / transformers / tokenizers versions and
this file's source, so any change retrains. A build happens in a temporary directory next
to the final one and is renamed into place when complete; an exclusive ``flock`` on
``<name>-<key>.lock`` makes a concurrent second process wait and then reuse the result.

A model directory holds what ``save_pretrained`` writes (``config.json``,
``model.safetensors`` in **bfloat16**, like a release), the tokenizer files (with a chat
template), ``heldout.jsonl`` (the last 10 % of the corpus documents, never trained on,
one ``{"text": ...}`` per line) and ``trained.json`` (the recipe and the measured
numbers: held-out perplexity, unigram baseline, down_proj outlier ratios, train time).
``trained.json`` is written last: its presence marks a complete build.

Use from a test module::

    from tests.trained import trained_llama, trained_dsv3  # noqa: F401  (fixtures)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from k3convert.errors import OutputError

VOCAB = 1024
SEQ_LEN = 128
HELDOUT_FRACTION = 0.10
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MARKER = "trained.json"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights (all of it goes into the cache key)."""

    name: str
    model_class: str
    config: dict = field(default_factory=dict)
    steps: int = 300
    batch: int = 16
    seq_len: int = SEQ_LEN
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.0  # 0.1 measured flatter down_proj inputs (dsv3 2.8 vs 3.4)
    seed: int = 0
    threads: int = 1  # part of DETERMINISTIC_ENV: one thread, one summation order


#: The training subprocess's environment: what makes the weights independent of the CPU.
#: ATen picks AVX512 / AVX2 / portable kernels at start-up, and they round differently
#: (vectorised reductions sum in another order; Sleef's exp / tanh are not libm's): the
#: portable ones run on every x86-64. MKL picks its GEMM code path by CPU, and only
#: ``MKL_CBWR=COMPATIBLE`` (its SSE2 branch, "the same results on Intel and non-Intel
#: processors") makes the products identical across vendors and generations. oneDNN is
#: capped the same way in case an op reaches it. Threads are fixed (MKL's reproducibility
#: holds for a fixed thread count; one thread also rules out OpenMP chunking). Measured on
#: an AVX512 EPYC: 20 AdamW steps of the llama recipe give the same weights at 1 and 2
#: threads and under ATEN_CPU_CAPABILITY=default / avx2 / avx512 in the parent, while
#: without this environment the three capabilities give three different models.
DETERMINISTIC_ENV = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_DYNAMIC": "FALSE",
}

#: sha256 of each fixture's files as trained in DETERMINISTIC_ENV, per library versions:
#: a machine with those versions must build exactly these bytes (tested). Kept outside
#: this file, whose source is part of the cache key.
REFERENCE = Path(__file__).with_name("trained_reference.json")


_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_attention_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

RECIPES: dict[str, Recipe] = {
    "llama": Recipe(
        name="llama",
        model_class="LlamaForCausalLM",
        config=dict(
            _COMMON,
            num_hidden_layers=4,
            num_key_value_heads=2,
            intermediate_size=384,
        ),
    ),
    "deepseek_v3": Recipe(
        name="deepseek_v3",
        model_class="DeepseekV3ForCausalLM",
        config=dict(
            _COMMON,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            intermediate_size=384,
            moe_intermediate_size=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_nextn_predict_layers=0,
        ),
    ),
}


# -- corpus ------------------------------------------------------------------------------
def corpus_documents() -> list[str]:
    """The training corpus, one string per document, in a fixed order.

    ``k3convert.calibrate.data.builtin_corpus()`` when the package has it, else the
    ``pydoc_data.topics`` texts sorted by topic name (the same source)."""
    try:
        from k3convert.calibrate.data import builtin_corpus
    except ImportError:
        from pydoc_data.topics import topics

        docs = [topics[k] for k in sorted(topics)]
    else:
        docs = list(builtin_corpus())
    docs = [d for d in docs if d.strip()]
    if len(docs) < 10:
        raise OutputError(
            f"the fixture corpus has {len(docs)} non-empty documents; at least 10 are needed "
            "for a 10 % held-out split. Check k3convert.calibrate.data.builtin_corpus()."
        )
    return docs


def split_corpus(docs: list[str]) -> tuple[list[str], list[str]]:
    """(train, held-out): the held-out part is the last 10 % of the documents."""
    n_held = max(1, round(len(docs) * HELDOUT_FRACTION))
    return docs[:-n_held], docs[-n_held:]


# -- cache -------------------------------------------------------------------------------
def cache_root() -> Path:
    env = os.environ.get("K3_FIXTURE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "k3convert" / "fixtures"


def recipe_key(recipe: Recipe, docs: list[str]) -> str:
    """sha256 (16 hex digits) of the recipe, corpus, library versions and this file."""
    import tokenizers
    import transformers

    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode())
    for v in (torch.__version__, transformers.__version__, tokenizers.__version__):
        h.update(b"\0" + v.encode())
    h.update(b"\0" + Path(__file__).read_bytes())
    for d in docs:
        h.update(b"\0" + d.encode())
    return h.hexdigest()[:16]


def _recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise KeyError(f"no trained fixture {recipe!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[recipe]


def trained_model(recipe: str | Recipe) -> Path:
    """The directory of the trained model ``recipe`` ("llama", "deepseek_v3" or a
    :class:`Recipe`), trained on the first call on this machine (minutes) and read from
    the cache afterwards."""
    return trained_models([recipe])[0]


def trained_models(recipes: list[str | Recipe]) -> list[Path]:
    """:func:`trained_model` of several recipes; the missing ones train at the same time,
    one single-threaded process each (the two fixtures take one core each instead of
    one after the other)."""
    docs = corpus_documents()
    root = cache_root()
    todo = [(r, root / f"{r.name}-{recipe_key(r, docs)}") for r in map(_recipe, recipes)]
    if all((final / MARKER).is_file() for _, final in todo):
        return [final for _, final in todo]
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(
            f"cannot create the fixture cache {root}: {e}. Set K3_FIXTURE_CACHE to a "
            "writable directory."
        ) from e
    with contextlib.ExitStack() as stack:
        builds = []
        for recipe, final in todo:
            lock = stack.enter_context(open(final.with_name(final.name + ".lock"), "a+"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then reuses
            if (final / MARKER).is_file() or any(f == final for _, f, _ in builds):
                continue
            if final.exists():
                raise OutputError(
                    f"{final} exists but has no {MARKER} (an interrupted or foreign build); "
                    "delete that directory and rerun."
                )
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)  # no-op once renamed
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
            proc, log = _start_build(recipe, tmp)
            stack.callback(proc.kill)  # an interrupted wait leaves no trainer running
            stack.callback(log.close)
            builds.append((recipe, final, (proc, log, tmp)))
        for recipe, final, (proc, log, tmp) in builds:
            _finish_build(recipe, proc, log, tmp)
            os.rename(tmp, final)
    return [final for _, final in todo]


def _start_build(recipe: Recipe, out: Path) -> tuple[subprocess.Popen, typing.IO[bytes]]:
    """:func:`build` in a fresh interpreter with :data:`DETERMINISTIC_ENV` and
    ``OMP_WAIT_POLICY=PASSIVE``.

    Both are read once at start-up, hence the process. On a shared 2-core machine,
    OpenMP's default spin-waiting makes a step about 10x slower whenever another process
    holds a core (measured 5.0 s vs 0.6 s per 2-thread step)."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    env.update(DETERMINISTIC_ENV)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(recipe.threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    arg = json.dumps(dataclasses.asdict(recipe))
    log = tempfile.TemporaryFile()  # noqa: SIM115  (closed by the caller's ExitStack)
    # a file, not a pipe: two trainers never block on a full pipe
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.trained", arg, str(out)],
        env=env,
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    return proc, log


def _finish_build(recipe: Recipe, proc: subprocess.Popen, log: typing.IO[bytes], out: Path):
    proc.wait()
    if proc.returncode != 0 or not (out / MARKER).is_file():
        log.seek(0)
        err = log.read().decode(errors="replace")
        raise RuntimeError(
            f"training the {recipe.name} fixture into {out} failed (exit {proc.returncode}):"
            f"\n{err[-4000:]}"
        )


@pytest.fixture(scope="session")
def trained_llama() -> Path:
    """Directory of the trained tiny LlamaForCausalLM (bf16 safetensors + tokenizer)."""
    return trained_models(list(RECIPES))[0]  # both fixtures train at once on a new machine


@pytest.fixture(scope="session")
def trained_dsv3() -> Path:
    """Directory of the trained tiny DeepseekV3ForCausalLM (MLA, 8 experts top-2)."""
    return trained_models(list(RECIPES))[1]


# -- tokenizer and data --------------------------------------------------------------------
def train_tokenizer(train_docs: list[str], out: Path):
    """Byte-level BPE (vocab ``VOCAB``) saved so ``AutoTokenizer.from_pretrained(out)``
    loads it; returns the transformers tokenizer. No special token is added on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=_COMMON["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    """All documents tokenized and joined, each followed by EOS: a 1-D LongTensor."""
    ids: list[int] = []
    for d in docs:
        ids.extend(tok(d, add_special_tokens=False, verbose=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def heldout_blocks(tok, docs: list[str], seq_len: int = SEQ_LEN) -> torch.Tensor:
    """The held-out stream cut into non-overlapping ``[N, seq_len]`` blocks."""
    s = token_stream(tok, docs)
    n = s.numel() // seq_len
    return s[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch: int = 16) -> float:
    """exp(mean next-token cross-entropy) over every position 1..S-1 of every block."""
    total, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch):
        x = blocks[i : i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        tgt = x[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += tgt.numel()
    return math.exp(total / count)


def unigram_perplexity(train: torch.Tensor, blocks: torch.Tensor, vocab: int = VOCAB) -> float:
    """Perplexity of the add-one unigram model of the training stream on the same
    held-out targets :func:`perplexity` scores."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    tgt = blocks[:, 1:].reshape(-1)
    return math.exp(-logp[tgt].mean().item())


def down_proj_modules(model) -> dict[str, torch.nn.Module]:
    """name -> every ``down_proj`` Linear (dense MLPs and shared experts)."""
    return {
        n: m
        for n, m in model.named_modules()
        if n.endswith("down_proj") and isinstance(m, torch.nn.Linear)
    }


@torch.no_grad()
def outlier_ratios(model, blocks: torch.Tensor, batch: int = 16) -> dict[str, float]:
    """down_proj name -> max / median over input channels of the per-channel absmax of
    its input on ``blocks``. Trained LMs show a few channels far above the rest."""
    mods = down_proj_modules(model)
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def f(_m, args):
            a = args[0].detach().float().abs().reshape(-1, args[0].shape[-1]).amax(0)
            amax[name] = torch.maximum(amax[name], a) if name in amax else a

        return f

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in mods.items()]
    try:
        for i in range(0, blocks.shape[0], batch):
            model(input_ids=blocks[i : i + batch])
    finally:
        for h in handles:
            h.remove()
    return {n: (a.max() / a.median()).item() for n, a in amax.items()}


@contextlib.contextmanager
def _threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tokenizers_version() -> str:
    import tokenizers

    return tokenizers.__version__


def versions_key() -> str:
    """The key of :data:`REFERENCE` for this machine's libraries."""
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, " + (
        f"tokenizers {_tokenizers_version()}"
    )


# -- training --------------------------------------------------------------------------------
def build(recipe: Recipe, docs: list[str], out: Path) -> dict:
    """Train ``recipe`` on ``docs`` (minus the held-out split) and save everything into
    ``out``; returns the metrics also written to ``out/trained.json``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT" or any(
        os.environ.get(k) != v for k, v in DETERMINISTIC_ENV.items()
    ):
        raise RuntimeError(
            "build() must run in DETERMINISTIC_ENV (use trained_model(), which starts it in "
            "a subprocess with that environment): the weights would depend on this CPU."
        )
    torch.use_deterministic_algorithms(True)
    t0 = time.perf_counter()
    train_docs, held_docs = split_corpus(docs)
    with open(out / "heldout.jsonl", "w", encoding="utf-8") as f:
        for d in held_docs:
            f.write(json.dumps({"text": d}) + "\n")
    tok = train_tokenizer(train_docs, out)
    train = token_stream(tok, train_docs)
    held = heldout_blocks(tok, held_docs, recipe.seq_len)

    with _threads(recipe.threads):
        torch.manual_seed(recipe.seed)
        cls = getattr(transformers, recipe.model_class)
        cfg_cls = getattr(transformers, recipe.model_class.replace("ForCausalLM", "Config"))
        model = cls(cfg_cls(**recipe.config)).float()
        model.eval()
        init_ratio = outlier_ratios(model, held)
        init_ppl = perplexity(model, held)

        gen = torch.Generator().manual_seed(recipe.seed)
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
        other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": recipe.weight_decay},
                {"params": other, "weight_decay": 0.0},
            ],
            lr=recipe.lr,
            betas=(0.9, 0.95),
        )

        def lr_at(step: int) -> float:
            if step < recipe.warmup:
                return (step + 1) / recipe.warmup
            frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        model.train()
        t_train = time.perf_counter()
        losses = []
        for _ in range(recipe.steps):
            starts = torch.randint(
                0, train.numel() - recipe.seq_len, (recipe.batch,), generator=gen
            )
            x = torch.stack([train[s : s + recipe.seq_len] for s in starts.tolist()])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        train_s = time.perf_counter() - t_train
        model.eval()

        model.to(torch.bfloat16).save_pretrained(out)
        # score what was saved: the bf16 weights, computed in float32
        saved = cls.from_pretrained(out, dtype=torch.float32).eval()
        metrics = {
            "recipe": dataclasses.asdict(recipe),
            "weights_dtype": "bfloat16",
            "train_tokens": train.numel(),
            "heldout_documents": len(held_docs),
            "heldout_blocks": held.shape[0],
            "init_heldout_ppl": init_ppl,
            "heldout_ppl": perplexity(saved, held),
            "unigram_ppl": unigram_perplexity(train, held),
            "first_losses": losses[:5],
            "last_losses": losses[-5:],
            "outlier_ratio_init": init_ratio,
            "outlier_ratio_trained": outlier_ratios(saved, held),
            "train_seconds": train_s,
            "build_seconds": time.perf_counter() - t0,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": _tokenizers_version(),
            "environment": DETERMINISTIC_ENV,
            "sha256": {f: _sha256(out / f) for f in ("model.safetensors", "tokenizer.json")},
        }
    (out / MARKER).write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


if __name__ == "__main__":  # python -m tests.trained RECIPE_JSON OUT_DIR (see trained_model)
    build(Recipe(**json.loads(sys.argv[1])), corpus_documents(), Path(sys.argv[2]))

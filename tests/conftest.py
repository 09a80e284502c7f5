"""Session-wide fixtures: tiny transformers-written checkpoints, built once per run."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from tests.models import QUANT_FAMILIES, save_model

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k25")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """family -> directory of a tiny random model saved by transformers (fp32)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {f: save_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """Build variants on demand: model_factory("deepseek_v3", q_lora_rank=None)."""
    cache: dict = {}

    def make(family: str, seed: int = 0, **kw):
        key = (family, seed, repr(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(family)
            cache[key] = save_model(family, d / "model", seed=seed, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def quant_sources(tmp_path_factory) -> dict:
    """family -> tiny model whose Linear inputs are all multiples of 128 (QUANT_FAMILIES)."""
    root = tmp_path_factory.mktemp("quant_sources")
    return {f: save_model(f, root / f, **kw) for f, kw in QUANT_FAMILIES.items()}


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one intra-op thread is faster than two on a shared 2-core machine
    (OpenMP threads spin against other processes). Use with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

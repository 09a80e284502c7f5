"""The Moonshot / fla oracle harness loads and runs (tests/moonshot_oracle.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests import moonshot_oracle as mo


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return mo.build_kimi_k3(tmp_path_factory.mktemp("oracle"), seed=0)


def test_checkpoint_layout(k3_dir):
    cfg = json.loads((k3_dir / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3"
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["model_type"] == "kimi_linear"
    lac = text["linear_attn_config"]
    assert lac["full_attn_layers"] == [3, 6] and lac["kda_layers"] == [1, 2, 4, 5]
    assert cfg["vision_config"]["mm_projector_type"] == "patchmergerv2"
    with safe_open(str(k3_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        a_log = f.get_tensor("language_model.model.layers.0.self_attn.A_log")
        ln = f.get_tensor("language_model.model.layers.0.input_layernorm.weight")
    assert "language_model.lm_head.weight" in names
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("mm_projector.") for n in names)
    assert a_log.shape == (16,) and (a_log[4:] == 0).all() and (a_log[:4] != 0).all()
    assert 0.8 < ln.mean().item() < 1.2 and ln.std().item() > 0.02  # norms around 1


def test_oracle_forward_and_decode(k3_dir):
    model = mo.build_oracle(k3_dir)
    ids = torch.randint(3, 150, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        assert full.shape == (2, 9, 160) and torch.isfinite(full).all()
        assert full.std() > 0.05
        # prefill 8 then one cached step (fla's recurrent reference) = the full forward
        lm = model.language_model
        pre = lm(input_ids=ids[:, :8], use_cache=True)
        step = lm(input_ids=ids[:, 8:], past_key_values=pre.past_key_values, use_cache=True)
    assert mo.rel_err(pre.logits, full[:, :8]) < 1e-5
    assert mo.rel_err(step.logits[:, -1], full[:, -1]) < 1e-5


def test_oracle_vision_features(k3_dir):
    model = mo.build_oracle(k3_dir)
    grid = torch.tensor([[1, 4, 6]])  # t, h, w in patches
    pixels = torch.randn(24, 3, 14, 14, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats = model.mm_projector(model._extract_image_features(pixels, grid))
    assert len(feats) == 1 and feats[0].shape == (6, 64) and torch.isfinite(feats[0]).all()


def test_text_only_checkpoint(tmp_path):
    path = mo.build_kimi_k3(tmp_path, seed=3, vision=False, num_hidden_layers=3)
    cfg = json.loads((path / "config.json").read_text())
    assert "vision_config" not in cfg
    model = mo.build_oracle(path)
    assert type(model).__name__ == "KimiLinearForCausalLM"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, 160) and torch.isfinite(logits).all()

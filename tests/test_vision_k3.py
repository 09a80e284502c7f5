"""Kimi K3's vision tower + projector (runtime/vision_k3.py) against Moonshot's modules.

The oracle is Moonshot's ``MoonViT3dPretrainedModel`` + ``PatchMergerMLPV2`` (loaded by
tests/moonshot_oracle.py); ours reads the same safetensors through the architecture table
(``arch.match`` -> unit keys) and runs every Linear through a plain ``F.linear``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from k3convert.arch import resolve
from k3convert.arch.kimi_k3_vision import parse_vision
from k3convert.errors import ConfigError
from k3convert.runtime.source import Weights, entry_key
from k3convert.runtime.vision_k3 import encode_images_k3, vision_settings_k3

from .moonshot_oracle import build_kimi_k3, build_oracle, load, rel_err, vision_config

P = 14


def _lin(calls=None):
    def lin(w, key, x):
        if calls is not None:
            calls.append(key)
        return F.linear(x, w.need(key), w.get(key + "_bias"))

    return lin


def _weights(raw: dict, sd: dict, dtype) -> tuple[Weights, object, object]:
    """The vision unit as the runtime keys it, from checkpoint names -> tensors."""
    arch, cfg = resolve(raw)
    names = [n for n in sd if n.startswith(("vision_tower.", "mm_projector."))]
    matched = arch.match(cfg, names, "test")
    tensors, keys = {}, {}
    for n, m in matched.items():
        assert m.role.unit == "vision", n
        assert tuple(sd[n].shape) == m.shape, n
        k = entry_key(m.role, m.canonical)
        assert k not in tensors, k
        tensors[k], keys[k] = sd[n].to(dtype), n
    # every tensor the config implies is there
    want = {i.name for i in arch.instances(cfg) if i.role.unit == "vision"}
    assert want == set(names)
    return Weights("vision", tensors, keys), cfg, vision_settings_k3(raw, cfg, "config.json")


def _oracle(model, pv, grid):
    with torch.no_grad():
        feats = model.vision_tower(pv.to(model.vision_tower.patch_embed.proj.weight.dtype), grid)
        return torch.cat(model.mm_projector(feats))


class Oracle(torch.nn.Module):
    """Moonshot's vision tower + projector alone, for vision configs build_kimi_k3 lacks."""

    def __init__(self, mod, vision: dict):
        super().__init__()
        vc = mod.KimiK3VisionConfig(**vision)
        self.vision_tower = mod.MoonViT3dPretrainedModel(mod.VisionTowerConfig(vc))
        for b in self.vision_tower.encoder.blocks:
            b.attn_implementation = "eager"
        self.mm_projector = mod.PatchMergerMLPV2(mod.ProjectorConfig(vc))


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    path = build_kimi_k3(tmp_path_factory.mktemp("k3v"), vision=True)
    raw = json.loads((path / "config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    model = build_oracle(path)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    return raw, sd, model, bf16


def _pixels(grid, seed=0):
    n = int(torch.tensor(grid).prod(-1).sum())
    return torch.randn(n, 3, P, P, generator=torch.Generator().manual_seed(seed))


GRIDS = {
    "one image, resampled pos-emb": [[1, 4, 6]],
    "one image at the pos-emb size": [[1, 8, 8]],
    "two images of different sizes": [[1, 4, 6], [1, 6, 10]],
    "one clip of 2 frames": [[2, 6, 4]],
    "image + clip of 4 frames": [[1, 2, 4], [4, 4, 2]],
}


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_matches_oracle_fp32(k3, grid):
    raw, sd, model, _ = k3
    w, cfg, vs = _weights(raw, sd, torch.float32)
    g, pv = torch.tensor(grid), _pixels(grid)
    calls = []
    ours = encode_images_k3(vs, _lin(calls), w, pv, g, torch.float32)
    ref = _oracle(model, pv, g)
    kh, kw = cfg.vision.merge_kernel_size
    assert ours.shape == ref.shape == (sum(h * ww // (kh * kw) for _, h, ww in grid), 64)
    assert ours.dtype == torch.float32
    assert rel_err(ours, ref) <= 1e-4, rel_err(ours, ref)
    # every Linear ran through lin: 4 per block and the projector's two
    n = cfg.vision.num_layers
    assert len(calls) == 4 * n + 2
    blocks = {f"blocks.{b}.vision.{k}" for b in range(n) for k in ("wqkv", "wo", "fc0", "fc1")}
    assert set(calls) == blocks | {"projector.proj_in", "projector.proj_out"}


def test_flat_pixels_and_batching(k3):
    """[N, 3*p*p] pixels give the same tokens; two images in one call are each image's
    tokens one after the other (attention does not cross images)."""
    raw, sd, _, _ = k3
    w, _, vs = _weights(raw, sd, torch.float32)
    grid = [[1, 4, 6], [2, 2, 4]]
    pv = _pixels(grid, seed=3)
    both = encode_images_k3(vs, _lin(), w, pv, torch.tensor(grid), torch.float32)
    flat = encode_images_k3(vs, _lin(), w, pv.flatten(1), torch.tensor(grid), torch.float32)
    assert torch.equal(both, flat)
    a = encode_images_k3(vs, _lin(), w, pv[:24], torch.tensor(grid[:1]), torch.float32)
    b = encode_images_k3(vs, _lin(), w, pv[24:], torch.tensor(grid[1:]), torch.float32)
    assert rel_err(both, torch.cat((a, b))) <= 1e-6


@pytest.mark.parametrize("grid", [[[1, 4, 6], [1, 6, 10]], [[2, 6, 4]]], ids=["images", "clip"])
def test_matches_oracle_bf16(k3, grid):
    """bf16: no further from the fp32 oracle than twice the oracle's own bf16 error."""
    raw, sd, model, bf16 = k3
    w, _, vs = _weights(raw, sd, torch.bfloat16)
    g, pv = torch.tensor(grid), _pixels(grid, seed=1)
    ref = _oracle(model, pv, g)
    ref_bf16 = _oracle(bf16, pv, g)
    ours = encode_images_k3(vs, _lin(), w, pv, g, torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    own = rel_err(ref_bf16, ref)
    assert 0 < own < 0.1, own  # bf16 really ran, and is sane
    assert rel_err(ours, ref) <= 2 * own, (rel_err(ours, ref), own)


def test_layernorm_biases_bicubic_variant(k3):
    """The config switches Moonshot's code has: layernorm, attention / MLP / patch-embed
    biases, bicubic pos-emb resampling, qkv width = hidden, a 2x1 merge kernel."""
    raw, _, _, _ = k3
    mod = load()
    vision = {
        **vision_config(64),
        "norm_type": "layernorm",
        "attn_bias": True,
        "linear_bias": True,
        "patch_embed_proj_bias": True,
        "pos_emb_interpolation_mode": "bicubic",
        "qkv_hidden_size": None,
        "merge_kernel_size": [2, 1],
        "vt_num_attention_heads": 4,
    }
    torch.manual_seed(0)
    oracle = Oracle(mod, vision).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, t in oracle.state_dict(keep_vars=True).items():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.08 + ("norm" in name))
    sd = {k: v.detach().clone() for k, v in oracle.state_dict().items()}
    raw = {**raw, "vision_config": vision}
    w, _, vs = _weights(raw, sd, torch.float32)
    assert any(k.endswith("norm0_bias") for k in w) and "vision.patch_embed_bias" in w
    grid = [[1, 4, 6], [3, 2, 3]]
    g, pv = torch.tensor(grid), _pixels(grid, seed=2)
    ours = encode_images_k3(vs, _lin(), w, pv, g, torch.float32)
    ref = _oracle(oracle, pv, g)
    assert ours.shape == ref.shape == (12 + 3, 64)
    assert rel_err(ours, ref) <= 1e-4, rel_err(ours, ref)


BAD_GRIDS = [
    ([[1, 4, 6]], (20, 3, P, P), "describes 24 patches but pixel_values holds 20"),
    ([[1, 3, 6]], (18, 3, P, P), "not divisible by the merge kernel 2x2"),
    ([[5, 2, 2]], (20, 3, P, P), "exceeds init_pos_emb_time = 4"),
    ([[1, 2, 514]], (1028, 3, P, P), "more than 512 patches on a side"),
    ([[0, 2, 2]], (0, 3, P, P), "must be positive"),
    ([1, 2, 2], (4, 3, P, P), "must be [num_images, 3]"),
    ([[1, 2, 2]], (4, 3, 16, 16), "pixel_values must be [num_patches, 3, 14, 14]"),
    ([[1, 2, 2]], (4, 3 * P * P - 1), "pixel_values must be [num_patches, 3, 14, 14]"),
]


@pytest.mark.parametrize("grid,shape,msg", BAD_GRIDS)
def test_bad_inputs_are_config_errors(k3, grid, shape, msg):
    raw, sd, _, _ = k3
    w, _, vs = _weights(raw, sd, torch.float32)
    with pytest.raises(ConfigError) as e:
        encode_images_k3(vs, _lin(), w, torch.zeros(shape), torch.tensor(grid), torch.float32)
    assert msg in str(e.value)


def test_bad_pixel_and_grid_types(k3):
    raw, sd, _, _ = k3
    w, _, vs = _weights(raw, sd, torch.float32)
    pv = torch.zeros(4, 3, P, P)
    with pytest.raises(ConfigError, match="must hold integers"):
        encode_images_k3(vs, _lin(), w, pv, torch.tensor([[1.0, 2.0, 2.0]]), torch.float32)
    with pytest.raises(ConfigError, match="NaN or infinite"):
        encode_images_k3(vs, _lin(), w, pv.fill_(float("nan")), torch.tensor([[1, 2, 2]]),
                         torch.float32)  # fmt: skip
    with pytest.raises(ConfigError, match="floating-point tensor"):
        encode_images_k3(vs, _lin(), w, pv.long(), torch.tensor([[1, 2, 2]]), torch.float32)


BAD_CONFIGS = [
    ({"merge_type": "sd2"}, "'merge_type' = str 'sd2' is not supported"),
    ({"mm_projector_type": "patchmerger"}, "'mm_projector_type'"),
    ({"pos_emb_type": "learned"}, "'pos_emb_type'"),
    ({"norm_type": "batchnorm"}, "'norm_type'"),
    ({"qkv_hidden_size": 51}, "not divisible by vt_num_attention_heads 2"),
    ({"qkv_hidden_size": 36}, "must be a multiple of 4"),
    ({"text_hidden_size": 65}, "differs from the text model's hidden_size 64"),
    ({"mm_hidden_size": 16}, "differs from vt_hidden_size 32"),
    ({"activation_func": "silu"}, "'activation_func'"),
    ({"merge_kernel_size": [2]}, "'merge_kernel_size' must be two integers"),
    ({"vt_num_hidden_layers": 0}, "'vt_num_hidden_layers' must be a positive integer"),
    ({"attn_bias": "yes"}, "'attn_bias' must be true or false"),
    ({"projector_ln_eps": -1}, "'projector_ln_eps' must be a positive finite number"),
]


@pytest.mark.parametrize("change,msg", BAD_CONFIGS)
def test_bad_vision_configs(change, msg):
    with pytest.raises(ConfigError) as e:
        parse_vision({**vision_config(64), **change}, 64, "config.json")
    assert msg in str(e.value)
    assert "config.json: vision_config" in str(e.value)


def test_release_defaults():
    """Absent keys take KimiK3VisionConfig's defaults, the release's sizes: 27 blocks of
    1024, 12 heads of 128 (qkv 1536), projector 4096 -> text hidden; a null
    qkv_hidden_size is the hidden size, as Moonshot's encoder reads it."""
    v = parse_vision({}, 7168, "config.json: vision_config")
    assert (v.num_layers, v.hidden_size, v.qkv_hidden_size, v.intermediate_size) == (
        27, 1024, 1536, 4096)  # fmt: skip
    assert (v.patch_size, v.pos_emb_height, v.pos_emb_width, v.pos_emb_time) == (14, 64, 64, 4)
    assert (v.merged_size, v.text_hidden_size, v.head_dim) == (4096, 7168, 128)
    assert (v.merge_type, v.projector_type, v.norm_type) == ("sd2_tpool", "patchmergerv2",
                                                            "rmsnorm")  # fmt: skip
    assert not (v.attn_bias or v.linear_bias or v.patch_embed_bias)
    v = parse_vision({"qkv_hidden_size": None, "vt_num_attention_heads": 16}, 7168, "c")
    assert (v.qkv_hidden_size, v.head_dim) == (1024, 64)

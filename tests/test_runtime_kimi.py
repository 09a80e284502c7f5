"""Kimi-Linear and Kimi K3 (text) in the runtime, against the vendors' own code.

Oracles (code we did not write):

- transformers 5.24's ``KimiLinearForCausalLM`` (its torch KDA fallbacks): a tiny random
  model from ``tests.models.kimi_linear``, loaded back with ``from_pretrained``;
- Moonshot's ``modeling_kimi_linear.py`` / ``modeling_kimi_k3.py`` (llmcompressor 0.14.0.1)
  run through ``tests.moonshot_oracle`` (fla's pure-torch KDA references for its kernels),
  on tiny random K3 checkpoints from ``build_kimi_k3``; function-level checks call its
  ``SituAndMul``, ``_apply_attn_res`` and ``KimiSparseMoeBlock`` directly.

Bounds: fp32 max|dlogit| / max|logit| <= 1e-4 with the same argmax at every real token;
bf16 KL(ref fp32 || ours bf16) <= 2 x KL(ref fp32 || ref bf16); decoding with a cache
equals a full forward to 1e-5; the parallel runtime equals the unsharded one to 1e-5.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from k3convert.arch import resolve
from k3convert.checkpoint import open_checkpoint
from k3convert.errors import ConfigError
from k3convert.layout import Layout
from k3convert.runtime import Runtime
from k3convert.runtime.cache import KVCache
from k3convert.runtime.decoder import (
    AttnResState,
    attn_res_mix,
    linear_plain,
    moe,
    text_settings,
)
from k3convert.runtime.ops import SiTU
from k3convert.runtime.parallel import ParallelRuntime
from k3convert.runtime.ranks import planned_ranks, stream_ranks
from k3convert.runtime.source import Weights
from k3convert.shard.writer import shard
from k3convert.stream import open_stream
from tests import moonshot_oracle as mo
from tests.models import VOCAB, kimi_linear

SEQ = 13
PAD = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- helpers --------------------------------------------------------------------------
def batch(seed: int = 1, seq: int = SEQ, side: str = "left"):
    """Two rows, the second padded by PAD tokens on ``side`` (pad id 0, never drawn)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 8, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    cut = slice(0, PAD) if side == "left" else slice(seq - PAD, seq)
    mask[1, cut] = 0
    ids[1, cut] = 0
    return ids, mask


def parity(label: str, ours, ref, mask, tol: float = 1e-4) -> float:
    valid = mask.bool()
    ratio = mo.rel_err(ours[valid], ref[valid])
    print(f"[parity] {label}: max|dlogit|/max|logit| = {ratio:.2e}")
    assert ratio <= tol, f"{label}: {ratio:.3e} > {tol}"
    same = ours.argmax(-1) == ref.argmax(-1)
    assert bool(same[valid].all()), f"{label}: argmax differs at {(~same & valid).nonzero()}"
    return ratio


def kl(p_logits, q_logits, mask) -> float:
    p = p_logits.float().log_softmax(-1)
    q = q_logits.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)[mask.bool()].mean().item()


def quiet(fn, *a, **kw):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **kw)


# -- models ---------------------------------------------------------------------------
#: 6 layers (KDA 1, 2, 4, 5; MLA 3, 6), layer 0 dense, 3 attention-residual blocks
K3_TEXT = {}


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    d = quiet(mo.build_kimi_k3, tmp_path_factory.mktemp("k3"), seed=0, vision=True, **K3_TEXT)
    return d, quiet(mo.build_oracle, d)


def _sharpen(model) -> None:
    """Decisive attention and routing (transformers' 0.02-std init is nearly uniform)."""
    with torch.no_grad():
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(torch.randn_like(b) * 0.5)
        for n, p in model.named_parameters():
            if any(s in n for s in ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj",
                                    "kv_b_proj", "gate.weight")):  # fmt: skip
                p.mul_(4.0)


@pytest.fixture(scope="module")
def kl_model(tmp_path_factory):
    import transformers as tf

    from tests.models import build_model

    d = tmp_path_factory.mktemp("kl") / "kimi_linear"
    model = build_model("kimi_linear", seed=0)
    _sharpen(model)
    quiet(model.save_pretrained, d)

    def oracle(dtype=torch.float32):
        return quiet(tf.KimiLinearForCausalLM.from_pretrained, d, dtype=dtype).eval()

    return d, oracle


def test_kimi_linear_builder_writes_released_names(tmp_path):
    d = kimi_linear(tmp_path / "kl")
    names = set(open_checkpoint(d).names())
    for want in ("model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.A_log",
                 "model.layers.0.self_attn.f_a_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.block_sparse_moe.experts.7.w1.weight",
                 "model.layers.2.self_attn.kv_b_proj.weight"):  # fmt: skip
        alias = want.replace(".mlp.", ".block_sparse_moe.")
        assert want in names or alias in names, want


# -- function level: Moonshot's SiTU, attention residuals, latent MoE --------------------
@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ_is_moonshots(linear_beta, dtype):
    """Our SiTU is Moonshot's ``SituAndMul`` op for op (tanh, scale, sigmoid, products, all
    float32, one cast). Bit-exact where both run on the same memory layout: Moonshot slices
    gate / up out of one [.., 2*d] tensor, so they are given the same views. On contiguous
    inputs ATen may take another kernel path for the same ops (AVX512 runs a 48-wide row
    as 32 vectorised lanes + 16 scalar ``std::tanh``), so there the bound is float32
    rounding: each of the three transcendentals may differ by 2 ulp between the SIMD and
    libm implementations, i.e. ``8 * eps`` relative in float32, which after the final cast
    is one ulp of the output dtype (``eps`` of bfloat16)."""
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(64, 48, generator=g) * 8).to(dtype)
    up = (torch.randn(64, 48, generator=g) * 40).to(dtype)
    x = torch.cat((gate, up), -1)
    ref = mo.load().SituAndMul(beta=4.0, linear_beta=linear_beta)(x)
    ours = SiTU(4.0, linear_beta)(x[..., :48], x[..., 48:])
    assert ours.dtype == dtype
    assert torch.equal(ours, ref)
    contiguous = SiTU(4.0, linear_beta)(gate, up)
    rtol = 8 * torch.finfo(torch.float32).eps if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(contiguous, ref, rtol=rtol, atol=torch.finfo(dtype).tiny)
    assert (contiguous != ref).float().mean() < 0.05  # rounding, not a different formula


def test_attn_res_mix_is_moonshots():
    mod = mo.load()
    g = torch.Generator().manual_seed(1)
    b, s, h, n = 2, 5, 64, 3
    blocks = tuple(torch.randn(b, s, h, generator=g) * (i + 1) for i in range(n))
    partial = torch.randn(b, s, h, generator=g)
    norm = mod.KimiRMSNorm(h, eps=1e-5)
    proj = torch.nn.Linear(h, 1, bias=False)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(h, generator=g))
        proj.weight.copy_(torch.randn(1, h, generator=g))
        stacked = torch.stack(blocks, 2).reshape(b * s, n, h)  # Moonshot's [tokens, blocks, H]
        ref = mod._apply_attn_res(partial.reshape(-1, h), stacked, proj, norm).view(b, s, h)
    ours = attn_res_mix(partial, blocks, norm.weight, proj.weight, 1e-5)
    assert mo.rel_err(ours, ref) <= 1e-6


def _moonshot_moe_block(seed: int = 2):
    mod = mo.load()
    raw = mo.text_config()
    block = mod.KimiSparseMoeBlock(mod.KimiLinearConfig(**raw)).float().eval()
    mo.randomize(block, seed)
    with torch.no_grad():  # decisive routing
        block.gate.weight.mul_(5.0)
    return raw, block


def test_latent_moe_is_moonshots():
    raw, block = _moonshot_moe_block()
    _, cfg = resolve({"model_type": "kimi_k3", "text_config": raw,
                      "vision_config": mo.vision_config()})  # fmt: skip
    ts = text_settings("kimi_k3", cfg.text, raw, "test")
    keys = {"router.router": "gate.weight", "router.e_score_correction_bias":
            "gate.e_score_correction_bias", "latent.routed_expert_down_proj":
            "routed_expert_down_proj.weight", "latent.routed_expert_norm":
            "routed_expert_norm.weight", "latent.routed_expert_up_proj":
            "routed_expert_up_proj.weight"}  # fmt: skip
    for x in ("gate", "up", "down"):
        keys[f"shared_experts.{x}_proj"] = f"shared_experts.{x}_proj.weight"
    for e in range(ts.num_experts):
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            keys[f"routed_experts.{e}.{ours}"] = f"experts.{e}.{theirs}.weight"
    sd = block.state_dict()
    w = Weights("layer.1", {k: sd[v] for k, v in keys.items()}, {k: k for k in keys})
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = block(x)
    ours = moe(ts, linear_plain, w, x)
    assert mo.rel_err(ours, ref) <= 1e-5
    # the latent norm is not linear: summing experts after it would differ visibly
    assert "latent.routed_expert_norm" in w


# -- Kimi-Linear (transformers) ---------------------------------------------------------
def test_kimi_linear_fp32(kl_model):
    d, oracle = kl_model
    ids, mask = batch()
    with torch.no_grad():
        ref = oracle()(input_ids=ids, attention_mask=mask).logits
    with Runtime(open_checkpoint(d)) as rt:
        assert rt.text.layer_attention == ("kda", "kda", "mla", "kda")
        ours = rt.forward(ids, attention_mask=mask)
    parity("kimi_linear fp32 (left-padded row)", ours, ref, mask)


def test_kimi_linear_bf16(kl_model):
    d, oracle = kl_model
    ids, mask = batch(seed=2)
    with torch.no_grad():
        ref32 = oracle()(input_ids=ids, attention_mask=mask).logits
        ref16 = oracle(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits
    with Runtime(open_checkpoint(d), dtype="bf16") as rt:
        ours = rt.forward(ids, attention_mask=mask)
    k_ours, k_ref = kl(ref32, ours, mask), kl(ref32, ref16, mask)
    print(f"[bf16] kimi_linear: KL ours {k_ours:.3e} vs transformers bf16 {k_ref:.3e}")
    assert k_ours <= 2 * k_ref


# -- Kimi K3 text (Moonshot) --------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
def test_kimi_k3_fp32_padded(k3, side):
    d, oracle = k3
    ids, mask = batch(side=side)
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask).logits
    with Runtime(open_checkpoint(d)) as rt:
        assert rt.text.layer_attention == ("kda", "kda", "mla", "kda", "kda", "mla")
        ours = rt.forward(ids, attention_mask=mask)
    parity(f"kimi_k3 fp32 ({side}-padded row)", ours, ref, mask)


def test_kimi_k3_text_only_export(tmp_path):
    """No vision_config: Moonshot's KimiLinearForCausalLM is the oracle; images refused."""
    d = quiet(mo.build_kimi_k3, tmp_path, seed=1, vision=False, num_hidden_layers=4)
    ids, mask = batch(seed=12)
    with torch.no_grad():
        ref = quiet(mo.build_oracle, d)(input_ids=ids, attention_mask=mask).logits
    with Runtime(open_checkpoint(d)) as rt:
        assert rt.vision is None and rt.text.layer_attention == ("kda", "kda", "mla", "kda")
        parity("kimi_k3 text-only export", rt.forward(ids, attention_mask=mask), ref, mask)
        with pytest.raises(ConfigError, match="no vision tower"):
            rt.forward(ids, pixel_values=torch.zeros(4, 3, 14, 14),
                       image_grid_thw=torch.tensor([[1, 2, 2]]))  # fmt: skip


def test_kimi_k3_bf16(k3):
    d, oracle = k3
    ids, mask = batch(seed=2)
    with torch.no_grad():
        ref32 = oracle(input_ids=ids, attention_mask=mask).logits
        ref16 = mo.build_oracle(d).bfloat16()(input_ids=ids, attention_mask=mask).logits
    with Runtime(open_checkpoint(d), dtype="bf16") as rt:
        ours = rt.forward(ids, attention_mask=mask)
    k_ours, k_ref = kl(ref32, ours, mask), kl(ref32, ref16, mask)
    print(f"[bf16] kimi_k3: KL ours {k_ours:.3e} vs Moonshot bf16 {k_ref:.3e}")
    assert k_ours <= 2 * k_ref


def test_kimi_k3_layer_outputs_are_moonshots_hidden_states(k3):
    """on_layer (what verify compares) gets what Moonshot's ``output_hidden_states``
    records for each decoder layer: the layer's first output (``OutputRecorder`` on
    ``KimiDecoderLayer``, index 0), the attention-residual running sum. Recorded here with
    the same forward hooks, the wrapper's output_hidden_states coming back empty."""
    d, oracle = k3
    ids, _ = batch(seed=3)
    layers = oracle.language_model.model.layers
    hs: list = []
    hooks = [m.register_forward_hook(lambda m, a, out: hs.append(out[0])) for m in layers]
    try:
        with torch.no_grad():
            oracle(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    seen = []
    with Runtime(open_checkpoint(d)) as rt:
        rt.forward(ids, on_layer=lambda i, h: seen.append(h))
    assert len(seen) == len(hs) == rt.num_layers
    for i, (a, b) in enumerate(zip(seen, hs, strict=True)):
        assert mo.rel_err(a, b) <= 1e-5, i


def test_kimi_k3_state_object(k3):
    d, _ = k3
    ids, _ = batch(seed=4)
    with Runtime(open_checkpoint(d)) as rt:
        full = rt.forward(ids)
        h = rt.embed(ids)
        states = []
        for i in range(rt.num_layers):
            h = rt.run_layer(i, h)
            states.append(h)
        assert isinstance(h, AttnResState)
        assert [len(s.blocks) for s in states] == [1, 1, 2, 2, 3, 3]
        assert torch.equal(rt.head(h), full)
        with pytest.raises(ConfigError, match="needs the AttnResState"):
            rt.run_layer(2, states[1].partial)
        with pytest.raises(ConfigError, match="holds 1 attention-residual blocks"):
            rt.run_layer(3, states[0])


def test_kimi_k3_hooks_see_every_linear(k3):
    """Hooks (calibration observers) see KDA's and the latent MoE's Linears with their
    source names; convolutions, gate parameters and attention-residual vectors are not
    Linears (Moonshot uses them as tensors, so nothing would quantize their inputs)."""
    d, _ = k3
    seen = set()
    with Runtime(open_checkpoint(d)) as rt:
        rt.add_hook(lambda name, x, y: seen.add(name))
        rt.forward(batch()[0])
    p = "language_model.model.layers."
    kda = ("q_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj")
    moe_keys = ("routed_expert_down_proj", "routed_expert_up_proj", "gate", "experts.0.w1")
    want = [f"0.self_attn.{k}" for k in kda] + ["2.self_attn.g_proj", "2.self_attn.kv_b_proj"]
    want += [f"1.block_sparse_moe.{k}" for k in moe_keys]
    for w in want:
        assert f"{p}{w}.weight" in seen, w
    assert not [n for n in seen if "conv1d" in n or "attn_res" in n or "A_log" in n]


# -- decoding with a cache ----------------------------------------------------------------
def _decode(rt, ids, mask, steps: int, **cache_kw):
    """Prefill ``ids`` then ``steps`` tokens one at a time; returns the logits of every
    step [B, steps + 1, V] (the prefill's last), the sequence, its mask, and the cache's
    (total, KDA-state) bytes after the prefill and at the end."""
    cache = KVCache(**cache_kw)
    out = [rt.forward(ids, attention_mask=mask, cache=cache)[:, -1:]]
    sizes = [(cache.nbytes(), cache.state_nbytes())]
    seq, m = ids, mask
    g = torch.Generator().manual_seed(9)
    for _ in range(steps):
        tok = torch.randint(3, VOCAB - 8, (ids.shape[0], 1), generator=g)
        seq = torch.cat((seq, tok), 1)
        m = None if m is None else torch.cat((m, torch.ones_like(tok)), 1)
        out.append(rt.forward(tok, attention_mask=m, cache=cache))
    sizes.append((cache.nbytes(), cache.state_nbytes()))
    return torch.cat(out, 1), seq, m, sizes, cache


@pytest.mark.parametrize("mla", ["expanded", "latent"])
def test_kimi_k3_decode_equals_full_forward(k3, mla):
    d, _ = k3
    ids, mask = batch(seed=5, seq=9)
    with Runtime(open_checkpoint(d), resident=True) as rt:
        inc, seq, m, sizes, cache = _decode(rt, ids, mask, 5, mla=mla)
        full = rt.forward(seq, attention_mask=m)[:, ids.shape[1] - 1 :]
    err = parity(f"kimi_k3 decode ({mla} MLA cache)", inc, full, torch.ones(full.shape[:2]), 1e-5)
    assert err <= 1e-5
    (kv0, st0), (kv1, st1) = sizes
    assert st0 == st1 > 0  # KDA: a fixed-size state
    assert kv1 > kv0  # MLA: grows with every token
    # 4 KDA layers: q/k/v conv (3 x 64 channels x 3 past inputs) + [2, 4, 16, 16] state
    assert st0 == 4 * 4 * (3 * 2 * 64 * 3 + 2 * 4 * 16 * 16)
    text = cache.describe(rt.text.attention)
    assert f"MLA {mla}" in text and "KDA state" in text


def test_kimi_linear_decode_equals_full_forward(kl_model):
    d, _ = kl_model
    ids, mask = batch(seed=6, seq=9)
    with Runtime(open_checkpoint(d), resident=True) as rt:
        inc, seq, m, _, _ = _decode(rt, ids, mask, 4)
        full = rt.forward(seq, attention_mask=m)[:, ids.shape[1] - 1 :]
    parity("kimi_linear decode", inc, full, torch.ones(full.shape[:2]), 1e-5)


# -- parallel runtime -------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout,pp_layers",
    [(Layout(tp=2), None), (Layout(tp=2, moe_ep=2), None), (Layout(tp=2, pp=2, moe_ep=2), [3, 3])],
    ids=["tp2", "tp2-ep2", "tp2-pp2-ep2"],
)
def test_kimi_k3_parallel(k3, layout, pp_layers):
    d, _ = k3
    ids, mask = batch(seed=7)
    with Runtime(open_checkpoint(d)) as rt:
        ref = rt.forward(ids, attention_mask=mask)
        ref_h = []
        rt.forward(ids, attention_mask=mask, on_layer=lambda i, h: ref_h.append(h))
    ranks = planned_ranks(open_checkpoint(d), layout, pp_layers=pp_layers)
    with ParallelRuntime(ranks) as prt:
        seen = []
        ours = prt.forward(ids, attention_mask=mask, on_layer=lambda i, h: seen.append(h))
    parity(f"kimi_k3 {layout}", ours, ref, mask, 1e-5)
    assert len(seen) == len(ref_h)
    for a, b in zip(seen, ref_h, strict=True):
        assert mo.rel_err(a[mask.bool()], b[mask.bool()]) <= 1e-5


def test_kimi_linear_parallel(kl_model):
    """transformers' Kimi-Linear: softplus-gated KDA heads split over tp2, experts ep2."""
    d, _ = kl_model
    ids, mask = batch(seed=13)
    with Runtime(open_checkpoint(d)) as rt:
        ref = rt.forward(ids, attention_mask=mask)
    with ParallelRuntime(planned_ranks(open_checkpoint(d), Layout(tp=2, moe_ep=2))) as prt:
        ours = prt.forward(ids, attention_mask=mask)
    parity("kimi_linear tp2-ep2", ours, ref, mask, 1e-5)


def test_kimi_k3_parallel_decode(k3):
    d, _ = k3
    ids, mask = batch(seed=8, seq=9)
    with Runtime(open_checkpoint(d), resident=True) as rt:
        ref, *_ = _decode(rt, ids, mask, 3)
    ranks = planned_ranks(open_checkpoint(d), Layout(tp=2, moe_ep=2))
    with ParallelRuntime(ranks, resident=True) as prt:
        ours, _, _, sizes, _ = _decode(prt, ids, mask, 3)
    parity("kimi_k3 tp2-ep2 decode", ours, ref, torch.ones(ref.shape[:2]), 1e-5)
    assert sizes[0][1] == sizes[1][1] > 0


# -- Kimi K3 images ------------------------------------------------------------------------
def _k3_image_inputs(grids, rows, seq: int = 12, seed: int = 11):
    """pixel_values / grid_thws for ``grids``; a batch of 2 (row 1 left-padded) with ONE
    placeholder per image (as Moonshot's processor writes), image i in row ``rows[i]``."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grids)
    pv = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14, generator=g)
    ids, mask = batch(seed=seed, seq=seq)
    token = VOCAB - 1  # media_placeholder_token_id of build_kimi_k3
    for i, r in enumerate(rows):
        ids[r, (PAD if r else 0) + 2 + 3 * i] = token
    return ids, mask, pv, grid


@pytest.mark.parametrize(
    "grids,rows",
    [([[1, 4, 6]], [0]), ([[1, 4, 6], [1, 2, 4]], [0, 1])],
    ids=["one-image", "two-images"],
)
def test_kimi_k3_images(k3, grids, rows):
    d, oracle = k3
    ids, mask, pv, grid = _k3_image_inputs(grids, rows)
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, pixel_values=pv, grid_thws=grid).logits
    with Runtime(open_checkpoint(d)) as rt:
        wide_ids, wide_mask = rt.expand_media(ids, grid, mask)
        ours = rt.forward(ids, attention_mask=mask, pixel_values=pv, image_grid_thw=grid)
        # the images matter: the same prompt without them differs at the image tokens
        plain = rt.forward(wide_ids.masked_fill(wide_ids == VOCAB - 1, 5), attention_mask=wide_mask)
    n_img = sum(h * w // 4 for _, h, w in grids)
    assert int((wide_ids == VOCAB - 1).sum()) == n_img
    per_row = [ids.shape[1] + sum(h * w // 4 - 1 for (_, h, w), r in zip(grids, rows, strict=True)
                                  if r == row) for row in (0, 1)]  # fmt: skip
    assert ours.shape == ref.shape == (2, max(per_row), VOCAB)
    parity(f"kimi_k3 {len(grids)} image(s)", ours, ref, wide_mask)
    assert (plain - ours)[wide_mask.bool()].abs().max() > 1e-2 * ref.abs().max()


@pytest.mark.parametrize("source", ["planned", "stream"])
def test_kimi_k3_parallel_images(k3, tmp_path, source):
    """tp2 x pp2, experts over ep2 (KDA heads split), from the shard planner over the
    checkpoint or from a stream written by ``shard``: the unsharded logits, two images."""
    d, _ = k3
    if source == "stream":
        out = tmp_path / "stream"
        quiet(shard, src=d, out=out, tp=2, pp=2, ep=2, progress=False, workers=1)
        ranks = stream_ranks(open_stream(out))
    else:
        ranks = planned_ranks(open_checkpoint(d), Layout(tp=2, pp=2, moe_ep=2))
    ids, mask, pv, grid = _k3_image_inputs([[1, 4, 6], [1, 2, 4]], [0, 1])
    kw = dict(attention_mask=mask, pixel_values=pv, image_grid_thw=grid)
    with Runtime(open_checkpoint(d)) as rt:
        ref = rt.forward(ids, **kw)
        _, wide_mask = rt.expand_media(ids, grid, mask)
    with ParallelRuntime(ranks) as prt:
        assert prt.layout.tp == 2 and prt.layout.pp == 2
        ours = prt.forward(ids, **kw)
    parity(f"kimi_k3 {source} tp2-pp2-ep2, 2 images", ours, ref, wide_mask, 1e-5)

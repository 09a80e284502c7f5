"""KDA (k3convert/runtime/kda.py) against code we did not write: fla's pure-torch naive
references, transformers' kimi_linear torch fallbacks, one Moonshot ``KimiDeltaAttention``
(through tests/moonshot_oracle.py) and one transformers ``KimiLinearDeltaAttention``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.models.kimi_linear.modeling_kimi_linear as tkl
from transformers.models.kimi_linear.configuration_kimi_linear import (
    KimiLinearConfig as TfKimiLinearConfig,
)

from k3convert.errors import CheckpointError, ConfigError
from k3convert.runtime import kda
from tests import moonshot_oracle as mo

rel = mo.rel_err
OP_TOL = 1e-5
LAYER_TOL = 1e-4


def gen(seed):
    return torch.Generator().manual_seed(seed)


def raw_inputs(b, t, h, d, seed, *, a_scale=0.5):
    """Un-normalised q, k, v, gate input f, A_log [H], dt_bias [H*D], beta in (0, 1)."""
    g = gen(seed)
    q, k, v, f = (torch.randn(b, t, h, d, generator=g) for _ in range(4))
    a_log = torch.randn(h, generator=g) * a_scale
    dt = torch.randn(h * d, generator=g) * 0.5
    beta = torch.rand(b, t, h, generator=g)
    return q, k, v, f, a_log, dt, beta


def op_inputs(b, t, h, d, seed, lower_bound, **kw):
    q, k, v, f, a_log, dt, beta = raw_inputs(b, t, h, d, seed, **kw)
    g = kda.forget_gate(f, a_log, dt, lower_bound)
    return kda.l2norm(q), kda.l2norm(k), v, g, beta


# -- op level: fla's naive references ---------------------------------------------------
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_forget_gate_is_flas(lower_bound):
    refs = mo.fla_refs()
    _, _, _, f, a_log, dt, _ = raw_inputs(2, 5, 3, 8, 0)
    padded = torch.cat((a_log, torch.zeros(5)))  # the release pads A_log: first H used
    ours = kda.forget_gate(f, padded, dt, lower_bound)
    if lower_bound is None:
        ref = refs.naive_kda_gate(f, a_log, dt)
    else:
        ref = refs.naive_kda_lowerbound_gate(f, a_log, dt, lower_bound)
    assert rel(ours, ref) < 1e-6
    if lower_bound is not None:
        assert ours.min() > lower_bound and ours.max() < 0


@pytest.mark.parametrize("t", [1, 63, 64, 130])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("with_state", [False, True])
def test_delta_rule_vs_fla_naive(t, lower_bound, with_state):
    refs = mo.fla_refs()
    b, h, d = 2, 3, 16
    q, k, v, g, beta = op_inputs(b, t, h, d, t, lower_bound)
    h0 = torch.randn(b, h, d, d, generator=gen(99)) if with_state else None
    o_ref, s_ref = refs.naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True
    )
    for fn in (kda.chunk_kda, kda.recurrent_kda):
        o, s = fn(q, k, v, g, beta, initial_state=h0)
        assert o.dtype == s.dtype == torch.float32
        assert rel(o, o_ref) < OP_TOL, fn.__name__
        assert rel(s, s_ref) < OP_TOL, fn.__name__
    if t % 64 == 0:  # fla's chunked reference needs whole chunks
        o_c, s_c = refs.naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        o, s = kda.chunk_kda(q, k, v, g, beta, initial_state=h0)
        assert rel(o, o_c) < OP_TOL and rel(s, s_c) < OP_TOL


@pytest.mark.parametrize(
    "a_scale, lower_bound, why",
    [
        (0.5, -1.0, "weak decay (spread < 80 a chunk): one factorisation per chunk"),
        (0.5, -5.0, "K3's bounded gate: sub-block factorisation"),
        (3.0, None, "steep softplus decay (~e^-20 a token): pairwise inside sub-blocks"),
    ],
)
def test_chunk_every_decay_regime(a_scale, lower_bound, why):
    refs = mo.fla_refs()
    q, k, v, g, beta = op_inputs(1, 150, 2, 32, 7, lower_bound, a_scale=a_scale)
    h0 = torch.randn(1, 2, 32, 32, generator=gen(3))
    o_ref, s_ref = refs.naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True
    )
    o, s = kda.chunk_kda(q, k, v, g, beta, initial_state=h0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all(), why
    assert rel(o, o_ref) < OP_TOL and rel(s, s_ref) < OP_TOL, why


def test_prefill_then_decode_equals_one_prefill():
    q, k, v, g, beta = op_inputs(2, 75, 3, 16, 5, -5.0)
    o_all, s_all = kda.chunk_kda(q, k, v, g, beta)
    o1, s = kda.chunk_kda(*(x[:, :70] for x in (q, k, v, g, beta)))
    outs = [o1]
    for i in range(70, 73):  # recurrent decode steps
        o_i, s = kda.recurrent_kda(*(x[:, i : i + 1] for x in (q, k, v, g, beta)), initial_state=s)
        outs.append(o_i)
    o_i, s = kda.chunk_kda(*(x[:, 73:] for x in (q, k, v, g, beta)), initial_state=s)
    outs.append(o_i)
    assert rel(torch.cat(outs, 1), o_all) < OP_TOL
    assert rel(s, s_all) < OP_TOL


# -- op level: transformers' torch fallbacks --------------------------------------------
@pytest.mark.parametrize("t", [1, 63, 130])
def test_vs_transformers_fallbacks(t):
    b, h, d = 2, 3, 16
    q, k, v, f, a_log, dt, beta = raw_inputs(b, t, h, d, 11)
    h0 = torch.randn(b, h, d, d, generator=gen(12))
    cfg = TfKimiLinearConfig(
        hidden_size=32, linear_attn_config={"num_heads": h, "head_dim": d}, num_hidden_layers=1
    )
    gate = tkl.KimiLinearForgetGate(cfg)
    with torch.no_grad():
        gate.dt_bias.copy_(dt)
        gate.A_log.copy_(a_log.view(1, 1, h, 1))
        g_ref = (-gate.A_log.float().exp()) * F.softplus(f + dt.view(h, d))  # same as forward
    g = kda.forget_gate(f, gate.A_log, gate.dt_bias, None)
    assert rel(g, g_ref) < 1e-6
    for tf_fn in (tkl.chunk_kimi_delta_attention, tkl.recurrent_kimi_delta_attention):
        o_ref, s_ref = tf_fn(
            q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        o, s = kda.chunk_kda(kda.l2norm(q), kda.l2norm(k), v, g, beta, initial_state=h0)
        assert rel(o, o_ref) < OP_TOL and rel(s, s_ref) < OP_TOL, tf_fn.__name__


def test_forget_gate_module_of_transformers():
    """KimiLinearForgetGate's own forward (projections included) = ours on its weights."""
    h, d, hidden = 3, 8, 32
    cfg = TfKimiLinearConfig(
        hidden_size=hidden, linear_attn_config={"num_heads": h, "head_dim": d}, num_hidden_layers=1
    )
    gate = tkl.KimiLinearForgetGate(cfg)
    mo.randomize(gate, 4, std=0.3)
    x = torch.randn(2, 5, hidden, generator=gen(5))
    with torch.no_grad():
        ref = gate(x)
        f = F.linear(F.linear(x, gate.f_a_proj.weight), gate.f_b_proj.weight).view(2, 5, h, d)
        ours = kda.forget_gate(f, gate.A_log, gate.dt_bias, None)
    assert rel(ours, ref) < 1e-6


def test_gated_norm_vs_references():
    d = 16
    o = torch.randn(2, 5, 3, d, generator=gen(1))
    gate = torch.randn(2, 5, 3, d, generator=gen(2))
    norm_ms = mo.FusedRMSNormGatedRef(d, eps=1e-5, activation="sigmoid")
    norm_tf = tkl.KimiLinearRMSNormGated(d, eps=1e-5)
    wt = 1 + 0.1 * torch.randn(d, generator=gen(3))
    with torch.no_grad():
        norm_ms.weight.copy_(wt)
        norm_tf.weight.copy_(wt)
        ours = kda.gated_rms_norm(o, gate, wt, 1e-5)
        assert rel(ours, norm_ms(o, gate)) < 1e-6
        assert rel(ours, norm_tf(o, gate)) < 1e-6


def test_short_conv_state_continues():
    c, kk = 6, 4
    x = torch.randn(2, 9, c, generator=gen(1))
    wt = torch.randn(c, 1, kk, generator=gen(2))
    ref = F.silu(F.conv1d(x.transpose(1, 2), wt, padding=kk - 1, groups=c)[..., :9]).transpose(1, 2)
    y, st = kda.short_conv(x, wt, None)
    assert rel(y, ref) < 1e-6 and st.shape == (2, c, kk - 1)
    y1, st = kda.short_conv(x[:, :5], wt, None)
    ys = [y1]
    for i in range(5, 9):
        y_i, st = kda.short_conv(x[:, i : i + 1], wt, st)
        ys.append(y_i)
    assert rel(torch.cat(ys, 1), ref) < 1e-6
    assert torch.equal(st, x[:, -3:].transpose(1, 2))
    # per-row lengths: the state is the K-1 inputs before each row's end (zeros before)
    _, st = kda.short_conv(x, wt, None, lengths=torch.tensor([2, 7]))
    assert torch.equal(st[1], x[1, 4:7].t())
    assert torch.equal(st[0, :, 1:], x[0, :2].t()) and (st[0, :, 0] == 0).all()


# -- layer level ------------------------------------------------------------------------
class W(dict):
    """A unit's weights as the runtime hands them over (``need`` / ``in``)."""

    def need(self, key):
        return self[key]


def lin(w, key, x):
    return F.linear(x, w.need(key), w.get(key + "_bias"))


def moonshot_layer(seed=0, **lac):
    m = mo.load()
    cfg = m.KimiLinearConfig(**mo.text_config(linear_attn_config=lac))
    layer = m.KimiDeltaAttention(cfg, layer_idx=0).float().eval()
    mo.randomize(layer, seed, std=0.15)
    return m, cfg, layer


def weights_of_moonshot(layer, pad_a_log=True):
    sd = layer.state_dict()
    w = W()
    for name, t in sd.items():
        key = name.removesuffix(".weight")
        w["norms.o_norm" if key == "o_norm" else "linear_attention." + key] = t.detach()
    if pad_a_log:  # the release's padded A_log: max(heads, head_dim) entries
        a = w["linear_attention.A_log"]
        n = max(layer.num_heads, layer.head_dim)
        w["linear_attention.A_log"] = torch.cat((a, a.new_zeros(n - a.numel())))
    return w


def settings(layer, lower_bound):
    return kda.KDASettings(
        num_heads=layer.num_heads,
        head_dim=layer.head_dim,
        conv_kernel=layer.conv_size,
        lower_bound=lower_bound,
        rms_eps=layer.config.rms_norm_eps,
    )


def test_layer_vs_moonshot_prefill_and_decode():
    m, cfg, layer = moonshot_layer()
    w = weights_of_moonshot(layer)
    ts = settings(layer, cfg.linear_attn_config["gate_lower_bound"])
    x = torch.randn(2, 72, cfg.hidden_size, generator=gen(1))
    with torch.no_grad():
        ref = layer(x)
        assert rel(kda.kda_attention(ts, lin, w, x, None, None), ref) < LAYER_TOL
        # prefill 69 tokens with a cache, then 3 one-token steps, against Moonshot's cache
        cache = m.KimiDynamicCache(cfg)
        state = kda.KDAState()
        outs, refs = [], []
        for lo, hi in ((0, 69), (69, 70), (70, 71), (71, 72)):
            refs.append(layer(x[:, lo:hi], cache_params=cache))
            outs.append(kda.kda_attention(ts, lin, w, x[:, lo:hi], None, state))
        assert rel(torch.cat(outs, 1), ref) < LAYER_TOL
        assert rel(torch.cat(refs, 1), ref) < LAYER_TOL  # the oracle agrees with itself
        # Moonshot keeps the recurrent state [B, H, V, K] (transpose_state_layout)
        assert rel(state.recurrent, cache.recurrent_states[0].transpose(-1, -2)) < LAYER_TOL
        assert state.recurrent.shape == (2, 4, 16, 16) and state.q_conv.shape == (2, 64, 3)
        assert state.nbytes() == 2 * 4 * 16 * 16 * 4 + 3 * (2 * 64 * 3 * 4)


@pytest.mark.parametrize("side", ["left", "right", "both"])
def test_layer_vs_moonshot_padding(side):
    m, cfg, layer = moonshot_layer(seed=1)
    w = weights_of_moonshot(layer)
    ts = settings(layer, -5.0)
    b, s = 3, 20
    x = torch.randn(b, s, cfg.hidden_size, generator=gen(2))
    mask = torch.ones(b, s, dtype=torch.long)
    if side in ("left", "both"):
        mask[0, :6] = 0
        mask[2, :1] = 0
    if side in ("right", "both"):
        mask[1, 13:] = 0
        mask[2, 17:] = 0
    nxt = torch.randn(b, 1, cfg.hidden_size, generator=gen(3))
    with torch.no_grad():
        cache = m.KimiDynamicCache(cfg)
        ref = layer(x, attention_mask=mask, cache_params=cache)
        ref_next = layer(nxt, cache_params=cache)  # decode: the state holds real tokens only
        state = kda.KDAState()
        out = kda.kda_attention(ts, lin, w, x, mask, state)
        out_next = kda.kda_attention(ts, lin, w, nxt, None, state)
    real = mask.bool()
    assert rel(out[real], ref[real]) < LAYER_TOL
    assert (out[~real] == 0).all() and (ref[~real] == 0).all()
    assert rel(out_next, ref_next) < LAYER_TOL


def test_layer_tensor_parallel_head_slices_sum_to_the_layer():
    _, cfg, layer = moonshot_layer(seed=2)
    w = weights_of_moonshot(layer, pad_a_log=False)
    ts = settings(layer, -5.0)
    d = layer.head_dim
    x = torch.randn(1, 30, cfg.hidden_size, generator=gen(4))
    with torch.no_grad():
        full = kda.kda_attention(ts, lin, w, x, None, None)
        parts = []
        for heads in (slice(0, 1), slice(1, 4)):
            rows = slice(heads.start * d, heads.stop * d)
            r = W(w)
            for key in ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d"):
                r[f"linear_attention.{key}"] = w[f"linear_attention.{key}"][rows]
            for key in ("f_b_proj", "g_proj", "dt_bias"):
                r[f"linear_attention.{key}"] = w[f"linear_attention.{key}"][rows]
            r["linear_attention.b_proj"] = w["linear_attention.b_proj"][heads]
            r["linear_attention.A_log"] = w["linear_attention.A_log"][heads]
            r["linear_attention.o_proj"] = w["linear_attention.o_proj"][:, rows]
            parts.append(kda.kda_attention(ts, lin, r, x, None, None))
    assert rel(parts[0] + parts[1], full) < LAYER_TOL


def transformers_layer(seed=0):
    cfg = TfKimiLinearConfig(
        hidden_size=64,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        linear_attn_config={
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "kda_layers": [1],
            "full_attn_layers": [2],
        },
    )
    layer = tkl.KimiLinearDeltaAttention(cfg, layer_idx=0).float().eval()
    mo.randomize(layer, seed, std=0.15)
    sd = {k: v.detach() for k, v in layer.state_dict().items()}
    w = W()
    p = "linear_attention."
    q_conv, k_conv, v_conv = sd.pop("conv1d.weight").chunk(3, dim=0)
    w.update({p + "q_conv1d": q_conv, p + "k_conv1d": k_conv, p + "v_conv1d": v_conv})
    for name, t in sd.items():
        key = name.removesuffix(".weight").removeprefix("forget_gate.")
        w["norms.o_norm" if key == "o_norm" else p + key] = t
    ts = kda.KDASettings(4, 16, 4, None, cfg.rms_norm_eps)
    return cfg, layer, w, ts


def test_layer_vs_transformers():
    cfg, layer, w, ts = transformers_layer()
    assert "linear_attention.g_a_proj" in w and "linear_attention.g_proj" not in w
    assert w["linear_attention.A_log"].shape == (1, 1, 4, 1)
    x = torch.randn(2, 70, 64, generator=gen(6))
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :9] = 0  # left padding: transformers zeroes it, we drop it: the same here
    with torch.no_grad():
        ref = layer(x)
        assert rel(kda.kda_attention(ts, lin, w, x, None, None), ref) < LAYER_TOL
        ref_m = layer(x, attention_mask=mask)
        out_m = kda.kda_attention(ts, lin, w, x, mask, None)
        assert rel(out_m[mask.bool()], ref_m[mask.bool()]) < LAYER_TOL
        # prefill + decode with transformers' own cache
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=cfg)
        state = kda.KDAState()
        refs, outs = [], []
        for lo, hi in ((0, 66), (66, 67), (67, 68)):
            refs.append(layer(x[:, lo:hi], cache=cache))
            outs.append(kda.kda_attention(ts, lin, w, x[:, lo:hi], None, state))
        assert rel(torch.cat(refs, 1), ref[:, :68]) < LAYER_TOL
        assert rel(torch.cat(outs, 1), ref[:, :68]) < LAYER_TOL


# -- errors ------------------------------------------------------------------------------
def test_bad_weights_and_state_are_named():
    _, cfg, layer = moonshot_layer(seed=3)
    w = weights_of_moonshot(layer)
    ts = settings(layer, -5.0)
    x = torch.randn(1, 4, cfg.hidden_size)
    short = W(w)
    short["linear_attention.A_log"] = w["linear_attention.A_log"][:2]
    with pytest.raises(CheckpointError, match="A_log has 2 entries for 4 heads"):
        kda.kda_attention(ts, lin, short, x, None, None)
    bad = W(w)
    bad["linear_attention.k_conv1d"] = w["linear_attention.k_conv1d"][..., :3]
    with pytest.raises(CheckpointError, match="k_conv1d has shape"):
        kda.kda_attention(ts, lin, bad, x, None, None)
    state = kda.KDAState()
    kda.kda_attention(ts, lin, w, x, None, state)
    with pytest.raises(ConfigError, match="cached state is for batch 1"):
        kda.kda_attention(ts, lin, w, torch.randn(2, 1, cfg.hidden_size), None, state)
    with pytest.raises(ConfigError, match="attention_mask"):
        kda.kda_attention(ts, lin, w, x, torch.ones(1, 2), None)
    with pytest.raises(ConfigError, match="gate_lower_bound must be negative"):
        kda.KDASettings(4, 16, 4, 5.0, 1e-5)

"""Calibration quality on the trained fixtures (tests/trained.py), and smoothing's
mappings on every family the runtime runs.

Quality: mean KL divergence of the next-token distributions on held-out text (never
trained on, never calibrated on: the calibration set is a jsonl of the fixtures' training
documents; the built-in corpus would hold the held-out ones) between the
bf16 model and the quantized output, both run by our runtime with activation fake
quantization (the runtime's agreement with transformers + compressed-tensors for these
schemes is tests/test_quant_oracle.py's; the AWQ output is also loaded by transformers
here). The issue's targets, measured on the llama fixture:

- GPTQ w4a16 <= 0.5 x RTN w4a16; AWQ w4a16-asym <= 0.95 x RTN w4a16-asym;
- SmoothQuant + w8a8 < w8a8; static fp8 <= 1.2 x fp8-dynamic.

Smoothing must not change what a layer computes before quantization: with random
scales on every mapping :func:`k3convert.calibrate.smooth.layer_mappings` finds, the
logits stay those of the unsmoothed model (a mapping that missed a reader of a smoothed
input, or scaled a non-linear one, would change them).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from k3convert.calibrate.sequential import OverlaySource, SequentialOptions
from k3convert.calibrate.smooth import (
    Mapping,
    Smoothing,
    Statistics,
    layer_mappings,
    smoothquant_search,
)
from k3convert.checkpoint.reader import open_checkpoint
from k3convert.pipeline.quantize import plan_quantization, quantize
from k3convert.quant.schemes import get_scheme
from k3convert.runtime.runtime import Runtime
from tests import outliers
from tests.models import QUANT_FAMILIES, kimi_linear, save_model
from tests.outliers import with_outlier_channels
from tests.trained import (  # noqa: F401  (fixtures)
    corpus_documents,
    heldout_blocks,
    split_corpus,
    trained_dsv3,
    trained_llama,
)

HELD = 24  # held-out blocks of 128 tokens
# smooth_tokens: AWQ's / SmoothQuant's losses over every calibration token (32 x 128). On
# the MoE fixture a 1024-token loss overfits: AWQ 5.60e-3 vs RTN 5.68e-3 (0.99x), with
# all 4096 tokens 5.40e-3 (0.95x)
CAL = dict(num_samples=32, seq_len=128, smooth_tokens=4096, awq_grid=10)


def _logits(path, ids: torch.Tensor) -> torch.Tensor:
    rt = Runtime(open_checkpoint(path), dtype="fp32", prefetch=False)
    try:
        return torch.cat([rt.forward(ids[i : i + 8]) for i in range(0, len(ids), 8)])
    finally:
        rt.close()


def _kl(ref: torch.Tensor, q: torch.Tensor) -> float:
    p, lq = ref.log_softmax(-1), q.log_softmax(-1)
    return float((p.exp() * (p - lq)).sum(-1).mean())


class _Quality:
    """Quantizes one trained fixture with each (scheme, algorithm) once, caching KL."""

    def __init__(self, model: Path, root: Path):
        self.model, self.root = model, root
        tok = transformers.AutoTokenizer.from_pretrained(model)
        rows = (model / "heldout.jsonl").read_text().splitlines()
        self.ids = heldout_blocks(tok, [json.loads(r)["text"] for r in rows])[:HELD]
        self.ref = _logits(model, self.ids)
        self.outs: dict[tuple, Path] = {}
        self.kls: dict[tuple, float] = {}
        self.train = root / "train.jsonl"
        train, _ = split_corpus(corpus_documents())
        self.train.write_text("".join(json.dumps({"text": t}) + "\n" for t in train))

    def out(self, scheme: str, algorithm: str, **kw) -> Path:
        key = (scheme, algorithm, tuple(sorted(kw.items())))
        if key not in self.outs:
            out = self.root / f"{scheme}-{algorithm}-{len(self.outs)}"
            kw = dict(kw)
            wobs = kw.pop("weight_observer", None)  # quantize's, not a calibration option
            opts = None
            if algorithm != "rtn":
                opts = SequentialOptions(dataset=self.train, **{**CAL, **kw})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize(src=self.model, out=out, scheme=scheme, calibrate=opts,
                         algorithm=algorithm, progress=False, weight_observer=wobs)  # fmt: skip
            self.outs[key] = out
        return self.outs[key]

    def kl(self, scheme: str, algorithm: str, **kw) -> float:
        key = (scheme, algorithm, tuple(sorted(kw.items())))
        if key not in self.kls:
            self.kls[key] = _kl(self.ref, _logits(self.out(scheme, algorithm, **kw), self.ids))
        return self.kls[key]


@pytest.fixture(scope="module")
def llama_q(trained_llama, tmp_path_factory):  # noqa: F811
    return _Quality(trained_llama, tmp_path_factory.mktemp("quality-llama"))


@pytest.fixture(scope="module")
def dsv3_q(trained_dsv3, tmp_path_factory):  # noqa: F811
    return _Quality(trained_dsv3, tmp_path_factory.mktemp("quality-dsv3"))


def test_gptq_w4a16_halves_rtn_kl(llama_q):
    rtn, gptq = llama_q.kl("w4a16", "rtn"), llama_q.kl("w4a16", "gptq", num_samples=64)
    assert gptq <= 0.5 * rtn, (gptq, rtn)


def test_gptq_fp_target_lowers_kl(llama_q):
    """GPTQ with its target moved half way to the full-precision model's outputs
    (gptq_fp_target 0.5, GPTAQ-style) against plain GPTQ on the same calibration set,
    with either weight observer (both computed before either is judged)."""
    got = {}
    for obs in ("minmax", "mse"):
        kw = {"num_samples": 64} if obs == "minmax" else {"num_samples": 64, "weight_observer": obs}
        plain = llama_q.kl("w4a16", "gptq", **kw)
        fpt = llama_q.kl("w4a16", "gptq", gptq_fp_target=0.5, **kw)
        print(f"GPTQ w4a16 ({obs}) KL: plain {plain:.4e}, gptq_fp_target 0.5 {fpt:.4e}")
        got[obs] = (fpt, plain)
    # with the mse observer (the int4 presets' pairing) the fp target gains ~2 % wherever
    # measured; with minmax the gain is within the kernels' spread on an AMX Xeon (whose
    # trained fixture differs: tests/trained_reference.json): 0.995x to 1.009x across
    # ATEN_CPU_CAPABILITY default / avx2 / avx512 (below 0.99x on the EPYCs), so there it
    # must only not lose
    fpt, plain = got["mse"]
    assert fpt <= 0.99 * plain, ("mse", fpt, plain)
    fpt, plain = got["minmax"]
    assert fpt <= 1.015 * plain, ("minmax", fpt, plain)


def test_gptq_nvfp4a16_and_its_scale_search(llama_q):
    """GPTQ for NVFP4 weights (compressed-tensors' NVFP4A16) on the llama fixture: below
    0.6x round to nearest's KL (measured 0.48x), and with the mse observer (the best of
    three sweeps on searched scales) below 0.95x GPTQ's on round to nearest's scales
    (measured 0.83x); the round-to-nearest scale search alone below 0.85x RTN (0.73x)."""
    rtn = llama_q.kl("nvfp4a16", "rtn")
    rtn_mse = llama_q.kl("nvfp4a16", "rtn", weight_observer="mse")
    gptq = llama_q.kl("nvfp4a16", "gptq", num_samples=64)
    mse = llama_q.kl("nvfp4a16", "gptq", num_samples=64, weight_observer="mse")
    print(f"nvfp4a16 KL: rtn {rtn:.4e}, rtn+mse {rtn_mse:.4e}, gptq {gptq:.4e}, "
          f"gptq+mse {mse:.4e}")  # fmt: skip
    assert gptq <= 0.6 * rtn and mse <= 0.95 * gptq and rtn_mse <= 0.85 * rtn


def test_awq_w4a16_asym_beats_rtn(llama_q):
    rtn, awq = llama_q.kl("w4a16-asym", "rtn"), llama_q.kl("w4a16-asym", "awq")
    assert awq <= 0.95 * rtn, (awq, rtn)


def test_awq_clip_step_lowers_kl(llama_q):
    """AWQ's clip step (on by default: each int Linear's group ranges searched on its
    output error over the calibration tokens) against AWQ's scales alone, and against
    the data-free range search (the mse weight observer) after them."""
    clip = llama_q.kl("w4a16-asym", "awq")
    plain = llama_q.kl("w4a16-asym", "awq", awq_clip=False)
    print(f"AWQ w4a16-asym KL: clip step {clip:.3e}, without {plain:.3e}")
    assert clip <= 0.85 * plain, (clip, plain)


def _tf_logits(path, ids, **kw) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    with torch.no_grad():
        return m.eval()(ids).logits


def test_awq_output_judged_by_transformers(llama_q):
    """The smoothed norms and AWQ's weights are an ordinary compressed-tensors checkpoint:
    transformers (+ compressed-tensors' decompressor) loads it, and by *its* logits AWQ
    beats RTN by the same margin, with the KL our runtime measures (compressed-tensors
    dequantizes in the scale's dtype, bf16, we in float32: the KLs differ slightly)."""
    from transformers import CompressedTensorsConfig

    ct = {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    ids = llama_q.ids[:8]
    ref = _tf_logits(llama_q.model, ids)
    awq_dir, rtn_dir = llama_q.out("w4a16-asym", "awq"), llama_q.out("w4a16-asym", "rtn")
    awq, rtn = _kl(ref, _tf_logits(awq_dir, ids, **ct)), _kl(ref, _tf_logits(rtn_dir, ids, **ct))
    assert awq <= 0.95 * rtn, (awq, rtn)
    ours = _kl(_logits(llama_q.model, ids), _logits(awq_dir, ids))
    assert abs(awq - ours) <= 0.1 * ours, (awq, ours)
    cfg = json.loads((awq_dir / "config.json").read_text())
    assert '"algorithm": "awq"' in json.dumps(cfg), "provenance records the algorithm"
    # the smoothed norms really differ from the source's
    n = "model.layers.1.post_attention_layernorm.weight"
    assert not torch.equal(open_checkpoint(llama_q.model).get(n), open_checkpoint(awq_dir).get(n))


def test_smoothquant_w8a8_beats_plain_w8a8(llama_q):
    plain, sq = llama_q.kl("w8a8", "rtn"), llama_q.kl("w8a8", "smoothquant")
    assert sq < plain, (sq, plain)
    assert llama_q.kl("w8a8", "smoothquant+gptq") < plain
    assert llama_q.kl("w8a8", "smoothquant", alpha_search=True) < plain


def test_static_fp8_within_1_2x_of_dynamic(llama_q):
    static, dyn = llama_q.kl("fp8", "static"), llama_q.kl("fp8-dynamic", "rtn")
    assert static <= 1.2 * dyn, (static, dyn)


def test_moe_fixture_gptq_and_awq(dsv3_q):
    """The MoE fixture (MLA, 8 routed experts, a shared expert): GPTQ well below RTN, AWQ
    (its post-attention norm shared by the router, every expert and the shared expert)
    below RTN with a margin. Group 32: its MLA / expert widths (32, 64) do not divide by
    128. Measured 0.951x (avx512); the 2 % margin covers the CPU-dependent rounding of
    the calibration itself (the fixture is the same bytes everywhere)."""
    rtn, gptq = dsv3_q.kl("int4-g32", "rtn"), dsv3_q.kl("int4-g32", "gptq")
    assert gptq <= 0.7 * rtn, (gptq, rtn)
    rtn_a, awq = dsv3_q.kl("int4-g32-asym", "rtn"), dsv3_q.kl("int4-g32-asym", "awq")
    assert awq <= 0.98 * rtn_a, (awq, rtn_a)
    # the router read the smoothed norm: its columns were scaled to compensate
    src, q = open_checkpoint(dsv3_q.model), open_checkpoint(dsv3_q.out("int4-g32-asym", "awq"))
    router = "model.layers.1.mlp.gate.weight"
    assert not torch.equal(src.get(router), q.get(router))


def test_moe_fixture_smoothquant_no_worse_than_plain_w8a8(dsv3_q):
    """SmoothQuant (alpha 0.5) on the MoE fixture: a mapping is smoothed only where that
    lowers its W8A8 error by SQ_MIN_GAIN, so it cannot lose to plain w8a8 the way alpha
    0.5 everywhere did (7.0e-4 vs 3.9e-4). "No worse" with the rounding of the held-out
    KL's own float32 sums: 0.5 %."""
    plain, sq = dsv3_q.kl("w8a8", "rtn"), dsv3_q.kl("w8a8", "smoothquant")
    assert sq <= 1.005 * plain, (sq, plain)


# -- SmoothQuant where there are outliers to move: tests/outliers.py ------------------------
@pytest.fixture(scope="module")
def dsv3_moe_outliers(trained_dsv3, tmp_path_factory):  # noqa: F811
    """The MoE fixture with 4 of its 128 residual channels 32x larger where the MoE
    layers' post-attention norms hand them to the router, the shared expert and the
    routed experts (and nowhere else): the same function, bit for bit."""
    out = tmp_path_factory.mktemp("dsv3-outliers") / "model"
    return with_outlier_channels(trained_dsv3, out, norms=r"layers\.[12]\.post_attention")


@pytest.fixture(scope="module")
def dsv3_outl_q(dsv3_moe_outliers, tmp_path_factory):
    return _Quality(dsv3_moe_outliers, tmp_path_factory.mktemp("quality-dsv3-outliers"))


def test_smoothquant_moves_outliers_for_nvfp4_w4a4(dsv3_outl_q):
    """SmoothQuant with NVFP4 (W4A4) where the MoE block's input has outlier channels:
    each mapping's alpha searched on its balance Linears' error with their inputs
    fake-quantized as NVFP4 under the input global scale calibration will store, the
    weights under their fused set's global scale (one per gate / up, per expert's w1 /
    w3, from the smoothed weights). Against GPTQ alone, whose activations' group scales
    the outliers flatten: measured (avx512) 2.89e-2 GPTQ, 1.64e-2 SmoothQuant + GPTQ
    (0.57x; bench_calibrate's fixture, outliers at every norm: 0.08x)."""
    gptq = dsv3_outl_q.kl("nvfp4", "gptq")
    sq = dsv3_outl_q.kl("nvfp4", "smoothquant+gptq", alpha_search=True)
    print(f"MoE outliers, nvfp4 (W4A4) KL: gptq {gptq:.4e}, smoothquant+gptq {sq:.4e}")
    assert sq <= 0.7 * gptq, (sq, gptq)


def test_outlier_copy_computes_what_the_fixture_does(trained_dsv3, dsv3_moe_outliers):  # noqa: F811
    """By transformers' own DeepseekV3 in float32: the same logits bit for bit, while the
    MoE block's input carries the outlier channels (their largest magnitude 32x that of
    the fixture's on the same tokens)."""
    rows = (trained_dsv3 / "heldout.jsonl").read_text().splitlines()
    tok = transformers.AutoTokenizer.from_pretrained(trained_dsv3)
    ids = heldout_blocks(tok, [json.loads(r)["text"] for r in rows])[:4]
    seen: dict[str, torch.Tensor] = {}
    logits = {}
    for tag, path in (("fixture", trained_dsv3), ("outliers", dsv3_moe_outliers)):
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hook = m.model.layers[1].mlp.register_forward_hook(
            lambda mod, i, o, tag=tag: seen.__setitem__(tag, i[0].detach())
        )
        with torch.no_grad():
            logits[tag] = m(ids).logits
        hook.remove()
    assert torch.equal(logits["fixture"], logits["outliers"])
    chans = list(outliers.CHANNELS)
    ratio = seen["outliers"][..., chans].abs().amax() / seen["fixture"][..., chans].abs().amax()
    assert float(ratio) == outliers.FACTOR, float(ratio)


def test_moe_smoothquant_moves_outlier_channels_into_the_weights(dsv3_outl_q):
    """Where a MoE block's input has outlier channels, SmoothQuant's norm -> router +
    shared + routed experts mapping takes them into the weights: measured (avx512)
    plain w8a8 1.29e-3, smoothquant 4.20e-4 (0.32x), with --alpha-search 3.91e-4 (0.30x,
    the fixture's own plain w8a8 KL: the outliers fully undone). Without that mapping
    (a MoE-blind SmoothQuant, as one that skips a norm read by a kept router) the KL
    stays at plain's."""
    plain = dsv3_outl_q.kl("w8a8", "rtn")
    sq = dsv3_outl_q.kl("w8a8", "smoothquant")
    searched = dsv3_outl_q.kl("w8a8", "smoothquant", alpha_search=True)
    print(f"MoE outliers, w8a8 KL: plain {plain:.4e}, smoothquant {sq:.4e}, "
          f"searched {searched:.4e}")  # fmt: skip
    assert sq <= 0.5 * plain, (sq, plain)
    assert searched <= 0.5 * plain, (searched, plain)
    # each MoE layer's post-attention norm was smoothed and its router compensated
    src = open_checkpoint(dsv3_outl_q.model)
    q = open_checkpoint(dsv3_outl_q.out("w8a8", "smoothquant"))
    for layer in (1, 2):
        for n in ("post_attention_layernorm.weight", "mlp.gate.weight"):
            n = f"model.layers.{layer}.{n}"
            assert not torch.equal(src.get(n), q.get(n)), n


# -- smoothing preserves the function ----------------------------------------------------
def _family(name: str, root: Path) -> Path:
    if name == "kimi_linear":
        return kimi_linear(root / name)
    if name == "kimi_k3":
        from k3convert.synth import synthesize

        synthesize(config="kimi-k3", out=root / name, tiny=True, encoding="plain", seed=3)
        return root / name
    return save_model(name, root / name, **QUANT_FAMILIES.get(name, {}))


@pytest.mark.parametrize("pow2", [False, True], ids=["any-scale", "power-of-two"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k3"])
def test_random_smoothing_preserves_logits(family, pow2, tmp_path):
    """Random scales on every mapping keep the logits (a missed reader, or a non-linear
    one scaled, would not). Power-of-two scales keep them bit for bit, with every smoothed
    tensor stored in the source's dtype (bf16 norms and routers included): each product
    ``(x_j / s_j)(w_ij s_j)`` is then the same float, so any difference is a mapping bug,
    not rounding."""
    model = _family(family, tmp_path)
    ckpt, plan = plan_quantization(src=model, scheme="w8a8")
    rows = {r.name: r for r in plan.rows}
    src = OverlaySource(ckpt)
    rt = Runtime(src, dtype="fp32", prefetch=False, act_quant=False)
    g = torch.Generator().manual_seed(0)
    try:
        ids = torch.randint(3, 100, (2, 16), generator=g)
        ref = rt.forward(ids)
        sm, n_maps, labels = Smoothing(), 0, []
        for i in range(rt.num_layers):
            keys = {e.key: e.name for e in rt.plan.units[f"layer.{i}"].values()}
            for m in layer_mappings(rt.text, i, keys, rows, norms_only=False):
                width = rows[m.balance[0]].shape[1]
                scale = torch.exp(torch.empty(width).uniform_(-1.5, 1.5, generator=g))
                sm.add(m, torch.exp2(torch.log2(scale).round()) if pow2 else scale)
                n_maps += 1
                labels.append(m.label)
        src.overrides = {
            n: sm.apply(n, ckpt.get(n).float()).to(ckpt.meta(n).dtype if pow2 else torch.float32)
            for n in sm.touched()
        }
        rt.loader.release()
        got = rt.forward(ids)
    finally:
        rt.close()
    assert n_maps >= rt.num_layers, labels  # at least one site per layer
    assert any("post_attention_layernorm" in lb for lb in labels), labels
    if pow2:
        assert torch.equal(got, ref), (got - ref).abs().max()
    else:
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


# -- SmoothQuant's score: what the checkpoint quantizes where it runs --------------------
def test_smoothquant_scores_routed_experts_on_their_weights_alone():
    """Routed experts' inputs are not activation-quantized where the checkpoint runs
    (transformers' compressed-tensors integration, the runtime by default), so a mapping
    whose gain is all in the activation error of routed readers is not smoothed: with the
    readers ``plain`` the candidate must beat no smoothing on the weights' error alone.
    A channel of 100x outliers makes alpha 0.5 cut the W8A8 error well past SQ_MIN_GAIN
    when the inputs are quantized; on the weights alone it only adds error."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    x[:, 3] *= 100.0
    stats = Statistics(cap=512, batches=1)
    stats.add("e0.up", x, sample=True)
    stats.add("e0.down", x, sample=True)
    # integer weights with 127 in every row: int8 per channel represents them exactly,
    # so unsmoothed their error is zero and smoothing can only add to it
    w = {}
    for n in ("e0.up", "e0.down"):
        t = torch.randint(-127, 128, (32, 64), generator=g).float()
        t[:, 0] = 127.0
        w[n] = t
    scheme = get_scheme("w8a8")
    m = Mapping(label="t", prev="norm", prev_is_norm=True, balance=("e0.up", "e0.down"),
                source="e0.up")  # fmt: skip
    weight, scheme_of = w.__getitem__, lambda n: scheme
    s, alpha = smoothquant_search(m, weight, scheme_of, stats, alphas=(0.5,))
    assert alpha == 0.5 and not torch.equal(s, torch.ones(64))
    s, alpha = smoothquant_search(m, weight, scheme_of, stats, (0.5,), frozenset(m.balance))
    assert alpha is None and torch.equal(s, torch.ones(64))
    # a routed reader beside a quantized-input one: the routed reader's error is its
    # weights' alone (here it dominates: the other reader's weights are 1000x smaller)
    w["e0.up"] = w["e0.up"] * 2.0**-10
    _, alpha = smoothquant_search(m, weight, scheme_of, stats, (0.5,), frozenset({"e0.down"}))
    assert alpha is None
    _, alpha = smoothquant_search(m, weight, scheme_of, stats, (0.5,), frozenset({"e0.up"}))
    assert alpha == 0.5

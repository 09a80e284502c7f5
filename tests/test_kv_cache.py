"""Calibrated FP8 KV-cache scales (``kv_cache_scheme`` + ``self_attn.k_scale`` /
``v_scale``): architecture tables, runtime observation and fake quantization, shard and
verify.

Oracles:

- llama (GQA): transformers 5.24 + compressed-tensors 0.20.1 loading the checkpoint.
  compressed-tensors quantizes K / V in ``QuantizedKVCache``, which it installs only on
  attention modules whose ``forward`` takes ``past_key_value(s)``; transformers 5.24
  renamed that argument ``cache``, so on load it installs nothing and drops the
  scales as UNEXPECTED keys (asserted below, so a fixed release shows up). The test
  then installs compressed-tensors' own QuantizedKVCache, qparams and
  ``forward_quantize`` by hand on every attention module, with a pre-hook that hands the
  cache in under the new name; everything numeric is compressed-tensors' code.
- deepseek_v3 (MLA): compressed-tensors has no MLA latent-cache quantization, so the
  reference is transformers' DeepseekV3 with the latent (kv_a_layernorm's output) and
  the roped shared key fake-quantized by the formula (forward hook / rope wrapper).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3convert.arch import resolve, validate_source
from k3convert.checkpoint import open_checkpoint
from k3convert.errors import CheckpointError, ConfigError, NonFiniteError
from k3convert.formats import FP8_MAX
from k3convert.pipeline import quantize
from k3convert.quant.kvcache import kv_cache_scheme, kv_scale_tensors
from k3convert.runtime import Runtime
from k3convert.runtime.cache import KVCache
from tests.models import save_model

TOL = 1e-3  # as the activation-quantization oracle tests (test_runtime_quant.py)


def _ids(b=2, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 160, (b, s), generator=g)


def _observe(path, **kw) -> dict:
    """Per-layer absmax of what enters the KV cache (act_quant off: calibration)."""
    seen: dict = {}

    def hook(layer, kind, t):
        d = seen.setdefault(layer, {})
        d[kind] = max(d.get(kind, 0.0), float(t.abs().max()))

    with Runtime(open_checkpoint(path), act_quant=False, **kw) as rt:
        h = rt.add_kv_hook(hook)
        rt.forward(_ids())
        h.remove()
    return seen


def _with_kv(src: Path, out: Path, scales: dict, scheme=True) -> Path:
    """A copy of checkpoint ``src`` with the scale tensors and the kv_cache_scheme."""
    shutil.copytree(src, out)
    sd = load_file(out / "model.safetensors")
    sd.update(scales)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    if scheme:
        qc = cfg.setdefault("quantization_config", {"quant_method": "compressed-tensors",
                                                   "config_groups": {}})  # fmt: skip
        qc["kv_cache_scheme"] = kv_cache_scheme()
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _gqa(root: Path, family: str):
    """(quantized fp8-dynamic ``family``, the same with calibrated KV scales, the source)."""
    src = save_model(family, root / "src")
    q = root / "q"
    quantize(src=src, out=q, scheme="fp8-dynamic", progress=False)
    cfg = json.loads((q / "config.json").read_text())
    scales = kv_scale_tensors(_observe(q), cfg)
    return q, _with_kv(q, root / "kv", scales), src


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _gqa(tmp_path_factory.mktemp("kv_llama"), "llama")


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_dsv3")
    src = save_model("deepseek_v3", root / "src")
    cfg = json.loads((src / "config.json").read_text())
    obs = _observe(src)
    return src, _with_kv(src, root / "kv", kv_scale_tensors(obs, cfg)), obs


def _forward(path, ids, **kw):
    with Runtime(open_checkpoint(path), **kw) as rt:
        return rt.forward(ids)


def _rel(a, ref) -> float:
    return float((a - ref).abs().max()) / float(ref.abs().max())


def fq(t: torch.Tensor, s: float) -> torch.Tensor:
    """The formula: clamp(t / s, -448, 448) -> e4m3 -> * s, in t's dtype."""
    s = torch.tensor(s, dtype=t.dtype)
    return (t / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(t.dtype) * s


# -- writer-side helpers ----------------------------------------------------------------
def test_scheme_is_compressed_tensors_serialization():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False,
                            symmetric=True)  # fmt: skip
    qc = QuantizationConfig(config_groups={}, kv_cache_scheme=args).to_dict()
    assert kv_cache_scheme() == qc["kv_cache_scheme"]
    assert QuantizationArgs.model_validate(kv_cache_scheme()) == args


def test_scale_tensors(dsv3):
    src, _, obs = dsv3
    cfg = json.loads((src / "config.json").read_text())
    t = kv_scale_tensors(obs, cfg)
    assert sorted(t) == [f"model.layers.{i}.self_attn.{k}_scale" for i in range(3) for k in "kv"]
    for i in range(3):
        k = t[f"model.layers.{i}.self_attn.k_scale"]
        assert k.shape == (1,) and k.dtype == torch.float32  # compressed-tensors: [1]
        want = max(obs[i]["latent"], obs[i]["k_rot"]) / 448
        assert float(k) == pytest.approx(want, rel=1e-6)
        assert torch.equal(k, t[f"model.layers.{i}.self_attn.v_scale"])
    gqa = kv_scale_tensors({0: {"k": 2.0, "v": 0.0}}, {**_llama_cfg(), "num_hidden_layers": 1})
    assert float(gqa["model.layers.0.self_attn.k_scale"]) == pytest.approx(2 / 448)
    v = float(gqa["model.layers.0.self_attn.v_scale"])
    assert v > 0 and v == pytest.approx(torch.finfo(torch.float32).eps)  # never 0
    with pytest.raises(ConfigError, match="finite"):
        kv_scale_tensors({0: {"k": float("nan"), "v": 1.0}}, {**_llama_cfg(),
                                                             "num_hidden_layers": 1})  # fmt: skip
    with pytest.raises(ConfigError, match="no observation for attention layer"):
        kv_scale_tensors({0: {"k": 1.0, "v": 1.0}}, _llama_cfg())


@pytest.mark.parametrize(
    "family", ["llama", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k25", "kimi_linear",
               "kimi_k3"],
)  # fmt: skip
def test_scale_names_match_the_tables(family):
    """The writer's names are the ones every family's table accepts, on the right
    layers: attention layers only (hybrids: the MLA layers)."""
    if family == "kimi_k3":
        import k3convert.presets

        raw = json.loads((Path(k3convert.presets.__file__).parent / "kimi-k3.json").read_text())
    else:
        from tests.models import config_for

        raw = config_for(family).to_dict()
    arch, cfg = resolve(raw)
    text = getattr(cfg, "text", cfg)
    kda = getattr(text, "is_kda_layer", lambda i: False)
    layers = [i for i in range(text.num_layers) if not kda(i)]
    mla = hasattr(text, "kv_lora_rank")
    obs = {i: {"latent": 1.0, "k_rot": 2.0} if mla else {"k": 1.0, "v": 2.0} for i in layers}
    names = kv_scale_tensors(obs, raw)
    matched = arch.match(cfg, list(names))
    assert sorted((m.role.layer, m.role.kind) for m in matched.values()) == sorted(
        (i, k) for i in layers for k in ("k_scale", "v_scale")
    )
    assert all(m.role.keep and m.role.split == "replicate" for m in matched.values())
    rows = [r for r in arch.table(cfg) if r.kind in ("k_scale", "v_scale")]
    assert len(rows) == 2 and all(r.optional for r in rows)  # accepted, never implied


def _llama_cfg():
    from tests.models import config_for

    return config_for("llama").to_dict()


# -- GQA: the compressed-tensors oracle ---------------------------------------------------
def _ct_model(path):
    """transformers + compressed-tensors on ``path``, K / V quantized by compressed-tensors'
    QuantizedKVCache (installed by hand: see the module doc)."""
    import transformers as tf
    from compressed_tensors.modeling.kvcache import KV_CACHE_ATTR, initialize_hooked_kv_cache
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStatus,
    )
    from compressed_tensors.quantization.lifecycle.initialize import initialize_attn_qparams

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        m = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            m(_ids()[:, :2])  # compressed-tensors decompresses on the first forward
    ck = open_checkpoint(path)
    args = QuantizationArgs.model_validate(ck.config["quantization_config"]["kv_cache_scheme"])
    for i, layer in enumerate(m.model.layers):
        attn = layer.self_attn
        # transformers 5.24 + compressed-tensors 0.20.1 left the attention unquantized
        assert not hasattr(attn, "k_scale") and not hasattr(attn, KV_CACHE_ATTR)
        attn.quantization_scheme = QuantizationScheme(targets=["re:.*self_attn$"],
                                                      input_activations=args)  # fmt: skip
        initialize_hooked_kv_cache(m, attn)
        initialize_attn_qparams(attn, attn.quantization_scheme, force_zero_point=False)
        attn.quantization_status = QuantizationStatus.FROZEN  # what apply_... would set
        for k in ("k_scale", "v_scale"):
            getattr(attn, k).data.copy_(ck.get(f"model.layers.{i}.self_attn.{k}"))

        def shim(module, a, kw):  # the cache under transformers 5.24's argument name
            kv = getattr(module, KV_CACHE_ATTR)
            kv.add_past_key_values(kw.get("cache"))
            kw["cache"] = kv
            return a, kw

        attn.register_forward_pre_hook(shim, with_kwargs=True)
    return m


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: K after k_norm and rope
def test_gqa_matches_compressed_tensors(family, llama, tmp_path):
    q, kv, _ = llama if family == "llama" else _gqa(tmp_path, family)
    ids = _ids()
    m = _ct_model(kv)
    with torch.no_grad():
        ref = m(ids).logits
    on = _forward(kv, ids)
    d = _rel(on, ref)
    no_kv = _rel(_forward(q, ids), ref)  # the same checkpoint, K / V unquantized
    what = f"{family} fp8-dynamic + fp8 KV: ours vs compressed-tensors"
    print(f"{what} {d:.1e} (no KV quant {no_kv:.1e})")
    assert d <= TOL, d
    assert no_kv > 5 * TOL, f"KV quantization changed nothing ({no_kv:.1e})"
    # cache path: prefill + decode steps == compressed-tensors with a DynamicCache
    import transformers as tf

    cache, tcache = KVCache(), tf.DynamicCache(config=m.config)
    with Runtime(open_checkpoint(kv)) as rt, torch.no_grad():
        a = rt.forward(ids[:, :12], cache=cache)
        b = m(ids[:, :12], past_key_values=tcache, use_cache=True).logits
        steps = [(rt.forward(ids[:, j : j + 1], cache=cache),
                  m(ids[:, j : j + 1], past_key_values=tcache, use_cache=True).logits)
                 for j in range(12, 16)]  # fmt: skip
    assert _rel(a, b) <= TOL
    for x, y in steps:
        assert _rel(x, y) <= TOL
    # and our cache path equals our no-cache forward
    inc = torch.cat([a[:, -1:], *(x for x, _ in steps[:-1])], dim=1)
    assert _rel(inc, on[:, 11:15]) <= 1e-5


def test_gqa_hook_and_act_quant_off(llama):
    q, kv, _ = llama
    ids = _ids()
    seen = []
    with Runtime(open_checkpoint(kv), act_quant=False) as rt:
        assert not rt.kv_quant and rt.kv_scheme == kv_cache_scheme()
        h = rt.add_kv_hook(lambda i, k, t: seen.append((i, k, tuple(t.shape))))
        off = rt.forward(ids)
        h.remove()
        rt.forward(ids)
    assert seen == [(i, k, (2, 2, 16, 16)) for i in range(2) for k in "kv"]
    # no fake quantization at all: bit-identical to the checkpoint without scales
    assert torch.equal(off, _forward(q, ids, act_quant=False))
    with Runtime(open_checkpoint(kv)) as rt:
        assert rt.kv_quant
        rt.act_quant = False  # switched off between forwards
        assert torch.equal(rt.forward(ids), off)
    from k3convert.runtime.forward_cmd import run_forward

    on = run_forward(src=kv, ids="1 2 3 4")
    assert "; KV cache: fake-quantized (fp8 e4m3, calibrated per-layer scales)" in on
    assert "KV cache: NOT quantized" in run_forward(src=kv, ids="1 2 3 4", act_quant=False)
    assert "KV cache" not in run_forward(src=q, ids="1 2 3 4")
    # the hook sees the tensors before quantization, also with a cache
    got = []
    with Runtime(open_checkpoint(kv)) as rt:
        rt.add_kv_hook(lambda i, k, t: got.append((i, k, t.clone())))
        rt.forward(ids[:, :4], cache=KVCache())
    k0 = got[0][2]
    assert got[0][:2] == (0, "k") and k0.shape == (2, 2, 4, 16)
    s = float(open_checkpoint(kv).get("model.layers.0.self_attn.k_scale"))
    assert not torch.equal(fq(k0, s), k0)  # so quantization would have shown


# -- MLA ----------------------------------------------------------------------------------
def _dsv3_reference(src, ids, scales):
    """transformers' DeepseekV3 with the latent and the roped key fake-quantized by
    formula, per layer, with k_scale."""
    import transformers as tf
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as md

    with contextlib.redirect_stderr(io.StringIO()):
        m = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    current = {}
    handles = []
    for i, layer in enumerate(m.model.layers):
        s = float(scales[f"model.layers.{i}.self_attn.k_scale"])

        def norm_hook(mod, inp, out, s=s, i=i):
            current["s"] = s
            return fq(out, s)

        handles.append(layer.self_attn.kv_a_layernorm.register_forward_hook(norm_hook))
    originals = {n: getattr(md, n) for n in ("apply_rotary_pos_emb",
                                             "apply_rotary_pos_emb_interleave")}  # fmt: skip

    def wrap(fn):
        def rope(q, k, *a, **kw):
            q, k = fn(q, k, *a, **kw)
            return q, fq(k, current["s"])

        return rope

    try:
        for n, fn in originals.items():
            setattr(md, n, wrap(fn))
        with torch.no_grad():
            return m(ids).logits
    finally:
        for n, fn in originals.items():
            setattr(md, n, fn)
        for h in handles:
            h.remove()


def test_mla_latent_quantization(dsv3):
    src, kv, _ = dsv3
    ids = _ids()
    ck = open_checkpoint(kv)
    scales = {n: ck.get(n) for n in ck.names() if n.endswith("_scale")}
    ref = _dsv3_reference(src, ids, scales)
    seen = []
    with Runtime(ck) as rt:
        assert rt.kv_quant
        rt.add_kv_hook(lambda i, k, t: seen.append((i, k, tuple(t.shape))))
        on = rt.forward(ids)
    plain = _forward(src, ids)
    d, gap = _rel(on, ref), _rel(plain, ref)
    print(
        f"deepseek_v3 fp8 latent cache: ours vs formula reference {d:.1e} (unquantized {gap:.1e})"
    )
    assert d <= 1e-4, d
    assert gap > 50 * d
    assert seen == [(i, k, shp) for i in range(3)
                    for k, shp in (("latent", (2, 16, 16)), ("k_rot", (2, 1, 16, 8)))]  # fmt: skip
    # cache paths (expanded and latent layouts) agree with the no-cache forward
    for mla in ("expanded", "latent"):
        cache = KVCache(mla=mla)
        with Runtime(open_checkpoint(kv)) as rt:
            a = rt.forward(ids[:, :12], cache=cache)
            steps = [rt.forward(ids[:, j : j + 1], cache=cache) for j in range(12, 15)]
        inc = torch.cat([a[:, -1:], *steps], dim=1)
        e = _rel(inc, on[:, 11:15])
        print(f"  {mla} cache vs no cache: {e:.1e}")
        assert e <= 1e-5, (mla, e)


def test_verify_mla_tp2_decode(dsv3):
    """verify on the fly (planned tp=2 ranks) of the MLA checkpoint with scales: the
    candidate's cache is quantized, and an FP8 latent cache stores with the calibrated
    scales (the already-rounded values again), so decoding equals the full forward."""
    from k3convert.verify.run import run_verify

    src, kv, _ = dsv3
    rep = run_verify(candidate=kv, reference=str(src), layout="tp=2", decode=3,
                     kv_cache="fp8", mla_cache="latent", progress=False)  # fmt: skip
    assert rep["passed"], rep.get("failure")
    assert "KV cache fake-quantized to FP8" in rep["act_quant"]
    dec = rep["decode"]
    assert dec["passed"] and dec["argmax_equal"] and dec["kv_scales"].startswith("calibrated")
    assert dec["max_rel_err"] <= 1e-5 and dec["kld_vs_full"] <= 1e-9, dec
    assert rep["logits"]["kld"]["mean"] > 0  # the candidate is not the reference


def test_kda_layers_untouched(tmp_path):
    from tests.models import kimi_linear

    src = kimi_linear(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    obs = _observe(src)
    assert sorted(obs) == [2] and sorted(obs[2]) == ["k_rot", "latent"]  # layer 3 (1-based)
    kv = _with_kv(src, tmp_path / "kv", kv_scale_tensors(obs, cfg))
    ids = _ids()

    def layers(path, **kw):
        out = []
        with Runtime(open_checkpoint(path), **kw) as rt:
            logits = rt.forward(ids, on_layer=lambda i, h: out.append(h.clone()))
        return out, logits

    # the same files with the KV cache quantized and not (the scale-free source is another
    # file layout, whose offsets alone can move float rounding)
    quant, lq = layers(kv)
    base, lb = layers(kv, act_quant=False)
    assert torch.equal(base[0], quant[0]) and torch.equal(base[1], quant[1])  # KDA layers
    assert _rel(quant[2], base[2]) > 1e-4  # the MLA layer's cache is quantized
    assert _rel(quant[3], base[3]) > 1e-4 and not torch.equal(lb, lq)
    # a KDA layer's scale is refused by name
    bad = dict(kv_scale_tensors(obs, cfg))
    bad["model.layers.0.self_attn.k_scale"] = torch.tensor([0.01])
    shutil.rmtree(kv)
    _with_kv(src, kv, bad)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.k_scale.*KDA"):
        open_kv(kv)


def open_kv(path):
    ck = open_checkpoint(path)
    arch, cfg = resolve(ck.config)
    return validate_source(arch, cfg, ck, str(path))


def test_inspect_shows_scales(llama):
    from k3convert.inspect import format_report, inspect_path

    _, kv, _ = llama
    ck = open_checkpoint(kv)
    r = inspect_path(path=kv, tensors=True)
    k = [float(ck.get(f"model.layers.{i}.self_attn.k_scale")) for i in range(2)]
    assert r["kv_cache"]["scheme"] == kv_cache_scheme()
    assert r["kv_cache"]["layers_with_scales"] == r["kv_cache"]["attention_layers"] == 2
    assert r["kv_cache"]["k_scale"] == [min(k), max(k)]
    rows = [t for t in r["tensors"] if t["kind"] in ("k_scale", "v_scale")]
    assert len(rows) == 4 and all(t["keep"] and t["split"] == "replicate" for t in rows)
    text = format_report(r)
    assert "KV cache: float8 tensor static, scales on 2 of 2 attention layers" in text
    assert "model.layers.1.self_attn.v_scale" in text
    # a config alone: the scheme, not the tensors (the table does not imply them)
    cfg_only = inspect_path(path=kv / "config.json")
    assert cfg_only["kv_cache"] == {"scheme": kv_cache_scheme(), "attention_layers": 2}


# -- shard + verify -----------------------------------------------------------------------
def test_shard_tp2_and_verify(llama, tmp_path):
    from k3convert.shard import shard
    from k3convert.verify.run import run_verify

    _, kv, src = llama
    out = shard(src=kv, out=tmp_path / "s", tp=2, progress=False).out
    ref = open_checkpoint(kv)
    for r in (0, 1):
        files = sorted((Path(out) / f"rank{r:05d}").glob("*layer*"))
        assert len(files) == 2
        for i, f in enumerate(files):
            with safe_open(f, "pt") as fh:
                for k in "kv":
                    name = f"model.layers.{i}.self_attn.{k}_scale"
                    assert torch.equal(fh.get_tensor(name), ref.get(name)), (r, name)
    rep = run_verify(candidate=out, progress=False)
    assert rep["passed"], rep.get("failure")
    # the parallel runtime reads the scales back from the shards: a tp=2 pp=2 stream of the
    # unquantized source with the same scales (no activation quantization, whose
    # row-parallel local slices would differ from tp=1 by themselves) == the checkpoint
    from k3convert.runtime.parallel import ParallelRuntime
    from k3convert.runtime.ranks import stream_ranks
    from k3convert.stream import open_stream

    scales = {n: ref.get(n) for n in ref.names() if n.endswith(("k_scale", "v_scale"))}
    plain = _with_kv(src, tmp_path / "plain", scales)
    s2 = shard(src=plain, out=tmp_path / "s2", tp=2, pp=2, progress=False).out
    for r in range(4):  # stage 0 (ranks 0, 1) holds layer 0, stage 1 (ranks 2, 3) layer 1
        (unit,) = (Path(s2) / f"rank{r:05d}").glob("*layer*")
        with safe_open(unit, "pt") as fh:
            got = sorted(n for n in fh.keys() if n.endswith("_scale"))  # noqa: SIM118
        i = r // 2
        assert got == [f"model.layers.{i}.self_attn.{k}_scale" for k in "kv"], (r, got)
    ids = _ids()
    seen = []
    with ParallelRuntime(stream_ranks(open_stream(s2))) as prt:
        assert prt.kv_quant
        prt.add_kv_hook(lambda i, k, t: seen.append((i, k, tuple(t.shape))))
        tp2 = prt.forward(ids)
    # each rank its one local KV head (2 KV heads over tp=2), rank by rank
    assert seen == [(i, k, (2, 1, 16, 16)) for i in range(2) for _ in "rr" for k in "kv"]
    mine = _forward(plain, ids)
    d = _rel(tp2, mine)
    off = _rel(_forward(plain, ids, act_quant=False), mine)
    print(f"tp=2 pp=2 stream vs checkpoint, fp8 KV: {d:.1e} (KV quant off: {off:.1e})")
    assert d <= 1e-5 and off > 5 * TOL, (d, off)


# -- bad inputs ---------------------------------------------------------------------------
def test_bad_inputs(llama, tmp_path):
    q, kv, _ = llama
    scales = {n: open_checkpoint(kv).get(n) for n in open_checkpoint(kv).names()
              if n.endswith("k_scale") or n.endswith("v_scale")}  # fmt: skip
    # scales without a kv_cache_scheme
    p = _with_kv(q, tmp_path / "noscheme", scales, scheme=False)
    with pytest.raises(ConfigError, match="no kv_cache_scheme"):
        open_kv(p)
    with pytest.raises(ConfigError, match="no kv_cache_scheme"):
        Runtime(open_checkpoint(p))
    # a scheme without (some of) its scales
    part = {k: v for k, v in scales.items() if "layers.1." not in k}
    p = _with_kv(q, tmp_path / "missing", part)
    with pytest.raises(ConfigError, match="lacks 2 of its per-layer scale tensors: layer 1"):
        Runtime(open_checkpoint(p))
    # non-finite, zero, negative scales
    for i, v in enumerate((float("nan"), float("inf"), 0.0, -0.01)):
        bad = dict(scales)
        bad["model.layers.1.self_attn.v_scale"] = torch.tensor([v])
        p = _with_kv(q, tmp_path / f"bad{i}", bad)
        with pytest.raises(
            CheckpointError, match=r"layers\.1\.self_attn\.v_scale.*finite positive"
        ):
            Runtime(open_checkpoint(p))
    # a scale of the wrong shape
    bad = dict(scales)
    bad["model.layers.0.self_attn.k_scale"] = torch.tensor([0.1, 0.1])
    with pytest.raises(Exception, match="implies \\[1\\]"):
        open_kv(_with_kv(q, tmp_path / "shape", bad))
    # a scheme the runtime cannot apply
    p = _with_kv(q, tmp_path / "int8", scales)
    cfg = json.loads((p / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"]["type"] = "int"
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="type='int'"):
        Runtime(open_checkpoint(p))
    # a source that checks on use (not a Checkpoint): a zero scale at forward time
    ck = open_checkpoint(kv)

    class Zeroed:
        config = ck.config

        def names(self):
            return ck.names()

        def meta(self, n):
            return ck.meta(n)

        def get(self, n, dtype=None):
            t = ck.get(n, dtype)
            return torch.zeros_like(t) if n.endswith("k_scale") else t

    with Runtime(Zeroed()) as rt, pytest.raises(NonFiniteError, match="k_scale"):
        rt.forward(_ids())

"""Sensitivity scan and budgeted exceptions (k3convert.calibrate.sensitivity).

Oracles: transformers' own models (the trained fixtures of tests/trained.py, loaded in
float32): the mean next-token KL divergence on held-out text of the model with ONE
weight replaced by its dequantized quantization, against the unquantized model; the
real ``quantize`` output loaded back by transformers + compressed-tensors; and
transformers' router for the per-expert token counts.

Everything runs with one torch thread: on a shared 2-core machine OpenMP's spinning
threads make these small matmuls ~10x slower whenever another process holds a core.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import statistics

import pytest
import torch

from k3convert.calibrate.data import CalibrationSet, build_calibration_set, fingerprint
from k3convert.calibrate.sensitivity import (
    SensitivityReport,
    _kept_row,
    apply_selection,
    auto_keep,
    choose_keeps,
    keep_patterns,
    parse_budget,
    scan_sensitivity,
)
from k3convert.checkpoint import open_checkpoint
from k3convert.errors import ConfigError
from k3convert.pipeline import quantize
from k3convert.pipeline.quantize import plan_quantization
from k3convert.quant.schemes import get_scheme
from tests.test_calibrate_moe import _transformers_counts
from tests.trained import (  # noqa: F401  (fixtures)
    corpus_documents,
    heldout_blocks,
    split_corpus,
    trained_dsv3,
    trained_llama,
)

#: RTN int3 g32 clearly hurts the trained models (no-exception KL ~0.02 on llama)
SCHEME = "int3-g32"
SAMPLES, SEQ, HELD = 8, 128, 8
#: Spearman rank correlation with the single-tensor held-out KL, measured on this machine
#: (torch 2.13, transformers 5.24, calibration on 8 x 128 training tokens, KL on 8 x 128
#: held-out ones): layer llama 0.866 / dsv3 0.959, kl 0.979 / 0.961, output 0.449 /
#: 0.686. Asserted with margin.
MIN_RHO = {("llama", "layer"): 0.75, ("dsv3", "layer"): 0.85,
           ("llama", "kl"): 0.9, ("dsv3", "kl"): 0.88}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hf(path, **kw):
    import transformers as tf

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _logp(model, blocks) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(blocks).logits.float(), -1)


def _kl(ref: torch.Tensor, lp: torch.Tensor) -> float:
    return float((ref.exp() * (ref - lp)).sum(-1).mean())


def _train_text(path, docs: int = 60):
    """A jsonl of the first training documents (never the held-out ones the KL is
    measured on; the built-in set holds those too)."""
    f = path / "train.jsonl"
    if not f.exists():
        train, _ = split_corpus(corpus_documents())
        f.write_text("".join(json.dumps({"text": d}) + "\n" for d in train[:docs]))
    return f


def _setup(path, tmp):
    import transformers as tf

    ckpt, plan = plan_quantization(src=path, scheme=SCHEME)
    data = _train_text(tmp)
    calib = build_calibration_set(path, data, num_samples=SAMPLES, seq_len=SEQ, seed=0)
    with contextlib.redirect_stderr(io.StringIO()):
        tok = tf.AutoTokenizer.from_pretrained(path)
    docs = [json.loads(line)["text"] for line in (path / "heldout.jsonl").open()]
    with contextlib.redirect_stderr(io.StringIO()):
        blocks = heldout_blocks(tok, docs)[:HELD]
    model = _hf(path)
    return {"path": path, "ckpt": ckpt, "plan": plan, "calib": calib, "blocks": blocks,
            "model": model, "ref": _logp(model, blocks)}  # fmt: skip


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sens")


@pytest.fixture(scope="module")
def llama(trained_llama, text_dir):  # noqa: F811
    return _setup(trained_llama, text_dir)


@pytest.fixture(scope="module")
def dsv3(trained_dsv3, text_dir):  # noqa: F811
    return _setup(trained_dsv3, text_dir)


def _slot(params: dict, name: str):
    """(transformers parameter, rows) holding checkpoint weight ``name``: transformers
    5.24 fuses a layer's routed experts into ``experts.gate_up_proj`` [E, 2I, H] (gate
    rows first) and ``experts.down_proj`` [E, H, I]."""
    parts = name.split(".")
    if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
        k = parts.index("experts")
        base, e, proj = ".".join(parts[: k + 1]), int(parts[k + 1]), parts[k + 2]
        if proj == "down_proj":
            return params[f"{base}.down_proj"][e], slice(None)
        inter = params[f"{base}.down_proj"].shape[-1]
        fused = params[f"{base}.gate_up_proj"][e]
        return fused, slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
    return params[name], slice(None)


def _single_tensor_kl(s) -> dict[str, float]:
    """Held-out KL of transformers' model with only that weight quantized, per row."""
    model, ckpt = s["model"], s["ckpt"]
    params = dict(model.named_parameters())
    out = {}
    for r in s["plan"].quantized:
        t, rows = _slot(params, r.name)
        w = ckpt.get(r.name)
        assert torch.equal(t.data[rows], w), f"{r.name}: not where transformers holds it"
        with torch.no_grad():
            t.data[rows] = r.scheme.dequantize(r.scheme.quantize(w))
            try:
                out[r.name] = _kl(s["ref"], _logp(model, s["blocks"]))
            finally:
                t.data[rows] = w
    return out


def _ranks(v: list[float]) -> torch.Tensor:
    x = torch.tensor(v, dtype=torch.float64)
    order = x.argsort()
    r = torch.empty_like(x)
    r[order] = torch.arange(len(v), dtype=torch.float64)
    for val in x.unique():  # ties: their mean rank
        tie = x == val
        r[tie] = r[tie].mean()
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def test_spearman_helper():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)


@pytest.mark.parametrize("family", ["llama", "dsv3"])
def test_scores_track_single_tensor_kl(family, request):
    s = request.getfixturevalue(family)
    truth = _single_tensor_kl(s)
    names = list(truth)
    rho = {}
    for method in ("output", "layer", "kl"):
        rep = scan_sensitivity(s["ckpt"], s["plan"], s["calib"], method=method, batch_size=4)
        got = rep.by_name()
        assert list(got) == names  # every quantized row, in plan order, nothing else
        for t in rep.tensors:
            assert math.isfinite(t.score) and t.score >= 0, t
            assert t.tokens > 0 or t.expert is not None, t
        rho[method] = spearman([got[n].score for n in names], [truth[n] for n in names])
        if method == "layer" and family == "dsv3":
            _check_expert_rows(s, rep)
    print(f"{family} {SCHEME}: {len(names)} tensors, Spearman vs single-tensor KL "
          + ", ".join(f"{k} {v:.3f}" for k, v in rho.items()))  # fmt: skip
    for method in ("layer", "kl"):
        assert rho[method] >= MIN_RHO[(family, method)], (method, rho)
    assert rho["layer"] > rho["output"]  # why the default is 'layer'


def _check_expert_rows(s, rep: SensitivityReport) -> None:
    """Every routed expert's gate / up / down scored on its own, with the tokens
    transformers' router sends it."""
    cfg = s["model"].config
    moe = list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    n_exp = cfg.n_routed_experts
    counts = _transformers_counts(s["model"], s["calib"], moe, n_exp)
    by = rep.by_name()
    for L in moe:
        for e in range(n_exp):
            for p in ("gate_proj", "up_proj", "down_proj"):
                t = by[f"model.layers.{L}.mlp.experts.{e}.{p}.weight"]
                assert (t.layer, t.expert) == (L, e)
                assert t.tokens == counts[L][e], (t.name, t.tokens, counts[L][e])
                assert (t.score > 0) == (t.tokens > 0), t


def _random_keeps(plan, budget_bytes: int, seed: int) -> list[str]:
    """The same budget spent on randomly ordered tensors (each taken if it still fits)."""
    rows = [r for r in plan.quantized if not r.as_stored]
    random.Random(seed).shuffle(rows)
    used, out = 0, []
    for r in rows:
        c = _kept_row(r, "").out_bytes - r.out_bytes
        if used + c <= budget_bytes:
            out.append(r.name)
            used += c
    return out


def _load_quantized(out, dense, family: str):
    """transformers' model of ``quantize``'s output: llama loaded directly
    (``CompressedTensorsConfig(dequantize=True)``); deepseek_v3 through compressed-tensors'
    dequantizer first: transformers 5.24 fuses a layer's experts at load time and cannot
    concatenate kept bf16 experts with packed int ones ("Sizes of tensors must match")."""
    from transformers import CompressedTensorsConfig

    if family == "llama":
        return _hf(out, quantization_config=CompressedTensorsConfig(dequantize=True)).float()
    from compressed_tensors.entrypoints.convert import (
        CompressedTensorsDequantizer,
        convert_checkpoint,
    )
    from loguru import logger

    q = open_checkpoint(out)
    plain = [n.removesuffix(".weight") for n in q.names() if q.meta(n).encoding == "plain"]
    logger.disable("compressed_tensors")
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            convert_checkpoint(out, dense, CompressedTensorsDequantizer(
                out, ignore=plain, dtype=torch.float32), max_workers=1)  # fmt: skip
    finally:
        logger.enable("compressed_tensors")
    return _hf(dense)


@pytest.mark.parametrize("family", ["llama", "dsv3"])
def test_auto_keep_beats_random_and_none(family, request, tmp_path):
    """The issue's target, on transformers' model of the real ``quantize`` output."""
    s = request.getfixturevalue(family)
    rep = scan_sensitivity(s["ckpt"], s["plan"], s["calib"])
    sel = choose_keeps(rep, "5%", s["plan"])
    assert sel.names and sel.used_bytes <= sel.budget_bytes

    def kl_of(names: list[str], tag: str) -> float:
        out = tmp_path / tag
        res = quantize(src=s["path"], out=out, scheme=SCHEME, keep=keep_patterns(names),
                       progress=False)  # fmt: skip
        kept = [r.name for r in res.plan.rows if r.kept and "--keep" in r.reason]
        assert sorted(kept) == sorted(names)
        m = _load_quantized(out, tmp_path / f"{tag}-dense", family)
        return _kl(s["ref"], _logp(m, s["blocks"]))

    none = kl_of([], "none")
    auto = kl_of(sel.names, "auto")
    rnd = [kl_of(_random_keeps(s["plan"], sel.budget_bytes, k), f"rnd{k}") for k in range(5)]
    print(f"{family} {SCHEME} ({sel.summary()}): held-out KL none {none:.5f}, "
          f"auto-keep {auto:.5f}, random {', '.join(f'{x:.5f}' for x in rnd)}")  # fmt: skip
    # The property the method has: the scan's choice beats keeping nothing, and beats the
    # typical random choice of the same budget (the median and the mean of five draws).
    # It does not beat every draw: on a 3-layer model a random draw that happens to keep
    # the one most sensitive tensor comes within rounding of it (dsv3: 0.02748 vs 0.02826
    # on one machine), so "better than all" would be a coin toss, not a test.
    assert auto < none
    assert auto < statistics.median(rnd), (auto, rnd)
    assert auto < sum(rnd) / len(rnd), (auto, rnd)


# -- budgets and selection -----------------------------------------------------------------
def test_parse_budget():
    b = parse_budget("5%")
    assert (b.kind, b.value) == ("percent", 5.0)
    assert parse_budget("1.5GB").value == 1.5e9
    assert parse_budget("300MiB").value == 300 * 2**20
    assert parse_budget("2000000").value == 2e6
    assert parse_budget(4096).value == 4096
    assert parse_budget(" 12 KiB ").value == 12 * 1024
    b = parse_budget("4.5bpw")
    assert (b.kind, b.value) == ("bpw", 4.5)
    assert b.extra_bytes(1000, 2000) == 1125 - 1000
    assert parse_budget("5%").extra_bytes(1000, 1) == 50
    for bad in ("", "five", "5%%", "-3%", "120%", "1.5", "3 parsecs", "0bpw", "nan", True,
                None, "1e400GB"):  # fmt: skip
        with pytest.raises(ConfigError, match=r"5%.*1\.5GB.*4\.5bpw|0% to 100%|whole|bits"):
            parse_budget(bad)


@pytest.fixture(scope="module")
def w4(trained_llama, text_dir):  # noqa: F811
    """A w4a16 (g128) plan of llama and a cheap 'output' scan with the int8-g128 ladder."""
    ckpt, plan = plan_quantization(src=trained_llama, scheme="w4a16")
    data = _train_text(text_dir)
    calib = build_calibration_set(trained_llama, data, num_samples=4, seq_len=64, seed=1)
    rep = scan_sensitivity(ckpt, plan, calib, ladder="int8-g128", method="output")
    return ckpt, plan, rep


def test_never_over_budget_and_bpw_granularity(w4):
    _, plan, rep = w4
    rows = [r for r in plan.quantized]
    cost = {r.name: _kept_row(r, "").out_bytes - r.out_bytes for r in rows}
    for text in ("1%", "5%", "25%", "30KiB", "100000", "5bpw", "6.5bpw", "100%"):
        sel = choose_keeps(rep, text, plan)
        assert 0 <= sel.used_bytes <= sel.budget_bytes, text
        assert sel.used_bytes == sum(cost[n] for n in sel.names)
        left = sel.budget_bytes - sel.used_bytes
        unchosen = [cost[n] for n in cost if n not in sel.names]
        assert not unchosen or left < min(unchosen), text  # nothing else would fit
        new = apply_selection(plan, sel)
        assert new.totals()[1] - plan.totals()[1] == sel.used_bytes
        assert sel.base_bytes == sum(r.out_bytes for r in rows)
        if text.endswith("bpw"):
            target = float(text[:-3])
            assert sel.bpw <= target + 1e-12
            assert target - sel.bpw < max(cost.values()) * 8 / sel.params
        chosen = [t for t in rep.tensors if t.chosen]
        assert sorted(t.name for t in chosen) == sorted(sel.names)
        assert sorted(t.rank for t in chosen) == list(range(1, len(chosen) + 1))
    assert len(choose_keeps(rep, "100%", plan).names) > len(choose_keeps(rep, "5%", plan).names)


def test_budget_too_small_keeps_nothing_and_says_so(w4):
    _, plan, rep = w4
    sel = choose_keeps(rep, "100", plan)
    assert sel.names == [] and sel.used_bytes == 0
    assert "smaller than any single tensor" in sel.summary()
    assert "allows no extra bytes" in choose_keeps(rep, "0%", plan).note
    assert choose_keeps(rep, "2bpw", plan).names == []  # below the plan's own 4.1 bpw
    assert apply_selection(plan, sel).rows == plan.rows


def test_ladder_selection(w4):
    _, plan, rep = w4
    lad = get_scheme("int8-g128")
    for t in rep.tensors:
        assert 0 <= t.ladder_score < t.score  # int8 is far closer than int4
    sel = choose_keeps(rep, "10%", plan, ladder="int8-g128")
    assert sel.names and sel.action == "int8-g128"
    new = apply_selection(plan, sel)
    moved = {r.name: r for r in new.rows if r.name in sel.names}
    for k, n in enumerate(sel.names, 1):
        r = moved[n]
        assert r.scheme == lad and r.reason == f"auto-keep: sensitivity rank {k}"
        assert r.out_bytes == lad.nbytes(r.shape)
    assert new.totals()[1] - plan.totals()[1] == sel.used_bytes <= sel.budget_bytes
    # an upgrade costs less than keeping: the same budget moves more tensors
    assert len(sel.names) > len(choose_keeps(rep, "10%", plan).names)
    assert len(new.schemes()) == 2
    with pytest.raises(ConfigError, match="apply_selection"):
        keep_patterns(sel)
    with pytest.raises(ConfigError, match="scored ladder 'int8-g128'"):
        choose_keeps(rep, "10%", plan, ladder="int8-g32")


def test_apply_selection_keeps_in_source_dtype(w4):
    _, plan, rep = w4
    sel = choose_keeps(rep, "5%", plan)
    new = apply_selection(plan, sel)
    for k, n in enumerate(sel.names, 1):
        r = next(r for r in new.rows if r.name == n)
        assert r.kept and r.reason == f"auto-keep: sensitivity rank {k}"
        assert r.out_dtype == torch.bfloat16 and r.out_bytes == math.prod(r.shape) * 2
    ignore = new.quantization_config()["ignore"]
    assert all(n.removesuffix(".weight") in ignore for n in sel.names)
    assert keep_patterns(["a.b[0].weight"]) == [r"re:a\.b\[0\]\.weight$"]


def test_report_json_table_and_png(w4, tmp_path):
    _, plan, rep = w4
    choose_keeps(rep, "5%", plan)
    p = rep.write(tmp_path)
    assert p.name == "sensitivity.json"
    doc = json.loads(p.read_text())
    t0 = doc["tensors"][0]
    assert set(t0) >= {"name", "layer", "expert", "params", "score", "ladder_score", "chosen"}
    back = SensitivityReport.read(p)
    assert back.to_json() == rep.to_json()
    table = rep.table(top=5)
    top = rep.ranked()[0]
    assert top.name in table and "auto-keep 5%" in table
    assert len(table.splitlines()) == 3 + 5 + 1
    png = rep.plot(tmp_path / "s.png", top=12)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="sensitivity report"):
        SensitivityReport.read(tmp_path / "bad.json")


def test_experts_without_tokens_score_zero(dsv3):
    """Two real tokens (one per row, the rest padding): at most four of the eight experts
    of a layer get a token; the others are scored 0 and listed; padding never counts."""
    s = dsv3
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros_like(ids)
    mask[:, 0] = 1
    calib = CalibrationSet(ids, mask, "two tokens", fingerprint(ids, mask, {}, None))
    counts = _transformers_counts(s["model"], calib, [1, 2], 8)
    for method in ("layer", "output"):
        rep = scan_sensitivity(s["ckpt"], s["plan"], calib, method=method, ladder="int8-g32")
        experts = [t for t in rep.tensors if t.expert is not None]
        assert all(math.isfinite(t.score) and math.isfinite(t.ladder_score) for t in rep.tensors)
        for t in experts:
            assert t.tokens == counts[t.layer][t.expert]
            assert (t.score > 0) == (t.tokens > 0), t
            if not t.tokens:
                assert t.score == 0.0 and t.ladder_score == 0.0
        idle = [t.name for t in experts if not t.tokens]
        assert len(idle) >= 3 * 2 * 4 and rep.unmeasured == idle
        assert "saw no calibration token" in rep.table(top=3)
        sel = choose_keeps(rep, "100%", s["plan"])
        assert not set(sel.names) & set(idle)


def test_bad_inputs(w4, llama):
    ckpt, plan, rep = w4
    calib = llama["calib"]
    with pytest.raises(ConfigError, match="method 'fisher' is not known"):
        scan_sensitivity(ckpt, plan, calib, method="fisher")
    with pytest.raises(ConfigError, match="static input scales"):
        scan_sensitivity(ckpt, plan, calib, ladder="fp8")
    with pytest.raises(ConfigError, match="batch_size"):
        scan_sensitivity(ckpt, plan, calib, batch_size=0)
    _, all_plan = plan_quantization(src=llama["path"], scheme="w4a16", default_keep=False)
    with pytest.raises(ConfigError, match="does not score 1 quantized"):
        choose_keeps(rep, "5%", all_plan)
    with pytest.raises(ConfigError, match="no ladder scores"):
        choose_keeps(SensitivityReport("output", None, rep.tensors), "5%", plan, "int8-g128")


def test_quantized_lm_head_is_scored(llama):
    """default_keep=False quantizes lm_head: the head stage scores it like a layer."""
    ckpt, plan = plan_quantization(src=llama["path"], scheme="w4a16", default_keep=False)
    calib = _small(llama["calib"])
    for method in ("output", "layer", "kl"):
        t = scan_sensitivity(ckpt, plan, calib, method=method).by_name()["lm_head.weight"]
        assert t.layer is None and t.tokens == 64 and t.score > 0, (method, t)


def test_expert_shortcut_equals_layer_rerun(dsv3, monkeypatch):
    """``layer`` scores of routed experts from the expert alone (weighted by its routing
    weights) equal those from rerunning the whole layer with that expert quantized."""
    from k3convert.calibrate import sensitivity

    ids = torch.randint(3, 1000, (3, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    calib = CalibrationSet(ids, mask, "padded", fingerprint(ids, mask, {}, None))
    kw = dict(method="layer", ladder="int8-g32", batch_size=2)
    fast = scan_sensitivity(dsv3["ckpt"], dsv3["plan"], calib, **kw).by_name()
    monkeypatch.setattr(sensitivity, "_EXPERT_SHORTCUT", False)
    full = scan_sensitivity(dsv3["ckpt"], dsv3["plan"], calib, **kw).by_name()
    experts = [n for n, t in full.items() if t.expert is not None]
    assert len(experts) == 2 * 8 * 3
    for n, t in full.items():
        f = fast[n]
        assert f.tokens == t.tokens, n
        assert f.score == pytest.approx(t.score, rel=1e-3, abs=1e-9), n
        assert f.ladder_score == pytest.approx(t.ladder_score, rel=1e-3, abs=1e-11), n


def test_kimi_k3_latent_experts_and_attention_residuals(tmp_path):
    """Kimi K3 (attention residuals, KDA layers, latent MoE with w1/w2/w3 experts): every
    method runs; each MoE layer routes as many token slots as the calibration engine
    (top-k x real tokens); the ``layer`` method reruns the layer per expert tensor there
    (the latent norm is not linear). Per expert the counts may differ: the engine routes
    the output of the quantized earlier layers, the scan the original's, and a router
    near-tie (measured: 2nd and 3rd scores 1.1e-4 apart against a 5e-3 int8 shift)
    sends a token elsewhere."""
    import re
    import warnings

    from k3convert.calibrate.sequential import SequentialOptions, calibrate_sequential
    from tests.test_calibrate_sequential import k3_calibration

    src, calib = k3_calibration(tmp_path)
    ckpt, plan = plan_quantization(src=src, scheme="int8-channel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = calibrate_sequential(ckpt, plan, calib, algorithm="rtn",
                                   options=SequentialOptions(), journal=tmp_path / "j")  # fmt: skip
    for method in ("output", "layer", "kl"):
        rep = scan_sensitivity(ckpt, plan, calib, method=method)
        assert len(rep.tensors) == len([r for r in plan.quantized if not r.as_stored])
        experts = [t for t in rep.tensors if t.expert is not None]
        assert experts and rep.unmeasured
        for t in rep.tensors:
            assert math.isfinite(t.score) and t.score >= 0, t
            assert (t.score > 0) == (t.tokens > 0), (method, t)
        per_group: dict[str, list[int]] = {}
        for t in experts:
            key = re.sub(r"experts\.\d+\.", "experts.N.", t.name)
            per_group.setdefault(key, [0, 0])
            per_group[key][0] += t.tokens
            per_group[key][1] += res.expert_tokens[t.name]
        assert per_group and all(a == b > 0 for a, b in per_group.values()), per_group


def _small(calib: CalibrationSet, n: int = 2, s: int = 32) -> CalibrationSet:
    ids, mask = calib.input_ids[:n, :s], calib.attention_mask[:n, :s]
    return CalibrationSet(ids, mask, calib.source, fingerprint(ids, mask, {}, None))


def test_auto_keep_one_call(w4, llama):
    ckpt, plan, _ = w4
    calib = _small(llama["calib"])
    lines = []
    new, rep, sel = auto_keep(ckpt, plan, calib, "3%", ladder="int8-g128", log=lines.append)
    assert sel.names and rep.selection["names"] == sel.names
    # the summary is the report's (the caller prints it once), not a progress line
    assert rep.selection["summary"] == sel.summary() and sel.summary() not in lines
    assert [r.name for r in new.rows if r.reason.startswith("auto-keep")] == [
        n for n in (r.name for r in plan.rows) if n in sel.names
    ]
    assert all(r.scheme.name == "int8-g128" for r in new.rows if r.name in sel.names)
    for bad, msg in (("lots", "not understood"), ("fp8", "static input scales")):
        with pytest.raises(ConfigError, match=msg):  # before any scan
            auto_keep(ckpt, plan, calib, "5%" if bad == "fp8" else bad,
                      ladder=bad if bad == "fp8" else None)  # fmt: skip

"""verify's model-independent pieces, checked against independent computations."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from k3convert.errors import ConfigError, NonFiniteError
from k3convert.quant.schemes import get_scheme, known_schemes
from k3convert.verify import (
    Thresholds,
    check,
    compare_logits,
    default_thresholds,
    locate_divergence,
    rel_l2,
    thresholds_for_quant_config,
)
from k3convert.verify.inputs import load_data, next_token_targets, random_ids
from k3convert.verify.metrics import limit_checks
from k3convert.verify.report import plot, render_table, write_json


def _logits(b=2, s=9, v=50, seed=0, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(b, s, v, generator=g) * 3
    cand = ref + noise * torch.randn(b, s, v, generator=g)
    return ref, cand


def _kl_independent(ref, cand):
    """KL(ref || cand) per [B, S] position via F.kl_div in float64."""
    lr = F.log_softmax(ref.double(), -1)
    lc = F.log_softmax(cand.double(), -1)
    return F.kl_div(lc, lr, log_target=True, reduction="none").sum(-1)


# -- compare_logits -------------------------------------------------------------------
def test_kld_matches_kl_div_and_numpy_percentiles():
    ref, cand = _logits()
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    m = compare_logits(ref, cand, mask=mask, per_position=True)
    want = _kl_independent(ref, cand)[mask.bool()].numpy()
    assert m["positions"] == 15
    np.testing.assert_allclose(m["kld_per_position"], want, rtol=1e-12, atol=0)
    k = m["kld"]
    assert k["mean"] == pytest.approx(want.mean(), rel=1e-12)
    assert k["max"] == pytest.approx(want.max(), rel=1e-12)
    for key, q in (("median", 50), ("p90", 90), ("p99", 99), ("p99_9", 99.9)):
        assert k[key] == pytest.approx(np.percentile(want, q), rel=1e-12)
    # and the percentile is the linear interpolation between sorted values
    srt = np.sort(want)
    pos = 0.9 * (len(srt) - 1)
    lo = int(pos)
    assert k["p90"] == pytest.approx(srt[lo] + (pos - lo) * (srt[lo + 1] - srt[lo]), rel=1e-12)
    assert min(want) > 0


def test_perplexity_matches_cross_entropy():
    ref, cand = _logits(b=2, s=8, v=40, seed=1)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    tgt = next_token_targets(ids, mask)
    m = compare_logits(ref, cand, mask=mask, targets=tgt)
    want_ref = math.exp(F.cross_entropy(ref.double().view(-1, 40), tgt.view(-1)).item())
    want_cand = math.exp(F.cross_entropy(cand.double().view(-1, 40), tgt.view(-1)).item())
    assert m["ppl_tokens"] == int((tgt != -100).sum()) == 4 + 7
    assert m["ppl_ref"] == pytest.approx(want_ref, rel=1e-10)
    assert m["ppl_cand"] == pytest.approx(want_cand, rel=1e-10)
    assert m["ppl_ratio"] == pytest.approx(want_cand / want_ref, rel=1e-10)


def test_cosine_top1_and_errors_match_direct_computation():
    ref, cand = _logits(b=3, s=5, v=30, seed=3, noise=2.0)
    m = compare_logits(ref, cand)
    r, c = ref.double().view(-1, 30), cand.double().view(-1, 30)
    cos = F.cosine_similarity(r, c, dim=-1).mean().item()
    assert m["cosine"] == pytest.approx(cos, rel=1e-12)
    agree = (r.argmax(-1) == c.argmax(-1)).double()
    assert m["top1"] == agree.mean().item()
    assert m["top1_mismatches"] == int((agree == 0).sum()) > 0
    d = (c - r).abs()
    assert m["max_abs_err"] == pytest.approx(d.max().item(), rel=1e-12)
    assert m["max_rel_err"] == pytest.approx(d.max().item() / r.abs().max().item(), rel=1e-12)
    assert m["rel_l2"] == pytest.approx((torch.norm(c - r) / torch.norm(r)).item(), rel=1e-12)
    json.dumps(m, allow_nan=False)  # plain JSON-able values


def test_chunking_does_not_change_results():
    ref, cand = _logits(b=3, s=50, v=300, seed=4)
    mask = (torch.rand(3, 50, generator=torch.Generator().manual_seed(5)) > 0.3).long()
    tgt = torch.randint(0, 300, (3, 50), generator=torch.Generator().manual_seed(6))
    one = compare_logits(ref, cand, mask=mask, targets=tgt, per_position=True, chunk=1000)
    small = compare_logits(ref, cand, mask=mask, targets=tgt, per_position=True, chunk=7)
    assert one["positions"] == small["positions"] > 7
    # per position: the same numbers, and those of a manual one-position-at-a-time loop
    assert one["kld_per_position"] == small["kld_per_position"]
    manual = [
        float(_kl_independent(ref[b, s][None, None], cand[b, s][None, None]))
        for b in range(3)
        for s in range(50)
        if mask[b, s]
    ]
    np.testing.assert_allclose(small["kld_per_position"], manual, rtol=1e-12)
    for key in ("top1", "top1_mismatches", "positions", "ppl_tokens", "max_abs_err"):
        assert one[key] == small[key]
    for key in ("rel_l2", "cosine", "max_rel_err", "ppl_ref", "ppl_cand", "ppl_ratio"):
        assert small[key] == pytest.approx(one[key], rel=1e-12)
    for key, v in one["kld"].items():
        assert small["kld"][key] == pytest.approx(v, rel=1e-12)


def test_default_chunk_splits_a_large_vocab():
    v = 1 << 16  # 64 positions per default chunk; 100 positions -> two chunks
    ref, cand = _logits(b=2, s=50, v=v, seed=7, noise=0.1)
    auto = compare_logits(ref, cand, per_position=True)
    whole = compare_logits(ref, cand, per_position=True, chunk=100)
    assert auto["kld_per_position"] == whole["kld_per_position"]
    assert auto["top1"] == whole["top1"]
    assert auto["rel_l2"] == pytest.approx(whole["rel_l2"], rel=1e-12)


def test_identical_logits_give_exact_zeros_and_ones():
    ref, _ = _logits(b=2, s=70, v=64, seed=8)
    tgt = torch.randint(0, 64, (2, 70))
    m = compare_logits(ref, ref.clone(), targets=tgt)
    assert m["kld"] == dict.fromkeys(("mean", "median", "p90", "p99", "p99_9", "max"), 0.0)
    assert m["max_abs_err"] == m["max_rel_err"] == m["rel_l2"] == 0.0
    assert m["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert m["top1"] == 1.0 and m["top1_mismatches"] == 0
    assert m["ppl_ratio"] == 1.0
    ok, msg = check(m, default_thresholds("exact"))
    assert ok and msg is None
    zeros = torch.zeros(1, 2, 5)
    z = compare_logits(zeros, zeros.clone())
    assert z["cosine"] == 1.0 and z["max_rel_err"] == 0.0 and z["rel_l2"] == 0.0


def test_nonfinite_candidate_fails_and_nonfinite_reference_raises():
    ref, cand = _logits(b=1, s=4, v=10, seed=9)
    bad = cand.clone()
    bad[0, 2, 3] = float("nan")
    m = compare_logits(ref, bad)
    assert m["nonfinite_positions"] == 1
    assert m["max_abs_err"] is None and m["kld"]["mean"] is None and m["cosine"] is None
    json.dumps(m, allow_nan=False)
    ok, msg = check(m, default_thresholds("int4"))
    assert not ok and "NaN/inf at 1 of 4" in msg
    with pytest.raises(NonFiniteError, match="batch 0, position 1"):
        ref2 = ref.clone()
        ref2[0, 1, 0] = float("inf")
        compare_logits(ref2, cand)


def test_bad_arguments_are_config_errors():
    ref, cand = _logits(b=1, s=3, v=10)
    with pytest.raises(ConfigError, match="do not match"):
        compare_logits(ref, cand[..., :9])
    with pytest.raises(ConfigError, match="selects no position"):
        compare_logits(ref, cand, mask=torch.zeros(1, 3))
    with pytest.raises(ConfigError, match=r"target id 10 at batch 0, position 2"):
        compare_logits(ref, cand, targets=torch.tensor([[1, -100, 10]]))


def test_rel_l2():
    g = torch.Generator().manual_seed(10)
    a = torch.randn(4, 6, 16, generator=g)
    b = a + 0.01 * torch.randn(4, 6, 16, generator=g)
    want = (torch.linalg.norm(b.double() - a.double()) / torch.linalg.norm(a.double())).item()
    assert rel_l2(a, b) == pytest.approx(want, rel=1e-12)
    z = torch.zeros(3, 3)
    assert rel_l2(z, z.clone()) == 0.0
    assert rel_l2(z, torch.ones(3, 3)) == math.inf
    assert rel_l2(a, torch.full_like(a, float("nan"))) == math.inf
    big = torch.full((1000,), 3e38)  # squares overflow float32, not float64
    assert rel_l2(big, big * 0.5) == pytest.approx(0.5, rel=1e-6)
    with pytest.raises(NonFiniteError):
        rel_l2(torch.full((2,), float("inf")), torch.zeros(2))


# -- thresholds -----------------------------------------------------------------------
def test_default_thresholds_families_and_aliases():
    ex = default_thresholds("exact")
    assert (ex.max_rel_err, ex.min_top1, ex.max_kld) == (1e-5, 1.0, 1e-6)
    assert default_thresholds("fp8").max_kld == 0.01 and default_thresholds("fp8").min_top1 == 0.9
    assert default_thresholds("int4") == default_thresholds("w4a16")
    assert (default_thresholds("int4").max_kld, default_thresholds("int4").min_top1) == (0.05, 0.8)
    assert (default_thresholds("int3").max_kld, default_thresholds("int3").min_top1) == (0.2, 0.6)
    assert (default_thresholds("int2").max_kld, default_thresholds("int2").min_top1) == (1.0, 0.3)
    for name, family in [
        ("fp8-block", "fp8"),
        ("FP8-Dynamic", "fp8"),
        ("w8a8", "int8"),
        ("w4a8-fp8", "int4"),
        ("int3-g64-asym", "int3"),
        ("int6-g32", "int4"),
    ]:
        assert default_thresholds(name).kind == family, name
    for family in ("fp8", "int8", "int4", "int3", "int2"):
        assert default_thresholds(family).max_rel_err is None
    with pytest.raises(ConfigError, match="unknown kind 'nf4'"):
        default_thresholds("nf4")


def _ct(*groups, **extra):
    return {
        "quant_method": "compressed-tensors",
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups)},
        **extra,
    }


W4A16 = {
    "targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
    "input_activations": None,
}
FP8 = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "strategy": "block"},
    "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
}


def test_thresholds_for_quant_config():
    assert thresholds_for_quant_config({"model_type": "llama"}).kind == "exact"
    assert thresholds_for_quant_config({"quantization_config": _ct(W4A16)}).kind == "int4"
    assert thresholds_for_quant_config({"quantization_config": _ct(FP8)}).kind == "fp8"
    # kimi_k25: in text_config only, or in both (the loosest wins)
    k25 = {"model_type": "kimi_k25", "text_config": {"quantization_config": _ct(FP8)}}
    assert thresholds_for_quant_config(k25).kind == "fp8"
    both = {"quantization_config": _ct(FP8), "text_config": {"quantization_config": _ct(W4A16)}}
    assert thresholds_for_quant_config(both).kind == "int4"
    assert thresholds_for_quant_config({"quantization_config": _ct(FP8, W4A16)}).kind == "int4"
    kv = _ct(
        {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"}},
        kv_cache_scheme={"num_bits": 8, "type": "float"},
    )
    assert thresholds_for_quant_config({"quantization_config": kv}).kind == "fp8"
    ds = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert thresholds_for_quant_config(ds).kind == "fp8"
    bad = _ct({"weights": {"num_bits": "four", "type": "int"}})
    with pytest.raises(ConfigError, match=r"config_groups\.group_0\.weights\.num_bits"):
        thresholds_for_quant_config({"quantization_config": bad})
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes'"):
        thresholds_for_quant_config({"quantization_config": {"quant_method": "bitsandbytes"}})


@pytest.mark.parametrize("name", known_schemes())
def test_config_written_by_a_scheme_maps_like_its_name(name):
    qc = _ct(get_scheme(name).ct_scheme(["Linear"]))
    assert thresholds_for_quant_config({"quantization_config": qc}) == default_thresholds(name)


# -- check ----------------------------------------------------------------------------
def _metrics(kld=0.0, top1=1.0, rel=0.0):
    return {
        "positions": 10,
        "nonfinite_positions": 0,
        "kld": {"mean": kld},
        "top1": top1,
        "max_rel_err": rel,
    }


def _layers(values):
    return [{"layer": f"layer{i}", "rel_l2": v} for i, v in enumerate(values)]


def test_check_names_the_failing_metric_value_and_limit():
    th = Thresholds(max_kld=0.05, min_top1=0.8, max_rel_err=None)
    assert check(_metrics(kld=0.049, top1=0.8), th) == (True, None)
    ok, msg = check(_metrics(kld=0.2, top1=0.5), th)
    assert not ok and msg.startswith("kld.mean = 0.2 > max_kld 0.05")
    ok, msg = check(_metrics(kld=0.01, top1=0.75), th)
    assert not ok and msg == "top1 = 0.75 < min_top1 0.8"
    ok, msg = check(_metrics(rel=3e-5), default_thresholds("exact"))
    assert not ok and msg == "max_rel_err = 3e-05 > max_rel_err 1e-05"
    ok, msg = check({**_metrics(), "max_rel_err": None}, default_thresholds("exact"))
    assert not ok and "max_rel_err is not finite" in msg


def test_check_names_the_layer_where_the_error_starts():
    th = default_thresholds("exact")
    layers = _layers([0.0, 1e-7, 2e-7, 5e-2, 6e-2])
    assert locate_divergence(layers) == (3, True)
    ok, msg = check(_metrics(rel=1e-3), th, layers)
    assert not ok and "'layer3'" in msg and "#3" in msg and "2.000e-07" in msg
    # no 10x jump: the largest absolute increase is named instead
    slow = _layers([2e-6, 1e-5, 4e-5, 1e-4, 1.5e-4])
    assert locate_divergence(slow) == (0, True)  # 2e-6 > max(1e-6, 10 * 0)
    slow = _layers([5e-7, 4e-6, 3e-5, 2e-4, 2.5e-4])
    assert locate_divergence(slow) == (3, False)
    ok, msg = check(_metrics(rel=1e-3), th, slow)
    assert "largest increase is at layer 'layer3'" in msg
    # a non-finite layer counts as an infinite error; no growth at all names nothing
    assert locate_divergence(_layers([0.0, 1e-7, None, 1.0])) == (2, True)
    assert locate_divergence(_layers([0.0, 0.0])) is None
    assert check(_metrics(), th, layers) == (True, None)


def test_quantized_candidates_are_localised_from_the_second_layer():
    """Every layer of a quantized model has its own error, so the first layer's is not
    a jump from zero: the rule starts at the second layer, against the first."""
    th = default_thresholds("int8")
    broken = _layers([1.0e-2, 1.5e-2, 2.0e-1, 2.4e-1])
    assert locate_divergence(broken) == (0, True)  # the exact rule blames layer 0
    assert locate_divergence(broken, quantized=True) == (2, True)
    ok, msg = check({**_metrics(), "kld": {**_metrics()["kld"], "mean": 1.0}}, th, broken)
    assert not ok and "'layer2'" in msg and "second layer" in msg
    # no 10x jump: the largest relative jump after the first layer
    healthy = _layers([1.0e-2, 1.2e-2, 3.0e-2, 3.3e-2])
    assert locate_divergence(healthy, quantized=True) == (2, False)
    assert locate_divergence(_layers([0.2]), quantized=True) == (0, True)


# -- inputs ---------------------------------------------------------------------------
def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_input_ids_padded_truncated_and_limited(tmp_path):
    f = _write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"input_ids": [5, 6, 7]}),
            "",
            json.dumps({"input_ids": [1, 2, 3, 4, 5, 6, 7, 8]}),
            json.dumps({"input_ids": []}),
            json.dumps({"input_ids": [9]}),
            json.dumps({"input_ids": [9, 9]}),
        ],
    )
    ids, mask, is_text = load_data(f, seq_len=5, vocab=10, max_samples=3)
    assert is_text is True
    assert ids.dtype == mask.dtype == torch.int64
    assert ids.tolist() == [[5, 6, 7, 0, 0], [1, 2, 3, 4, 5], [9, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    ids, mask, _ = load_data(f, seq_len=100, vocab=10, max_samples=1)
    assert ids.tolist() == [[5, 6, 7]] and mask.tolist() == [[1, 1, 1]]


def test_jsonl_errors_name_the_line(tmp_path):
    f = _write_lines(
        tmp_path / "d.jsonl",
        [json.dumps({"input_ids": [1]}), json.dumps({"input_ids": [2]}), '{"input_ids": [3, 77]}'],
    )
    with pytest.raises(ConfigError) as e:
        load_data(f, seq_len=4, vocab=50)
    assert "line 3" in str(e.value) and "77" in str(e.value) and "vocab size 50" in str(e.value)
    f = _write_lines(tmp_path / "b.jsonl", [json.dumps({"input_ids": [1]}), '{"input_ids": [1,'])
    with pytest.raises(ConfigError, match=r"b\.jsonl line 2: not valid JSON"):
        load_data(f, seq_len=4, vocab=50)
    f = _write_lines(tmp_path / "c.jsonl", ['{"input_ids": [1, 2.5]}'])
    with pytest.raises(ConfigError, match=r"line 1: token id float 2\.5 is not an integer"):
        load_data(f, seq_len=4, vocab=50)
    f = _write_lines(tmp_path / "t.jsonl", ['{"text": "hello"}'])
    with pytest.raises(ConfigError, match=r"line 1 has text.*input_ids"):
        load_data(f, seq_len=4, vocab=50)
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no usable rows"):
        load_data(tmp_path / "e.jsonl", seq_len=4, vocab=50)
    with pytest.raises(ConfigError, match=r"unsupported type '\.csv'"):
        load_data(_write_lines(tmp_path / "x.csv", ["1,2"]), seq_len=4, vocab=50)
    with pytest.raises(ConfigError, match="no such file"):
        load_data(tmp_path / "missing.jsonl", seq_len=4, vocab=50)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A tiny word-level tokenizer.json that AutoTokenizer loads without custom code."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tok")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "the": 3, "cat": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
    )
    return d


def test_text_is_tokenized_with_the_checkpoint_tokenizer(tmp_path, word_tokenizer):
    f = _write_lines(
        tmp_path / "d.jsonl",
        [json.dumps({"text": "hello world"}), json.dumps({"input_ids": [4, 4, 4]})],
    )
    ids, mask, _ = load_data(f, seq_len=8, vocab=5, tokenizer_dir=word_tokenizer)
    assert ids.tolist() == [[1, 2, 0], [4, 4, 4]] and mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    txt = tmp_path / "d.txt"
    txt.write_text("the cat hello world the cat dog\n", encoding="utf-8")
    ids, mask, is_text = load_data(txt, seq_len=3, vocab=5, tokenizer_dir=word_tokenizer)
    assert is_text and ids.tolist() == [[3, 4, 1], [2, 3, 4], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 1], [1, 0, 0]]
    with pytest.raises(ConfigError, match=r"tokenized\): token id 3 is not in \[0, 3\)"):
        load_data(txt, seq_len=3, vocab=3, tokenizer_dir=word_tokenizer)
    with pytest.raises(ConfigError, match="no tokenizer given"):
        load_data(txt, seq_len=3, vocab=5)


def test_tokenizer_needing_custom_code_is_refused(tmp_path, word_tokenizer):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((word_tokenizer / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}})
    )
    f = _write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "hello"})])
    with pytest.raises(ConfigError, match="custom code"):
        load_data(f, seq_len=4, vocab=5, tokenizer_dir=d)


def test_safetensors_input(tmp_path):
    f = tmp_path / "ids.safetensors"
    ids = torch.tensor([[1, 2, 3, 4, 99], [5, 6, 0, 0, 0], [0, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    save_file({"input_ids": ids, "attention_mask": mask}, str(f))
    got, m, is_text = load_data(f, seq_len=8, vocab=10)
    assert is_text and got.tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]  # padded id 99 -> 0
    assert m.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    save_file({"input_ids": torch.tensor([3, 12, 1])}, str(f))
    with pytest.raises(ConfigError, match=r"input_ids\[0, 1\].* = 12 is not in \[0, 10\)"):
        load_data(f, seq_len=8, vocab=10)
    save_file({"tokens": torch.tensor([3])}, str(f))
    with pytest.raises(ConfigError, match="no tensor 'input_ids'"):
        load_data(f, seq_len=8, vocab=10)


def test_next_token_targets():
    ids = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert next_token_targets(ids, mask).tolist() == [
        [11, 12, 13, -100],
        [21, -100, -100, -100],
    ]
    assert next_token_targets(ids).tolist()[1] == [21, 22, 23, -100]


def test_random_ids_deterministic_and_avoiding():
    a = random_ids(50, 3, 40, seed=123)
    assert torch.equal(a, random_ids(50, 3, 40, seed=123))
    assert not torch.equal(a, random_ids(50, 3, 40, seed=124))
    assert a.dtype == torch.int64 and a.shape == (3, 40)
    assert int(a.min()) >= 0 and int(a.max()) < 50
    avoid = set(range(0, 50, 2)) | {1000}
    b = random_ids(50, 3, 40, seed=123, avoid=avoid)
    assert torch.equal(b, random_ids(50, 3, 40, seed=123, avoid=avoid))
    assert not set(b.flatten().tolist()) & avoid
    keep = a % 2 == 1  # ids not avoided stay those of the same seed
    assert torch.equal(a[keep], b[keep])
    with pytest.raises(ConfigError, match="every id"):
        random_ids(3, 1, 4, seed=0, avoid={0, 1, 2})
    with pytest.raises(ConfigError, match="vocab must be a positive integer"):
        random_ids(0, 1, 4, seed=0)


# -- report ---------------------------------------------------------------------------
def _report(passed=True):
    ref, cand = _logits(b=2, s=6, v=40, seed=11, noise=0.05 if passed else 3.0)
    m = compare_logits(ref, cand, targets=torch.randint(0, 40, (2, 6)), per_position=True)
    th = default_thresholds("fp8")
    layers = [{"layer": "embed", "rel_l2": 0.0}] + [
        {"layer": f"model.layers.{i}", "rel_l2": 1e-3 * (i + 1)} for i in range(100)
    ]
    ok, failure = check(m, th, layers)
    assert ok is passed
    return {
        "logits": m,
        "thresholds": th.as_dict(),
        "passed": ok,
        "failure": failure,
        "layers": layers,
        "decode": {"steps": 4, "passed": True, "max_rel_err": 1e-7, "argmax_equal": True},
        "time_s": 1.5,
        "peak_rss_mib": 512.25,
    }


def test_render_table_marks_pass_and_fail():
    good = render_table(_report(passed=True))
    assert "PASS" in good and "FAIL" not in good and good.endswith("RESULT: PASS")
    kld_line = next(line for line in good.splitlines() if "kld.mean" in line)
    assert "<= 0.01" in kld_line and kld_line.endswith("PASS")
    assert all(f"model.layers.{i} " in good for i in range(100))
    assert "decode (4 steps): PASS" in good
    assert "time: 1.5 s" in good and "peak memory (RSS): 512.2 MiB" in good
    bad = render_table(_report(passed=False))
    kld_line = next(line for line in bad.splitlines() if "kld.mean" in line)
    assert kld_line.endswith("FAIL")
    assert "RESULT: FAIL: kld.mean" in bad
    # without passed / failure the verdict is computed
    r = _report(passed=False)
    del r["passed"], r["failure"]
    assert "RESULT: FAIL: kld.mean" in render_table(r)


def test_write_json_round_trip_and_rejects_nan(tmp_path):
    r = _report()
    out = tmp_path / "report.json"
    write_json(r, out)
    text = out.read_text()
    assert json.loads(text) == json.loads(json.dumps(r))
    assert text.index('"decode"') < text.index('"layers"') < text.index('"logits"')  # sorted
    r["logits"]["kld"]["p99"] = float("nan")
    with pytest.raises(ValueError, match=r"\['kld'\]\['p99'\] is not finite"):
        write_json(r, tmp_path / "bad.json")
    r["logits"]["kld"]["p99"] = 0.0
    r["layers"][3]["rel_l2"] = math.inf
    with pytest.raises(ValueError, match="not finite"):
        write_json(r, tmp_path / "bad.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temp left


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    r = _report()
    r["layers"][5]["rel_l2"] = None
    plot(r, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    del r["logits"]["kld_per_position"]  # the summary bars instead
    del r["layers"]
    plot(r, tmp_path / "q.png")
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "q.png"]


def test_plot_without_matplotlib_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match="install matplotlib or drop --plot"):
        plot(_report(), tmp_path / "p.png")


def test_plot_scales_labels_and_limits_say_what_they_mean():
    """A log axis spans three decades (a 10% change is not a cliff); an exact zero is
    drawn below the smallest value, not a real value at a floor; the divergence line is
    named; the summary bars are titled as such, with max_kld drawn over the mean alone;
    a FAIL title names the failing metric."""
    pytest.importorskip("matplotlib")
    from k3convert.verify.report import figure

    r = _report(passed=True)
    r["layers"] = [{"layer": f"model.layers.{i}", "rel_l2": v}
                   for i, v in enumerate((6.4e-2, 7.1e-2))]  # fmt: skip
    lay, kld = figure(r).axes
    lo, hi = lay.get_ylim()
    assert hi / lo >= 1e3 and lo < 6.4e-2 and hi > 7.1e-2
    r["layers"] = [{"layer": "embed", "rel_l2": 0.0}, {"layer": "model.layers.0", "rel_l2": 3e-16}]
    lay, _ = figure(r).axes
    ys = lay.lines[0].get_ydata()
    assert ys[1] == 3e-16 and ys[0] < 3e-16  # the real value where it is; zero below it
    labels = kld.get_legend_handles_labels()[1]
    assert kld.get_title() == "KL(ref || cand) per position"
    assert any(x.startswith("mean ") for x in labels) and any("limits the mean" in x
                                                               for x in labels)  # fmt: skip
    del r["logits"]["kld_per_position"]
    _, kld = figure(r).axes
    assert kld.get_title() == "KL(ref || cand): summary over positions"
    (limit,) = kld.collections  # one segment, over the "mean" bar alone
    (x0, _), (x1, _) = limit.get_segments()[0]
    assert x1 - x0 < 1 and round((x0 + x1) / 2) == 0  # "mean" is the first bar
    bad = _report(passed=False)
    fig = figure(bad)
    assert fig._suptitle.get_text().startswith("verify: FAIL: kld.mean")
    lay, _ = fig.axes
    # the rule's layer (error 0 -> 1e-3 at model.layers.0), named as a jump
    assert "error jumps at: model.layers.0" in lay.get_legend_handles_labels()[1]


def test_top1_is_judged_where_the_reference_is_decisive():
    """A flip where the reference hesitates (top two 0.1 nats apart) says nothing; a flip
    where it leads by 2 nats fails min_top1; no decisive position: top-1 is not judged."""
    ref = torch.zeros(1, 4, 8)
    ref[0, :2, 0], ref[0, :2, 1] = 2.0, 1.9  # hesitant
    ref[0, 2:, 0] = 2.0  # decisive: 2 nats over the rest
    cand = ref.clone()
    cand[0, 0, 1] = 2.1  # flips a hesitant position
    m = compare_logits(ref, cand)
    assert (m["top1"], m["decisive_positions"], m["top1_decisive"]) == (0.75, 2, 1.0)
    th = Thresholds(max_kld=1.0, min_top1=0.9, max_rel_err=None)
    assert check(m, th) == (True, None)
    cand[0, 3, 5] = 3.0  # flips a decisive one
    ok, msg = check(compare_logits(ref, cand), th)
    assert not ok and msg == "top1_decisive = 0.5 < min_top1 0.9"
    flat = compare_logits(ref[:, :2], cand[:, :2])
    assert flat["decisive_positions"] == 0 and flat["top1_decisive"] is None
    assert [r["metric"] for r in limit_checks(flat, th)] == ["kld.mean"]


def test_a_group_carried_from_the_reference_sets_no_family():
    """Kimi K3's MXFP4 experts kept as released next to FP8 attention: judged as fp8, not
    mxfp4 (only what the conversion changed sets the family; an observer or targets that
    differ do not make it another encoding). Without the reference: mxfp4."""
    mx = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
          "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}  # fmt: skip
    fp8 = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
           "dynamic": False}  # fmt: skip
    ref = {"text_config": {"quantization_config": {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": mx}}}}}  # fmt: skip
    cand = {"quantization_config": {"config_groups": {
        "group_0": {"targets": ["re:.*q_proj$"], "weights": fp8,
                    "input_activations": {**fp8, "strategy": "token", "dynamic": True}},
        "group_1": {"targets": ["re:.*experts.*"], "weights": {**mx, "observer": "minmax"}},
    }}}  # fmt: skip
    assert thresholds_for_quant_config(cand).kind == "mxfp4"
    assert thresholds_for_quant_config(cand, ref).kind == "fp8"
    only_mx = {"quantization_config": {"config_groups": {"g": cand["quantization_config"][
        "config_groups"]["group_1"]}}}  # fmt: skip
    assert thresholds_for_quant_config(only_mx, ref).kind == "exact"
    nvfp4 = {"quantization_config": {"config_groups": {"g": {"weights": {
        **mx, "group_size": 16, "strategy": "tensor_group", "scale_dtype": None}}}}}  # fmt: skip
    assert thresholds_for_quant_config(nvfp4, ref).kind == "nvfp4a16"  # re-encoded: judged


def test_a_reshard_with_dynamic_activations_keeps_its_schemes_thresholds():
    """The same w8a8 checkpoint cut at tp 2 (row-parallel Linears quantize their local
    input slice): judged as int8, not as an exact reshard (its groups are the reference's
    own, but the conversion changed how they run); a carried-only candidate in bf16
    compute gets the bf16 reshard limits, not fp32's."""
    from k3convert.layout import Layout
    from k3convert.verify.run import LOW_PRECISION_EXACT, _thresholds

    w8 = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
    qc = {"config_groups": {"g": {"targets": ["Linear"], "weights": w8, "input_activations": {
        **w8, "strategy": "token", "dynamic": True}}}}  # fmt: skip
    cfg = {"quantization_config": qc}
    none = (None, None, None)
    assert _thresholds(cfg, cfg, Layout(tp=2), torch.float32, *none).kind == "int8"
    assert _thresholds(cfg, cfg, Layout(tp=1), torch.float32, *none).kind == "exact"
    observed = {"quantization_config": {**qc, "config_groups": {"g": {
        **qc["config_groups"]["g"], "targets": ["re:.*"]}}}}  # fmt: skip
    bf16 = _thresholds(observed, cfg, Layout(tp=1), torch.bfloat16, *none)
    assert bf16 == LOW_PRECISION_EXACT[torch.bfloat16]


# -- FP4 families and the summary -----------------------------------------------------
def test_fp4_schemes_get_their_own_threshold_families():
    """NVFP4 / MXFP4 are not judged as int4: weight-only NVFP4 (nvfp4a16) tighter than
    int4, MXFP4 as int4, NVFP4 W4A4 (nvfp4) looser; from the scheme name and from the
    config.json the scheme writes. A mix takes the loosest; an FP4 weight of another
    layout (no FP8 / E8M0 scales) is as coarse as int4."""
    want = {"nvfp4a16": (0.035, 0.8), "mxfp4": (0.05, 0.8), "nvfp4": (0.07, 0.75)}
    for name, (kld, top1) in want.items():
        th = default_thresholds(name)
        assert (th.kind, th.max_kld, th.min_top1, th.max_rel_err) == (name, kld, top1, None)
        qc = _ct(get_scheme(name).ct_scheme(["Linear"]))
        assert thresholds_for_quant_config({"quantization_config": qc}).kind == name
    int4 = default_thresholds("int4").max_kld
    assert default_thresholds("nvfp4a16").max_kld < int4 < default_thresholds("nvfp4").max_kld
    mix = _ct(get_scheme("nvfp4a16").ct_scheme(["re:.*experts.*"]), W4A16)
    assert thresholds_for_quant_config({"quantization_config": mix}).kind == "int4"
    mix = _ct(get_scheme("nvfp4a16").ct_scheme(["re:.*experts.*"]), FP8)
    assert thresholds_for_quant_config({"quantization_config": mix}).kind == "nvfp4a16"
    odd = _ct({"weights": {"num_bits": 4, "type": "float", "group_size": 64}})
    assert thresholds_for_quant_config({"quantization_config": odd}).kind == "int4"


def test_fp4_limits_follow_their_rounding_error_against_int4():
    """The FP4 limits are int4's scaled by (the format's RMS rounding error / int4 g128's)
    squared (KLD is second order in the perturbation); W4A4 NVFP4 rounds the inputs as
    coarsely as the weights: twice the error variance. Measured here on Gaussian weights
    with the schemes themselves, so a change to either side shows."""
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)).bfloat16().float()

    def err(name):
        s = get_scheme(name)
        return float((s.dequantize(s.quantize(w)).float() - w).norm() / w.norm())

    e_int4 = err("w4a16")
    int4 = default_thresholds("int4").max_kld
    for family, weights, inputs in (("nvfp4a16", "nvfp4a16", 1), ("mxfp4", "mxfp4", 1),
                                    ("nvfp4", "nvfp4a16", 2)):  # fmt: skip
        derived = int4 * inputs * (err(weights) / e_int4) ** 2
        assert default_thresholds(family).max_kld == pytest.approx(derived, rel=0.15), family


def _flat_report(kind="fp8", noise=0.05, **extra):
    """A verify report on near-flat logits (no decisive position: a random model's), one
    position 4x as far off as the others."""
    g = torch.Generator().manual_seed(3)
    ref = 0.05 * torch.randn(2, 8, 64, generator=g)
    cand = ref + noise * torch.randn(2, 8, 64, generator=g)
    cand[0, 0] += 4 * noise * torch.randn(64, generator=g)
    m = compare_logits(ref, cand)
    assert m["decisive_positions"] == 0
    return {
        "logits": m,
        "thresholds": default_thresholds(kind).as_dict(),
        "reference": "/models/orig",
        "reference_kind": "runtime",
        "reference_info": {
            "path": "/models/orig",
            "kind": "runtime",
            "what": "the original the candidate was converted from",
            "stored": ["bfloat16", "mxfp4"],
            "runner": "unsharded by k3convert's runtime in fp32",
        },
        "decode": {"steps": 4, "passed": True, "max_rel_err": 2e-7, "argmax_equal": True},
        **extra,
    }


def test_summary_puts_measured_values_next_to_their_limits():
    """The KLD mean beside its limit and the measured max beside it (not the limit in
    parentheses); top-1 not judged, with why in words; the raw max rel err, which no
    quantized family judges, not in the summary but explained in the table; the
    reference and the family named."""
    from k3convert.verify.summary import build_summary

    rep = _flat_report()
    m = rep["logits"]
    s = build_summary(rep)
    head, ref, kld, top1, dec = s["lines"]
    assert head == "PASS against the limits of the fp8 family (FP8 e4m3 weights / activations)"
    assert ref == (
        "reference: /models/orig (the original the candidate was converted from; "
        "stored bfloat16 + mxfp4), run unsharded by k3convert's runtime in fp32"
    )
    assert kld.startswith(f"KLD mean {m['kld']['mean']:.3g} <= 0.01, max {m['kld']['max']:.3g} ")
    assert m["kld"]["max"] > 0.01 > m["kld"]["mean"]  # the max is measured, above the limit
    assert top1 == (f"top-1 agreement {m['top1']:.3f} not judged: no position where the "
                    f"reference's top token leads by >= 0.5 nats (near-flat logits, typical "
                    f"of a random-weight model); the KLD decides")  # fmt: skip
    assert dec.startswith("decode: 4 KV-cache steps") and dec.endswith(": PASS")
    assert not any("logits max rel err" in x or f"{m['max_rel_err']:.3g}" in x
                   for x in s["lines"])  # fmt: skip
    checks = {c["check"]: c for c in s["checks"]}
    assert {k: (c["judged"], c["passed"]) for k, c in checks.items()} == {
        "kld_mean": (True, True), "kld_max": (False, None), "top1": (False, None),
        "max_rel_err": (False, None)}  # fmt: skip
    assert checks["kld_mean"]["limit"] == 0.01 and checks["kld_max"]["value"] == m["kld"]["max"]
    assert checks["top1"]["limit"] == 0.9 and "leads by >= 0.5 nats" in checks["top1"]["reason"]
    assert "relative to the reference's largest |logit|" in checks["max_rel_err"]["reason"]
    assert (s["threshold_family"], s["reference"]["path"]) == ("fp8", "/models/orig")
    table = render_table(rep)
    assert "summary: " + head in table and all(f"  {x}" in table for x in s["lines"][1:])
    assert "(max_rel_err: max |candidate - reference| over all logits" in table
    top1_row = next(x for x in table.splitlines() if x.startswith("  top1_decisive"))
    assert top1_row.split()[-4:] == [">=", "0.9", "not", "judged"]
    assert table.endswith("RESULT: PASS")


def test_summary_of_an_exact_reshard_and_of_a_failure():
    """Exact: the max rel err is judged, so it is in the summary with its limit and its
    meaning. A failure: the failing figure with '>' and FAIL, the verdict names it."""
    from k3convert.verify.summary import build_summary

    rep = _flat_report("exact", noise=1e-9)
    lines = build_summary(rep)["lines"]
    assert lines[0].startswith("PASS against the limits of the exact family")
    rel = rep["logits"]["max_rel_err"]
    assert f"logits max rel err {rel:.3g} <= 1e-05 (largest |candidate - reference|" in lines[4]
    rep = _flat_report("fp8", noise=0.5)
    s = build_summary(rep)
    assert s["passed"] is False and s["failure"].startswith("kld.mean = ")
    fam = "fp8 family (FP8 e4m3 weights / activations)"
    assert s["lines"][0] == f"FAIL against the limits of the {fam}: {s['failure']}"
    mean = rep["logits"]["kld"]["mean"]
    assert s["lines"][2].startswith(f"KLD mean {mean:.3g} > 0.01 FAIL, max ")
    table = render_table(rep)  # the RESULT line says the failure once
    assert table.count(s["failure"]) == 1 and table.endswith(f"RESULT: FAIL: {s['failure']}")


def test_json_html_and_convert_summary_say_the_same(tmp_path):
    """The verify JSON carries the summary (figures, limits, judged or not and why, the
    reference, the family); convert's report.json keeps it, and its terminal summary and
    HTML page print the same lines and reasons."""
    import html

    from k3convert.pipeline.convert_report import _verify_summary, render_summary
    from k3convert.report_html import write_html
    from k3convert.verify.summary import build_summary

    rep = _flat_report("nvfp4a16", passed=True, failure=None)
    rep["summary"] = build_summary(rep)
    write_json(rep, tmp_path / "v.json")
    back = json.loads((tmp_path / "v.json").read_text())
    s = back["summary"]
    assert s == json.loads(json.dumps(rep["summary"]))
    assert s["threshold_family"] == "nvfp4a16" and s["reference"]["path"] == "/models/orig"
    assert all({"value", "limit", "judged", "passed", "reason"} <= set(c) for c in s["checks"])
    conv = {"recipe": "r", "source": "/models/orig", "out": "/o", "model_type": "kimi_k3",
            "layout": {"tp": 2, "pp": 1, "moe_tp": 1, "moe_ep": 1, "redundant_experts": 0,
                       "world": 2}, "processes": 1,
            "sizes": {"source_bytes": 1, "quantized_bytes": None, "stream_bytes": 1,
                      "units": 1},
            "units": {"written": 1, "skipped": 0}, "seconds": {"total": 1.0},
            "verify": _verify_summary(back), "passed": True}  # fmt: skip
    assert conv["verify"]["summary"] == s and conv["verify"]["reference"] == "/models/orig"
    text = render_summary(conv)
    assert f"  verify      {s['lines'][0]}" in text
    assert all(f"              {x}" in text for x in s["lines"][1:])
    page = write_html(conv, None, tmp_path / "r.html").read_text()
    assert all(html.escape(x) in page for x in s["lines"])
    for c in s["checks"]:
        assert html.escape(c["label"]) in page
        assert html.escape(c["reason"] if c["reason"] else f"limit {c['op']} ") in page
    assert "nvfp4a16 family (NVFP4 weights, 16-bit activations)" in page

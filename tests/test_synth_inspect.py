"""synth writes what transformers loads; inspect's arithmetic matches the real models."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3convert.arch import resolve
from k3convert.checkpoint import open_checkpoint
from k3convert.errors import ArchError, ConfigError, OutputError
from k3convert.inspect import inspect_path
from k3convert.synth import PRESETS, preset_config, synthesize
from tests.models import build_model

# kimi-k2 is left out: its model_type "kimi_k2" makes transformers skip the deepseek_v3
# expert-fusing conversion (the release loads with trust_remote_code); deepseek-v3 covers it.
HF_CLASS = {
    "kimi-k25": "Kimi_K25ForConditionalGeneration",
    "deepseek-v3": "DeepseekV3ForCausalLM",
    "llama3-8b": "LlamaForCausalLM",
    "qwen3-30b-a3b": "Qwen3MoeForCausalLM",
}


def _config_file(tmp_path: Path, raw: dict) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    return p


# -- inspect on config alone -----------------------------------------------------------
def test_kimi_k2_published_dimensions(tmp_path):
    """Kimi-K2: hidden 7168, 61 layers, 384 experts of 2048, 8 active, 1 shared,
    vocab 163840, MLA 1536/512/128/64/128 -> ~1.03 T total, ~32 B active."""
    r = inspect_path(path=_config_file(tmp_path, preset_config("kimi-k2")))
    assert r["config_only"] and r["arch"] == "deepseek_v3" and r["alias_of"] == "deepseek_v3"
    assert 1.02e12 < r["total_params"] < 1.04e12
    assert 31e9 < r["active_params"] < 34e9
    assert r["experts"] == {"routed": 384, "active": 8, "shared": 1}
    assert r["layers"] == 61 and r["dense_layers"] == 1


def test_deepseek_v3_published_dimensions(tmp_path):
    """DeepSeek-V3 reports 671 B main-model parameters, 37 B active, 14 B in MTP."""
    r = inspect_path(path=_config_file(tmp_path, preset_config("deepseek-v3")))
    assert abs(r["total_params"] / 1e9 - 671) < 2
    assert abs(r["active_params"] / 1e9 - 37) < 1.5
    assert abs(r["mtp_params"] / 1e9 - 14) < 1
    dropped = inspect_path(
        path=_config_file(tmp_path, preset_config("deepseek-v3")), keep_mtp=False
    )
    assert dropped["mtp_params"] == 0 and dropped["total_params"] == r["total_params"]


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k25"]
)
def test_param_count_matches_transformers(family, tiny_models):
    """inspect (checkpoint and config-only) == sum(p.numel()) of the transformers model."""
    model = build_model(family)
    want = sum(p.numel() for p in model.parameters())  # tied weights counted once
    # the router bias is a buffer in transformers but a stored, trained tensor: we count it
    want += sum(b.numel() for n, b in model.named_buffers() if "e_score_correction" in n)
    r = inspect_path(path=tiny_models[family])
    assert r["total_params"] == want
    cfg_only = inspect_path(path=tiny_models[family] / "config.json")
    assert cfg_only["total_params"] == want
    assert r["missing"] == []
    routed = r["by_component"].get("routed_experts", {"params": 0})["params"]
    if routed:
        text = getattr(model.config, "text_config", model.config)
        topk = text.num_experts_per_tok
        n = (
            getattr(text, "n_routed_experts", None)
            or getattr(text, "num_experts", None)
            or (text.num_local_experts)
        )
        assert r["active_params"] == round(want - routed + routed * topk / n)


def test_inspect_rejects_shape_that_disagrees_with_config(tmp_path, tiny_models):
    src = tiny_models["llama"]
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArchError, match=r"mlp\..*_proj.weight' has shape .* implies"):
        inspect_path(path=bad)


def test_inspect_tensor_table(tiny_models):
    r = inspect_path(path=tiny_models["deepseek_v3"], tensors=True)
    rows = {t["name"]: t for t in r["tensors"]}
    assert rows["model.layers.1.mlp.gate.weight"]["keep"] is True
    assert rows["model.layers.1.mlp.experts.3.down_proj.weight"]["expert"] == 3
    assert rows["model.layers.1.mlp.experts.3.down_proj.weight"]["split"] == "row"
    assert rows["model.layers.0.self_attn.q_b_proj.weight"]["split"] == "heads"
    assert rows["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]["split"] == "replicate"
    assert rows["model.embed_tokens.weight"]["component"] == "embeddings"


# -- synth ---------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(HF_CLASS))
def test_synth_loads_in_transformers(preset, tmp_path):
    """transformers loads what synth writes with no missing keys, values intact."""
    import transformers as tf

    out = tmp_path / preset
    synthesize(config=preset, out=out, tiny=True, encoding="plain", dtype="fp32")
    model, info = getattr(tf, HF_CLASS[preset]).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info.get("mismatched_keys")
    ck = open_checkpoint(out)
    sd = model.state_dict()
    # compare a few tensors by their transformers-side names
    if preset in ("llama3-8b", "qwen3-30b-a3b", "deepseek-v3"):
        for n in ("model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight"):
            assert torch.equal(sd[n], ck.get(n))
    else:
        n = "language_model.model.layers.0.self_attn.kv_b_proj.weight"
        assert torch.equal(
            sd["model.language_model.layers.0.self_attn.kv_b_proj.weight"], ck.get(n)
        )
    # and transformers can run it
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]])
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("preset", PRESETS)
def test_synth_layout_matches_table(preset, tmp_path):
    """Every written tensor classifies, shapes match the config, encodings as the release."""
    out = tmp_path / "m"
    synthesize(config=preset, out=out, tiny=True, shard_mb=0)
    ck = open_checkpoint(out)
    arch, cfg = resolve(ck.config)
    matched = arch.match(cfg, ck.names())
    assert set(matched) == set(ck.names())
    # the shape the config implies, or the padded one a release stores (K3's A_log)
    assert all(ck.meta(n).shape in (m.shape, m.stored) for n, m in matched.items())
    encs = {ck.meta(n).encoding for n in ck.names()}
    raw = preset_config(preset)
    qc = (
        raw.get("quantization_config")
        or raw.get("text_config", {}).get("quantization_config")
        or {}
    )
    if qc.get("format") == "mxfp4-pack-quantized":  # Kimi K3: routed experts only
        assert encs == {"plain", "mxfp4-pack-quantized"}
        routed = [n for n in ck.names() if ".experts." in n]
        assert routed and all(ck.meta(n).encoding == "mxfp4-pack-quantized" for n in routed)
        assert all(ck.meta(n).encoding == "plain" for n in ck.names() if n not in routed)
    elif qc.get("quant_method") == "fp8":
        assert encs == {"plain", "fp8-block"}
        assert ck.meta("model.layers.0.self_attn.q_b_proj.weight").encoding == "fp8-block"
        router = next(n for n in ck.names() if n.endswith("mlp.gate.weight"))
        assert ck.meta(router).encoding == "plain"
    elif qc.get("quant_method") == "compressed-tensors":
        assert encs == {"plain", "pack-quantized"}
        routed = [n for n in ck.names() if ".experts." in n]
        assert routed and all(ck.meta(n).encoding == "pack-quantized" for n in routed)
        assert all(ck.meta(n).encoding == "plain" for n in ck.names() if n not in routed)
    else:
        assert encs == {"plain"}


def test_synth_encoded_values_dequantize_close(tmp_path):
    """FP8-block and int4 synth output dequantizes close to the plain values (same seed)."""
    plain, fp8, int4 = (tmp_path / k for k in ("plain", "fp8", "int4"))
    synthesize(config="kimi-k2", out=plain, tiny=True, encoding="plain", dtype="fp32")
    synthesize(config="kimi-k2", out=fp8, tiny=True, encoding="fp8-block", dtype="fp32")
    # int4 as Kimi-K2-Thinking ships it: routed experts only (g32 must divide every in-dim)
    synthesize(config="kimi-k2-thinking", out=int4, tiny=True, dtype="fp32")
    a, b, c = (open_checkpoint(p) for p in (plain, fp8, int4))
    n = "model.layers.1.mlp.experts.2.down_proj.weight"
    ref = a.get(n)
    assert b.meta(n).encoding == "fp8-block" and c.meta(n).encoding == "pack-quantized"
    rel8 = ((b.get(n) - ref).norm() / ref.norm()).item()
    rel4 = ((c.get(n) - ref).norm() / ref.norm()).item()
    assert rel8 < 0.05, rel8  # e4m3 has 3 mantissa bits: ~2-4 % relative error
    assert 0.02 < rel4 < 0.2, rel4  # int4 g32: coarser, but far from noise


def test_synth_sharded_with_index_is_identical(tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    synthesize(config="deepseek-v3", out=one, tiny=True)
    synthesize(config="deepseek-v3", out=many, tiny=True, shard_mb=0.1)
    idx = json.loads((many / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) == len(list(many.glob("*.safetensors"))) > 2
    a, b = open_checkpoint(one), open_checkpoint(many)
    assert a.names() == b.names()
    for n in a.names():
        for part, t in a.get_parts(n).items():
            assert torch.equal(t.view(torch.uint8), b.get_parts(n)[part].view(torch.uint8))


def test_synth_overrides_and_errors(tmp_path):
    out = tmp_path / "m"
    synthesize(config="qwen3-30b-a3b", out=out, tiny=True, overrides={"layers": 3, "experts": 4})
    r = inspect_path(path=out)
    assert r["layers"] == 3 and r["experts"]["routed"] == 4
    with pytest.raises(OutputError, match="already exists"):
        synthesize(config="qwen3-30b-a3b", out=out, tiny=True)
    synthesize(config="qwen3-30b-a3b", out=out, tiny=True, force=True)
    with pytest.raises(ConfigError, match="preset"):
        synthesize(config="no-such-model", out=tmp_path / "x")
    with pytest.raises(OutputError, match="GiB"):  # full-size 1 T model: refused up front
        synthesize(config="kimi-k2", out=tmp_path / "huge")
    assert not (tmp_path / "huge").exists() and not (tmp_path / ".huge.partial").exists()


def test_fp8_block_encode_matches_independent_dequant():
    from k3convert.synth import fp8_block_encode

    torch.manual_seed(0)
    w = torch.randn(200, 300)
    e = fp8_block_encode(w)
    assert e["weight_scale_inv"].shape == (math.ceil(200 / 128), math.ceil(300 / 128))
    deq = torch.empty(200, 300)
    for i in range(0, 200, 128):
        for j in range(0, 300, 128):
            s = e["weight_scale_inv"][i // 128, j // 128]
            deq[i : i + 128, j : j + 128] = e["weight"][i : i + 128, j : j + 128].float() * s
    assert ((deq - w).norm() / w.norm()) < 0.05


# -- CLI -------------------------------------------------------------------------------------
def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "k3convert.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
    )


def test_cli_inspect_json_and_errors(tmp_path, tiny_models):
    r = _cli("inspect", tiny_models["kimi_k25"], "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["arch"] == "kimi_k25" and rep["vision"]["blocks"] == 2
    bad = _config_file(tmp_path, {"model_type": "gpt9000", "hidden_size": 8})
    r = _cli("inspect", bad)
    assert r.returncode == 2
    assert "unknown model_type 'gpt9000'" in r.stderr and "deepseek_v3" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("inspect", tmp_path / "nope")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_cli_version_and_synth(tmp_path):
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("k3convert ")
    r = _cli("synth", "llama3-8b", tmp_path / "m", "--tiny", "--layers", "3")
    assert r.returncode == 0, r.stderr
    assert inspect_path(path=tmp_path / "m")["layers"] == 3
    r = _cli("synth", "llama3-8b", tmp_path / "m", "--tiny")
    assert r.returncode == 2 and "already exists" in r.stderr


def test_demo_runs(tmp_path):
    """synth a tiny Kimi K3, convert it with the demo preset, print the summary."""
    r = _cli("demo", "--out", "demo", "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "kimi_k3" in r.stdout and "verify      PASS" in r.stdout
    # a relative --out: said where first, and every path printed is the absolute one
    out = (tmp_path / "demo").resolve()
    assert r.stdout.startswith(f"demo: writing into {out}/"), r.stdout[:300]
    printed = re.findall(r"(\S*demo/(?:stream|model|report)\S*)", r.stdout)
    assert printed and all(p.startswith(str(out)) for p in printed), printed
    rep = json.loads((tmp_path / "demo" / "stream" / "report.json").read_text())
    assert rep["passed"] is True and rep["layout"]["world"] == 4
    assert rep["units"]["written"] == rep["sizes"]["units"] > 0
    assert "fp8-dynamic" in rep["quantize"]["schemes"]
    assert (tmp_path / "demo" / "report.html").read_text().startswith("<!doctype html>")
    # verify's summary: the measured KLD next to its limit (not the limit as "(max 0.01)"),
    # the reference named, the family of what the conversion changed (FP8; the MXFP4
    # experts are kept as released)
    v = rep["verify"]["summary"]
    assert v["threshold_family"] == "fp8" and v["reference"]["path"] == str(out / "model")
    assert re.search(r"\n {14}KLD mean [\d.e-]+ <= 0\.01, max [\d.e-]+ ", r.stdout), r.stdout
    assert f"reference: {out}/model (the original the candidate was converted from" in r.stdout
    assert "(max 0.01)" not in r.stdout


def test_demo_never_replaces_a_directory_it_did_not_write(tmp_path):
    """--out DIR with a DIR/model the demo did not write: refused, nothing deleted."""
    notes = tmp_path / "d" / "model" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("mine")
    r = _cli("demo", "--out", tmp_path / "d", "--no-progress")
    assert r.returncode == 2 and "was not written by `k3convert demo`" in r.stderr
    assert notes.read_text() == "mine"


def test_inspect_stream_directory(tmp_path, tiny_models):
    """A shard output is reported with its layout, not mistaken for a bare config."""
    from k3convert.shard import shard

    out = tmp_path / "stream"
    shard(src=tiny_models["qwen3_moe"], out=out, tp=2, pp=2, ep=2, progress=False)
    r = inspect_path(path=out)
    assert r["stream"]["world"] == 4 and r["stream"]["moe_ep"] == 2
    assert r["total_params"] == inspect_path(path=tiny_models["qwen3_moe"])["total_params"]
    assert r["stream"]["raw_bytes"] >= r["stream"]["bytes"] > 0


@pytest.mark.parametrize(
    "cfg,want",
    [
        ({"bos_token_id": 300, "eos_token_id": [301, 302]}, (300, 301, "<|eos_1|>")),
        ({"bos_token_id": 300, "eos_token_id": 300}, (300, 300, "<|reserved_302|>")),
        ({}, (398, 399, "<|reserved_302|>")),
    ],
)
def test_synth_tokenizer_special_ids(cfg, want):
    """Every id is one vocabulary entry (a second EOS id its own token), a shared BOS = EOS
    id one token both roles name, and a config without them gets the top free ids; the
    tokenizers library reads it so."""
    from tokenizers import Tokenizer

    from k3convert.synth_tokenizer import tokenizer_files

    files = tokenizer_files(cfg, {}, 400)
    tok = Tokenizer.from_str(files["tokenizer.json"])
    conf = json.loads(files["tokenizer_config.json"])
    bos, eos, third = want
    assert tok.get_vocab_size() == 400
    assert tok.token_to_id(conf["bos_token"]) == bos and tok.token_to_id(conf["eos_token"]) == eos
    assert tok.id_to_token(302) == third
    assert tok.encode("hi").ids[0] == bos
    assert tok.decode(tok.encode("héllo").ids, skip_special_tokens=True) == "héllo"

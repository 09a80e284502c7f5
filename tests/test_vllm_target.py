"""``shard --target vllm`` without vLLM: the files' layout, the index written last,
``shard --check``, and the refusals. (vLLM itself judges the files in
``tests/test_vllm_sharded.py`` when its venv is present.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from k3convert.checkpoint import open_checkpoint
from k3convert.engines.vllm_sharded import INDEX, check_vllm, pp_layers, write_vllm
from k3convert.errors import ConfigError
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
    with pytest.raises(ConfigError, match="tp=3 must divide the 4 attention heads"):
        write_vllm(src=llama, out=tmp_path / "bad", tp=3)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))


def test_refusals_are_one_line_exit_2(llama, tmp_path):
    k3 = tmp_path / "k3"
    synthesize(config="kimi-k3", out=k3, tiny=True)
    r = _cli("shard", k3, tmp_path / "o", "--target", "vllm")
    assert r.returncode == 2 and "writes llama for now, not 'kimi_k3'" in r.stderr
    r = _cli("shard", llama, tmp_path / "o", "--target", "vllm", "--ep", "2")
    assert r.returncode == 2 and "--ep apply to the stream target" in r.stderr
    from k3convert.pipeline import quantize

    q = tmp_path / "w4"
    quantize(src=llama, out=q, scheme="w4a16", progress=False)
    r = _cli("shard", q, tmp_path / "o", "--target", "vllm", "--tp", "2")
    assert r.returncode == 2 and "o_proj.weight_scale: a tensor-parallel boundary at 64" in r.stderr
    assert not (tmp_path / "o").exists()
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized"


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
    r = _cli("shard", "--check", out)
    assert r.returncode == 1 and "not the 2 of tp 2 x pp 1" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

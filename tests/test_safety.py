"""Hostile and careless inputs (issue 12): no code from the model directory runs, no
source is ever deleted or overwritten, nothing half-written is taken for output, every
verb runs the same validation, and every failure is one line with exit 2 (1: damage)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3convert.checkpoint.output import PARTIAL_MARKER
from k3convert.cli import main
from k3convert.stream import read_manifest_doc, write_manifest_doc
from tests.test_runtime import IMG, image_inputs

CLI = [sys.executable, "-m", "k3convert.cli"]


def run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line_error(err: str) -> str:
    """The one error line that ends stderr (progress bars may precede it)."""
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err[-2000:]
    assert "Traceback" not in err
    return errors[0][errors[0].index("error: ") :]


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root (what must never change)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def llama(quant_sources, tmp_path) -> Path:
    """A private copy of a tiny llama (128-wide, so every scheme applies) under
    tmp/parent/src: tests may try to wreck it."""
    d = tmp_path / "parent" / "src"
    shutil.copytree(quant_sources["llama"], d)
    return d


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with ``edit(tensors)`` applied (safetensors'
    own loader and writer, not ours)."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


# -- 1. code in the model directory never runs -----------------------------------------
def test_forward_never_runs_tokenizer_code(llama, tmp_path):
    marker = tmp_path / "PWNED"
    (llama / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizer\n"
        "class EvilTokenizer(PreTrainedTokenizer):\n    pass\n"
    )
    (llama / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "EvilTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
            }
        )
    )
    r = subprocess.run(
        [*CLI, "forward", str(llama), "--ids", "1 2 3"],
        input="y\ny\ny\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert not marker.exists()
    assert "needs custom code" in r.stdout
    assert "id " in r.stdout  # ids shown instead of decoded text


# -- 3. OUT never is, holds or lies inside a source ------------------------------------
@pytest.mark.parametrize(
    "verb,out",
    [
        ("quantize", "src"),
        ("quantize", "parent"),
        ("quantize", "src/inner"),
        ("shard", "src"),
        ("shard", "parent"),
        ("shard", "src/inner"),
        ("synth", "src"),
        ("synth", "parent"),
    ],
)
def test_out_never_touches_the_source(verb, out, llama, capsys):
    parent = llama.parent
    before = tree_digest(parent)
    target = {"src": llama, "parent": parent, "src/inner": llama / "inner"}[out]
    extra = {"quantize": ["--scheme", "w4a16"], "shard": ["--tp", "1"], "synth": ["--tiny"]}
    rc, _, err = run(capsys, verb, llama, target, *extra[verb], "--force")
    line = one_line_error(err)
    assert rc == 2
    assert "source" in line and "OUT" in line
    assert tree_digest(parent) == before  # nothing deleted, nothing added


def test_symlinked_out_is_refused(llama, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(llama, target_is_directory=True)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    link2 = tmp_path / "link2"
    link2.symlink_to(other, target_is_directory=True)
    before = tree_digest(llama.parent)
    for out in (link, link2):
        for verb, extra in (("quantize", ["--scheme", "w4a16"]), ("shard", [])):
            rc, _, err = run(capsys, verb, llama, out, *extra, "--force")
            assert rc == 2
            assert "symbolic link" in one_line_error(err)
    assert tree_digest(llama.parent) == before
    assert (other / "keep.txt").read_text() == "mine" and link2.is_symlink()


def test_save_logits_never_writes_into_the_source(llama, capsys):
    before = tree_digest(llama)
    rc, _, err = run(
        capsys, "forward", llama, "--ids", "1 2", "--save-logits", llama / "model.safetensors"
    )
    assert rc == 2 and "source" in one_line_error(err)
    assert tree_digest(llama) == before


# -- 4. stale partial output ------------------------------------------------------------
def _killed_partial(out: Path) -> Path:
    """A partial directory left by a k3convert process that was SIGKILLed mid-write."""
    code = textwrap.dedent(
        f"""
        import os, signal
        from k3convert.checkpoint.output import staged_output
        with staged_output({str(out)!r}, force=False, need_bytes=0) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert r.returncode == -signal.SIGKILL
    (partial,) = out.parent.glob(f".{out.name}.partial-*")
    assert (partial / PARTIAL_MARKER).is_file()
    return partial


def test_rerun_removes_stale_partial_it_owns(llama, tmp_path, capsys):
    out = tmp_path / "q"
    partial = _killed_partial(out)
    foreign = tmp_path / f".{out.name}.partial-1"  # no marker: not provably ours
    foreign.mkdir()
    (foreign / "x").write_text("someone else's")
    for p in (partial, foreign):  # never taken for a checkpoint
        for verb in ("inspect", "shard"):
            args = [verb, p] + ([tmp_path / "s"] if verb == "shard" else [])
            rc, _, err = run(capsys, *args)
            assert rc == 2 and "unfinished output" in one_line_error(err)
    rc, _, err = run(capsys, "quantize", llama, out, "--scheme", "w4a16")
    assert rc == 0, err
    assert not partial.exists()
    assert (foreign / "x").read_text() == "someone else's"
    assert not (out / PARTIAL_MARKER).exists()
    assert (out / "model.safetensors").is_file()


def test_partial_of_a_live_run_is_not_removed(llama, tmp_path, capsys):
    from k3convert.checkpoint.output import _marker

    out = tmp_path / "q"
    live = tmp_path / f".{out.name}.partial-{os.getpid() + 1}"
    live.mkdir()
    (live / PARTIAL_MARKER).write_text(json.dumps({**_marker(), "out": str(out.resolve())}))
    rc, _, err = run(capsys, "quantize", llama, out, "--scheme", "w4a16")
    assert rc == 2 and "another k3convert run" in one_line_error(err)
    assert live.is_dir() and not out.exists()


def test_interrupted_stream_is_not_a_checkpoint(llama, tmp_path, capsys):
    out = tmp_path / "s"
    (out / ".k3-journal").mkdir(parents=True)
    rc, _, err = run(capsys, "shard", out, tmp_path / "s2")
    msg = one_line_error(err)
    assert rc == 2 and "without its manifest.json" in msg and "interrupted" in msg, msg


# -- 5 / 18. read-only, full or failing disks -------------------------------------------
@contextlib.contextmanager
def tmpfs(path: Path, size: str, ro: bool = False):
    """A real small filesystem (root only); skips where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_out_under_a_file_is_one_line(llama, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for args in (
        ["quantize", llama, blocker / "out", "--scheme", "w4a16"],
        ["shard", llama, blocker / "out"],
        ["forward", llama, "--ids", "1", "--save-logits", blocker / "l.safetensors"],
    ):
        rc, _, err = run(capsys, *args)
        assert rc == 2, err
        one_line_error(err)


def test_read_only_filesystem(llama, tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "1m", ro=True) as ro:
        for args in (
            ["quantize", llama, ro / "q", "--scheme", "w4a16"],
            ["synth", "llama3-8b", ro / "s", "--tiny"],
            ["shard", llama, ro / "s"],
            ["forward", llama, "--ids", "1 2", "--save-logits", ro / "l.safetensors"],
        ):
            rc, _, err = run(capsys, *args)
            assert rc == 2, err
            assert "read-only" in one_line_error(err)


def test_disk_full_mid_write(llama, tmp_path, capsys, monkeypatch):
    import k3convert.checkpoint.output as output
    import k3convert.shard.writer as shard_writer

    # pretend the up-front estimate passed, so the kernel's ENOSPC arrives mid-write
    monkeypatch.setattr(output, "free_bytes", lambda p: 1 << 40)
    monkeypatch.setattr(shard_writer, "free_bytes", lambda p: 1 << 40)
    many = " ".join(["7"] * 200)  # logits [1, 200, 160] float32: 128 KB > the disk
    with tmpfs(tmp_path / "full", "64k") as full:
        for args in (
            ["quantize", llama, full / "q", "--scheme", "w8a8"],
            ["shard", llama, full / "s", "--compress", "zstd"],
            ["shard", llama, full / "s2"],
            ["forward", llama, "--ids", many, "--save-logits", full / "l.safetensors"],
        ):
            rc, _, err = run(capsys, *args)
            assert rc == 2, err
            assert "disk is full" in one_line_error(err)
        assert not (full / "q").exists() and not (full / "l.safetensors").exists()
        assert not (full / "s" / "manifest.json").exists()
        assert not [p for p in full.iterdir() if ".partial-" in p.name]


def test_file_size_limit_mid_quantize(llama, tmp_path):
    """Works without mount privileges: RLIMIT_FSIZE makes the kernel fail a write."""
    out = tmp_path / "q"
    code = textwrap.dedent(
        f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        from k3convert.cli import main
        sys.exit(main(["quantize", {str(llama)!r}, {str(out)!r}, "--scheme", "w8a8"]))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "File too large" in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".q.partial-*"))


def test_zstd_shard_checks_free_space(llama, tmp_path, capsys, monkeypatch):
    import k3convert.shard.writer as shard_writer

    monkeypatch.setattr(shard_writer, "free_bytes", lambda p: 1000)
    rc, _, err = run(capsys, "shard", llama, tmp_path / "s", "--compress", "zstd")
    assert rc == 2 and "free" in one_line_error(err)
    assert not (tmp_path / "s").exists()


# -- 6 / 7. every verb runs the same validation -----------------------------------------
def _bad_checkpoints(llama: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    def transpose_k(t):
        k = "model.layers.0.self_attn.k_proj.weight"
        t[k] = t[k].t().contiguous()

    def norm_2d(t):
        k = "model.layers.1.input_layernorm.weight"
        t[k] = t[k][None].contiguous()

    def reshape_embed(t):
        k = "model.embed_tokens.weight"
        t[k] = t[k].reshape(-1, 32).contiguous()

    def drop_o_proj(t):
        del t["model.layers.1.self_attn.o_proj.weight"]

    return {
        "transposed k_proj": (rewrite(llama, tmp_path / "k", transpose_k), "k_proj.weight' has"),
        "2-D norm": (rewrite(llama, tmp_path / "n", norm_2d), "input_layernorm.weight' has"),
        "embedding": (rewrite(llama, tmp_path / "e", reshape_embed), "embed_tokens.weight' has"),
        "missing": (rewrite(llama, tmp_path / "m", drop_o_proj), "layers.1.self_attn.o_proj"),
    }


def test_every_verb_refuses_shape_mismatch_and_missing_tensors(llama, tmp_path, capsys):
    for label, (src, want) in _bad_checkpoints(llama, tmp_path).items():
        for verb, extra in (
            ("inspect", []),
            ("quantize", [tmp_path / f"q-{src.name}", "--scheme", "w4a16"]),
            ("shard", [tmp_path / f"s-{src.name}", "--tp", "2"]),
            ("forward", ["--ids", "1 2 3"]),
        ):
            rc, out, err = run(capsys, verb, src, *extra)
            if verb == "inspect" and label == "missing":  # inspect reports, not refuses
                assert rc == 0 and "absent" in out
                continue
            assert rc == 2, (label, verb, out[-500:])
            assert want in one_line_error(err), (label, verb)
        assert not list(tmp_path.glob(f"[qs]-{src.name}*"))


# -- 14. absurd configs -------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit,want",
    [
        ({"num_hidden_layers": 1_000_000_000}, "beyond any real model"),
        ({"num_hidden_layers": True}, "positive integer"),
        ({"vocab_size": 2**40}, "beyond any real model"),
        ({"hidden_size": "64"}, "positive integer"),
    ],
)
def test_absurd_config_is_refused_fast(edit, want, tiny_models, tmp_path):
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**cfg, **edit}))
    r = subprocess.run([*CLI, "inspect", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout[-500:]
    assert want in one_line_error(r.stderr)


def test_layers_times_experts_bounded(tiny_models, tmp_path):
    cfg = json.loads((tiny_models["deepseek_v3"] / "config.json").read_text())
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**cfg, "num_hidden_layers": 4000, "n_routed_experts": 65536}))
    r = subprocess.run([*CLI, "inspect", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "expert instances" in one_line_error(r.stderr)


@pytest.mark.parametrize(
    "key,value",
    [("rms_norm_eps", float("nan")), ("rms_norm_eps", -1.0), ("rope_theta", float("inf"))],
)
def test_non_finite_config_floats(key, value, llama, capsys):
    cfg = json.loads((llama / "config.json").read_text())
    holder = cfg.get("rope_parameters") if key == "rope_theta" else None
    (holder if isinstance(holder, dict) else cfg)[key] = value
    (llama / "config.json").write_text(json.dumps(cfg))  # json writes NaN / Infinity
    rc, _, err = run(capsys, "forward", llama, "--ids", "1 2")
    assert rc == 2 and key in one_line_error(err)


# -- 16. forward inputs ---------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
def test_forward_empty_ids_file(shape, llama, tmp_path, capsys):
    f = tmp_path / "ids.safetensors"
    save_file({"input_ids": torch.zeros(shape, dtype=torch.long)}, f)
    rc, _, err = run(capsys, "forward", llama, "--ids-file", f)
    assert rc == 2 and "empty" in one_line_error(err)


@pytest.mark.parametrize("ids", ["99999999999999999999", "1 -3", "1 2;3 9223372036854775808"])
def test_forward_ids_out_of_range(ids, llama, capsys):
    rc, _, err = run(capsys, "forward", llama, "--ids", ids)
    assert rc == 2 and "not a token id" in one_line_error(err)


def _pixels(tmp_path: Path, pv: torch.Tensor, grid: torch.Tensor) -> Path:
    f = tmp_path / "px.safetensors"
    save_file({"pixel_values": pv.contiguous(), "image_grid_thw": grid.contiguous()}, f)
    return f


@pytest.mark.parametrize(
    "grid,want",
    [([[1, -2, 4]], "positive"), ([[0, 2, 4]], "positive"), ([[1, 0, 0]], "positive")],
)
def test_forward_bad_image_grid(grid, want, tiny_models, tmp_path, capsys):
    pv, _ = image_inputs([[1, 2, 4]])
    f = _pixels(tmp_path, pv, torch.tensor(grid))
    ids = f"3 {IMG} {IMG} 5"
    rc, _, err = run(capsys, "forward", tiny_models["kimi_k25"], "--ids", ids, "--pixel-values", f)
    assert rc == 2 and want in one_line_error(err)


def test_forward_nan_pixels(tiny_models, tmp_path, capsys):
    pv, grid = image_inputs([[1, 2, 4]])
    pv = pv.clone()
    pv.view(-1)[7] = float("nan")
    f = _pixels(tmp_path, pv, grid)
    rc, _, err = run(
        capsys, "forward", tiny_models["kimi_k25"], "--ids", f"3 {IMG} {IMG} 5", "--pixel-values", f
    )
    assert rc == 2 and "NaN" in one_line_error(err)


def test_forward_nan_weight_scale_is_an_error(quant_sources, tmp_path, capsys):
    q = tmp_path / "q"
    rc, _, err = run(capsys, "quantize", quant_sources["llama"], q, "--scheme", "fp8-block")
    assert rc == 0, err

    def poison(t):
        k = "model.layers.1.mlp.down_proj.weight_scale"
        t[k] = t[k].clone()
        t[k].view(-1)[0] = float("nan")

    bad = rewrite(q, tmp_path / "bad", poison)
    rc, out, err = run(capsys, "forward", bad, "--ids", "1 2 3")
    assert rc == 2, out[-500:]
    line = one_line_error(err)
    assert "NaN or infinite" in line and "layer.1" in line
    rc, out, _ = run(capsys, "forward", q, "--ids", "1 2 3")
    assert rc == 0 and "p=nan" not in out


# -- 20. damage is exit 1 in every verb ------------------------------------------------------
def test_damaged_stream_is_exit_1_everywhere(llama, tmp_path, capsys):
    s = tmp_path / "s"
    rc, _, err = run(capsys, "shard", llama, s)
    assert rc == 0, err
    unit = sorted(next(s.glob("rank*")).glob("*.safetensors"))[-1]  # a unit, not units.json
    data = bytearray(unit.read_bytes())
    data[-1] ^= 0xFF
    unit.write_bytes(bytes(data))
    rc, _, _ = run(capsys, "shard", "--check", s)
    assert rc == 1
    rc, _, err = run(capsys, "forward", s, "--ids", "1 2")
    assert rc == 1 and "xxh3-128 hash mismatch" in one_line_error(err)


# -- review follow-ups -----------------------------------------------------------------------
def test_force_never_replaces_a_directory_that_is_no_output(llama, tmp_path, capsys):
    d = tmp_path / "thesis"
    d.mkdir()
    (d / "thesis.tex").write_text("years of work")
    for verb, extra in (
        ("quantize", ["--scheme", "w4a16"]),
        ("shard", []),
        ("synth", ["--tiny"]),
    ):
        src = "llama3-8b" if verb == "synth" else llama
        rc, _, err = run(capsys, verb, src, d, *extra, "--force")
        assert rc == 2 and "--force replaces a previous" in one_line_error(err)
        assert (d / "thesis.tex").read_text() == "years of work"
    # a previous output is replaced
    q = tmp_path / "q"
    for _ in range(2):
        rc, _, err = run(capsys, "quantize", llama, q, "--scheme", "w4a16", "--force")
        assert rc == 0, err
    s = tmp_path / "s"
    for _ in range(2):
        rc, _, err = run(capsys, "shard", llama, s, "--force")
        assert rc == 0, err


def test_synth_out_next_to_its_config_file(tiny_models, tmp_path, capsys):
    cfg = tmp_path / "config.json"
    shutil.copyfile(tiny_models["llama"] / "config.json", cfg)
    rc, _, err = run(capsys, "synth", cfg, tmp_path / "tiny", "--tiny")
    assert rc == 0, err
    rc, _, err = run(capsys, "synth", cfg, tmp_path, "--tiny", "--force")
    assert rc == 2 and "contains the source" in one_line_error(err)
    assert cfg.is_file()


def test_bind_mounted_alias_of_the_source_is_refused(llama, tmp_path, capsys):
    alias = tmp_path / "alias"
    alias.mkdir()
    r = subprocess.run(["mount", "--bind", str(llama), str(alias)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({r.stderr.decode().strip()[:80]})")
    try:
        before = tree_digest(llama)
        rc, _, err = run(capsys, "quantize", llama, alias, "--scheme", "w4a16", "--force")
        assert rc == 2 and "is the source" in one_line_error(err)
        assert tree_digest(llama) == before
    finally:
        subprocess.run(["umount", "-l", str(alias)], capture_output=True)


@pytest.mark.parametrize("where", ["config", "header"])
def test_integer_beyond_the_digit_limit_is_invalid_json(where, llama, capsys):
    big = "1" + "0" * 5000
    if where == "config":
        text = (llama / "config.json").read_text().rstrip().rstrip("}")
        (llama / "config.json").write_text(text + f', "x": {big}}}')
    else:
        f = llama / "model.safetensors"
        blob = f.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        header = blob[8 : 8 + n].rstrip(b" ")
        new = header[:-1] + b',"__x__":' + big.encode() + b"}"
        new += b" " * (-len(new) % 8)
        f.write_bytes(len(new).to_bytes(8, "little") + new + blob[8 + n :])
    rc, _, err = run(capsys, "inspect", llama)
    assert rc == 2 and "digit" in one_line_error(err)


def test_non_utf8_config_and_huge_rope_theta(llama, capsys):
    cfg = (llama / "config.json").read_text()
    (llama / "config.json").write_bytes(b"\xff\xfe" + cfg.encode())
    rc, _, err = run(capsys, "inspect", llama)
    assert rc == 2 and "UTF-8" in one_line_error(err)
    data = json.loads(cfg)
    data.setdefault("rope_parameters", {})["rope_theta"] = 10**400
    (llama / "config.json").write_text(json.dumps(data))
    rc, _, err = run(capsys, "forward", llama, "--ids", "1 2")
    assert rc == 2 and "rope_theta" in one_line_error(err)


def test_unit_name_with_a_huge_layer_number(llama, tmp_path, capsys):
    s = tmp_path / "s"
    rc, _, err = run(capsys, "shard", llama, s)
    assert rc == 0, err
    m = read_manifest_doc(s)
    huge = "layer." + "9" * 5000
    m["layout"]["stages"][0]["units"][-1] = huge
    m["ranks"][0]["units"][-1]["name"] = huge
    write_manifest_doc(s, m)
    for args in (["inspect", s], ["shard", "--check", s]):
        rc, out, err = run(capsys, *args)
        assert rc in (1, 2), out[-300:]
        assert "Traceback" not in err


def test_damaged_manifest_is_exit_1_in_forward_and_check(llama, tmp_path, capsys):
    s = tmp_path / "s"
    rc, _, err = run(capsys, "shard", llama, s)
    assert rc == 0, err
    m = read_manifest_doc(s)
    m["files"][0]["name"] = "../outside.json"
    write_manifest_doc(s, m)
    rc, _, _ = run(capsys, "shard", "--check", s)
    assert rc == 1
    rc, _, err = run(capsys, "forward", s, "--ids", "1 2")
    assert rc == 1
    one_line_error(err)

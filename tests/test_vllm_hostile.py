"""``shard --target vllm`` against hostile inputs: its stage, its index, its source.

Each case is one the security review of the vLLM target found (issue 50): the stage
next to OUT taken over through a link or a name, two writers on one OUT, a directory the
index did not bind, a source that was never validated, unbounded layouts, and a resume
that trusted size and mtime. Every refusal is one line, exit 2 for bad input and exit 1
for a damaged output, and no source file is ever touched.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file

from k3convert.checkpoint.output import OwnedStage
from k3convert.engines.rank_files import SEAL, seal
from k3convert.engines.vllm_index import check_vllm
from k3convert.engines.vllm_sharded import HASH, INDEX
from k3convert.engines.vllm_write import STAGE, write_vllm
from k3convert.errors import CheckpointError, ConfigError, OutputError
from k3convert.stream.format import StreamCorruptError
from k3convert.synth import synthesize


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("vh") / "m"
    synthesize(config="llama3-8b", out=out, tiny=True, overrides={"layers": 2})
    return out


@pytest.fixture(scope="module")
def written(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("vhw") / "o"
    write_vllm(src=llama, out=out, tp=2)
    return out


def _cli(*args, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "k3convert", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=timeout,
    )  # fmt: skip


def _snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _one_line_exit(r, code):
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr


# -- the stage ------------------------------------------------------------------------
def test_a_linked_stage_never_deletes_the_source(llama, tmp_path):
    """The review's first case: ``ln -s SRC .o.vllm-partial`` emptied SRC (exit 0)."""
    src = _copy(llama, tmp_path / "m")
    before = _snapshot(src)
    (tmp_path / f".o.{STAGE}").symlink_to(src)
    r = _cli("shard", src, tmp_path / "o", "--target", "vllm")
    _one_line_exit(r, 2)
    assert "is the source" in r.stderr or "symbolic link" in r.stderr
    assert _snapshot(src) == before and not (tmp_path / "o").exists()
    # a link to any other directory: refused, that directory untouched
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    (tmp_path / f".p.{STAGE}").symlink_to(other)
    with pytest.raises(OutputError, match="symbolic link"):
        write_vllm(src=src, out=tmp_path / "p")
    assert (other / "keep.txt").read_text() == "mine"


def test_a_source_named_like_the_stage_is_refused(llama, tmp_path):
    """Read as an unfinished output (refuse_partial), and were it read, the stage would
    be the source (guard_out): either way refused, untouched."""
    src = _copy(llama, tmp_path / f".o.{STAGE}")
    before = _snapshot(src)
    with pytest.raises((OutputError, CheckpointError), match=r"is the source|unfinished output"):
        write_vllm(src=src, out=tmp_path / "o")
    assert _snapshot(src) == before
    with pytest.raises(OutputError, match="is the source"):
        OwnedStage(tmp_path / "o", STAGE, [src]).open()
    assert _snapshot(src) == before


def test_a_foreign_directory_or_file_at_the_stage_is_never_emptied(llama, tmp_path):
    stage = tmp_path / f".o.{STAGE}"
    stage.mkdir()
    (stage / "model-rank-0-part-0.safetensors").write_bytes(b"someone else's")
    with pytest.raises(OutputError, match="not an interrupted k3convert write"):
        write_vllm(src=llama, out=tmp_path / "o")
    assert (stage / "model-rank-0-part-0.safetensors").read_bytes() == b"someone else's"
    f = tmp_path / f".q.{STAGE}"
    f.write_text("a file")
    with pytest.raises(OutputError, match="not a directory k3convert made"):
        write_vllm(src=llama, out=tmp_path / "q")
    assert f.read_text() == "a file"
    # an empty directory holds nothing to lose: taken and used
    (tmp_path / f".e.{STAGE}").mkdir()
    write_vllm(src=llama, out=tmp_path / "e")
    assert "intact" in check_vllm(tmp_path / "e")


def test_a_stage_holding_a_file_of_its_own_refuses_to_carry_it(llama, tmp_path, monkeypatch):
    """An interrupted stage (ours) into which something else was dropped: refused, not
    carried into OUT and not deleted."""
    from k3convert.engines import rank_files as vw

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(vw, "_write_rank", stop)
    with pytest.raises(KeyboardInterrupt):
        write_vllm(src=llama, out=tmp_path / "o")
    monkeypatch.undo()
    stage = tmp_path / f".o.{STAGE}"
    (stage / "notes.txt").write_text("dropped in")
    with pytest.raises(OutputError, match=r"notes\.txt: is not something k3convert writes"):
        write_vllm(src=llama, out=tmp_path / "o")
    assert (stage / "notes.txt").read_text() == "dropped in"
    (stage / "notes.txt").unlink()
    assert write_vllm(src=llama, out=tmp_path / "o").files == 1


def test_a_second_writer_of_the_same_out_is_refused(llama, tmp_path):
    """The lock is held on the stage directory for the whole write: a second writer
    (here: the stage held open by this process, as a running writer holds it) is
    refused before it writes anything, and the first one's work is untouched."""
    out = tmp_path / "o"
    held = OwnedStage(out, STAGE, [llama]).open()
    try:
        with pytest.raises(OutputError, match="is writing it right now"):
            write_vllm(src=llama, out=out)
        assert held.path.is_dir() and not out.exists()
    finally:
        held.close()
    write_vllm(src=llama, out=out)  # the lock is released with the directory's fd
    assert "intact" in check_vllm(out)


def test_two_processes_started_together_one_wins_the_other_is_refused(llama, tmp_path):
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "k3convert", "shard", str(llama), str(out), "--target",
           "vllm", "--tp", "2", "--no-progress"]  # fmt: skip
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    time.sleep(0.3)
    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [(p.wait(120), p.stderr.read()) for p in procs]
    codes = [rc for rc, _ in results]
    assert codes.count(0) == 1, results  # exactly one writes OUT
    loser = next(err for rc, err in results if rc != 0)
    assert loser.startswith("error: ") and "Traceback" not in loser, loser
    assert "intact" in check_vllm(out)


# -- the index binds the directory ------------------------------------------------
@pytest.mark.parametrize(
    "edit",
    ["rms_norm_eps", "auto_map", "tokenizer", "extra rank file", "link", "tp 0", "tp huge"],
)
def test_check_and_verify_refuse_what_the_index_does_not_bind(written, tmp_path, edit):
    out = _copy(written, tmp_path / "o")
    cfg = json.loads((out / "config.json").read_text())
    index = json.loads((out / INDEX).read_text())
    if edit == "rms_norm_eps":
        cfg["rms_norm_eps"] = 0.5
        (out / "config.json").write_text(json.dumps(cfg))
    elif edit == "auto_map":
        cfg["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
        (out / "config.json").write_text(json.dumps(cfg))
    elif edit == "tokenizer":
        with open(out / "tokenizer.json", "a") as fh:
            fh.write(" ")
    elif edit == "extra rank file":
        (out / "model-rank-0-part-1.safetensors").write_bytes(
            (out / "model-rank-0-part-0.safetensors").read_bytes()
        )
    elif edit == "link":
        (out / "tokenizer.json").unlink()
        (out / "tokenizer.json").symlink_to(written / "tokenizer.json")
    elif edit == "tp 0":  # (re-sealed: the layout's own bounds refuse it)
        bad = {**index, "layout": {"tp": 0, "pp": 1}, "files": []}
        (out / INDEX).write_text(json.dumps({**bad, SEAL: seal(bad, HASH)}))
    else:
        bad = {**index, "layout": {"tp": 10**9, "pp": 1}}
        (out / INDEX).write_text(json.dumps({**bad, SEAL: seal(bad, HASH)}))
    with pytest.raises(StreamCorruptError):
        check_vllm(out)
    t0 = time.perf_counter()
    r = _cli("shard", "--check", out)
    _one_line_exit(r, 1)
    assert time.perf_counter() - t0 < 60
    if edit == "extra rank file":
        r = _cli("verify", out, "--seq-len", "8", "--random", "1")
        assert r.returncode == 1 and "not listed" in r.stderr and "Traceback" not in r.stderr


def test_an_older_index_or_a_hostile_one_is_refused_cleanly(written, tmp_path):
    out = _copy(written, tmp_path / "o")
    index = json.loads((out / INDEX).read_text())
    for bad in ({**index, "version": 1}, {**index, "carried": None}, [1],
                {**index, "layout": {"tp": True, "pp": 1}}):  # fmt: skip
        (out / INDEX).write_text(json.dumps(bad))
        with pytest.raises(StreamCorruptError):
            check_vllm(out)
    (out / INDEX).write_text("[" * 100_000)
    r = _cli("shard", "--check", out)
    _one_line_exit(r, 1)


# -- the source is validated before a byte is written ----------------------------
def _edit_header(path, name, **changes):
    """Rewrite one tensor's header entry in place (same data region)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    head[name].update(changes)
    new = json.dumps(head, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    path.write_bytes(raw[:8] + new + raw[8 + n :])


@pytest.mark.parametrize(
    "case",
    ["head_dim", "head_dim 0", "kv heads 0", "I16", "F16 shape", "norm length", "nan", "inf"],
)
def test_a_damaged_source_is_refused_before_writing(llama, tmp_path, case):
    src = _copy(llama, tmp_path / "m")
    w = src / "model.safetensors"
    q = "model.layers.0.self_attn.q_proj.weight"
    if case.startswith(("head_dim", "kv heads")):
        # (0 is a value given, not an absent one: transformers and vLLM would take it)
        cfg = json.loads((src / "config.json").read_text())
        if case == "head_dim":
            cfg["head_dim"] = cfg.get("head_dim", 32) * 2
        elif case == "head_dim 0":
            cfg["head_dim"] = 0
        else:
            cfg["num_key_value_heads"] = 0
        (src / "config.json").write_text(json.dumps(cfg))
    elif case == "I16":
        _edit_header(w, q, dtype="I16")
    elif case == "F16 shape":
        t = load_file(w)
        shape = list(t[q].shape)
        _edit_header(w, q, dtype="F16", shape=[shape[0] // 2, shape[1]])
    elif case == "norm length":
        t = load_file(w)
        t["model.layers.0.input_layernorm.weight"] = t["model.layers.0.input_layernorm.weight"][:-2]
        save_file(t, w, metadata={"format": "pt"})
    else:
        t = load_file(w)
        t[q] = t[q].clone()
        t[q][3, 5] = float("nan") if case == "nan" else float("inf")
        save_file(t, w, metadata={"format": "pt"})
    before = _snapshot(src)
    r = _cli("shard", src, tmp_path / "o", "--target", "vllm", "--tp", "2", "--no-progress")
    _one_line_exit(r, 2)
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o*"))
    assert _snapshot(src) == before
    if case in ("nan", "inf"):
        assert q in r.stderr and "NaN or infinite" in r.stderr


@pytest.mark.parametrize(
    "name, text",
    [("tokenizer.json", "{"), ("tokenizer.json", "null"), ("tokenizer_config.json", "[" * 100_000),
     ("generation_config.json", '{"a": 1,')],
)  # fmt: skip
@pytest.mark.parametrize("target", ["vllm", "stream", "convert"])
def test_a_damaged_tokenizer_file_is_refused_not_carried(llama, tmp_path, name, text, target):
    """A file the serving engine parses at load (tokenizer, generation settings) that is
    not one JSON object is refused before anything is written, by both targets and by
    ``convert`` quantizing on the way (a key given twice is let through: the engines'
    loaders take the last)."""
    src = _copy(llama, tmp_path / "m")
    (src / "special_tokens_map.json").write_text('{"a": 1, "a": 2}')
    (src / name).write_text(text)
    before = _snapshot(src)
    if target == "convert":
        recipe = tmp_path / "r.yaml"
        recipe.write_text("version: 1\nquantize: {scheme: w8a8}\nverify: {enabled: false}\n")
        r = _cli("convert", src, tmp_path / "o", "--recipe", recipe, "--no-progress")
    else:
        r = _cli("shard", src, tmp_path / "o", "--target", target, "--no-progress")
    _one_line_exit(r, 2)
    assert name in r.stderr and "restore the release's file" in r.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o*"))
    assert _snapshot(src) == before


@pytest.mark.parametrize("flags", [["--tp", "1000000000"], ["--pp", "1000"], ["--tp", "3"]])
def test_layouts_are_bounded_before_anything_is_built(llama, tmp_path, flags):
    t0 = time.perf_counter()
    r = _cli("shard", llama, tmp_path / "o", "--target", "vllm", *flags, "--no-progress")
    _one_line_exit(r, 2)
    assert time.perf_counter() - t0 < 60 and not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".o*"))


# -- resume is keyed on the source's content -------------------------------------
def test_resume_after_a_same_size_same_mtime_swap_rewrites_from_the_new_source(
    llama, tmp_path, monkeypatch
):
    from k3convert.engines import rank_files as vw

    src = _copy(llama, tmp_path / "m")
    real, calls = vw._write_rank, []

    def stop_at_rank_1(*a, **k):
        calls.append(a[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(vw, "_write_rank", stop_at_rank_1)
    with pytest.raises(KeyboardInterrupt):
        write_vllm(src=src, out=tmp_path / "o", tp=2)
    monkeypatch.setattr(vw, "_write_rank", real)
    # another checkpoint of the same names, shapes and size, its mtime restored
    w = src / "model.safetensors"
    st = os.stat(w)
    t = load_file(w)
    t = {k: (v.flip(0).contiguous() if v.dim() == 2 else v) for k, v in t.items()}
    save_file(t, w, metadata={"format": "pt"})
    assert os.stat(w).st_size == st.st_size
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = write_vllm(src=src, out=tmp_path / "o", tp=2)
    assert res.files_resumed == 0
    fresh = tmp_path / "fresh"
    write_vllm(src=src, out=fresh, tp=2)
    for f in ("model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"):
        assert (tmp_path / "o" / f).read_bytes() == (fresh / f).read_bytes()
    # and an unchanged source still resumes
    monkeypatch.setattr(vw, "_write_rank", stop_at_rank_1)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        write_vllm(src=src, out=tmp_path / "p", tp=2)
    monkeypatch.setattr(vw, "_write_rank", real)
    assert write_vllm(src=src, out=tmp_path / "p", tp=2).files_resumed == 1


def test_written_index_lists_carried_files_and_the_source_by_content(written, llama):
    index = json.loads((written / INDEX).read_text())
    carried = {f["name"] for f in index["carried"]}
    assert carried == {p.name for p in written.iterdir()} - {INDEX} - {
        f["name"] for f in index["files"]
    }
    assert "config.json" in carried and "tokenizer.json" in carried
    names = [f[0] for f in index["source_files"]]
    assert names == ["model.safetensors", "config.json"]
    assert all(f[2].startswith("xxh3-128:") for f in index["source_files"])


def test_writer_refuses_cleanly_where_the_layout_is_unknown(llama, tmp_path):
    with pytest.raises(ConfigError, match="must be a positive integer"):
        write_vllm(src=llama, out=tmp_path / "o", tp=0)


def test_a_stage_swapped_for_a_link_after_the_lock_is_never_written_through(
    llama, tmp_path, monkeypatch
):
    """The review's race: the stage renamed away and a link to the source put at its name
    once the checks passed. Every write goes to the locked directory itself (not through
    the name), and the commit sees the swap: refused, the source untouched."""
    from k3convert.engines import rank_files as vw

    src = _copy(llama, tmp_path / "m")
    before = _snapshot(src)
    real = vw._write_ranks

    def swap_then_write(work, *a, **k):
        stage = tmp_path / f".o.{STAGE}"
        stage.rename(tmp_path / "moved")
        stage.symlink_to(src)
        return real(work, *a, **k)

    monkeypatch.setattr(vw, "_write_ranks", swap_then_write)
    with pytest.raises(OutputError, match="was replaced while k3convert held it"):
        write_vllm(src=src, out=tmp_path / "o", tp=2)
    assert _snapshot(src) == before and not (tmp_path / "o").exists()
    assert (tmp_path / "moved" / "model-rank-1-part-0.safetensors").is_file()


def test_an_out_that_appears_meanwhile_keeps_the_finished_stage(llama, tmp_path, monkeypatch):
    from k3convert.engines import rank_files as vw

    out, real = tmp_path / "o", vw._write_ranks

    def someone_makes_out(work, *a, **k):
        n = real(work, *a, **k)
        out.mkdir()
        (out / "theirs.txt").write_text("not ours")
        return n

    monkeypatch.setattr(vw, "_write_ranks", someone_makes_out)
    with pytest.raises(OutputError, match="appeared while this run wrote it"):
        write_vllm(src=llama, out=out, tp=2)
    monkeypatch.undo()
    assert (out / "theirs.txt").read_text() == "not ours"
    stage = tmp_path / f".o.{STAGE}"
    assert (stage / "model-rank-1-part-0.safetensors").is_file()
    with pytest.raises(CheckpointError, match="unfinished output"):
        check_vllm(stage)  # a stage is never taken for an output
    (out / "theirs.txt").unlink()
    out.rmdir()
    assert write_vllm(src=llama, out=out, tp=2).files_resumed == 2
    assert "intact" in check_vllm(out)

"""Hostile inputs to two readers, each refused with one line, never a traceback:

- Kimi K3's ``preprocessor_config.json`` under ``shard --target vllm`` (the input
  normalisation vLLM computes from it is written into every rank file): a zero or
  negative std, NaN, a list at the top, mismatched lengths, bad JSON, nesting 100000
  deep, a FIFO, a 2 MB file -> ConfigError (exit 2) naming the file and key, nothing
  written;
- ``forward`` on a stream whose carried config.json (or tokenizer file) was edited after
  it was written -> StreamCorruptError (exit 1) naming the file, as ``shard --check``
  reports it; ``forward``'s tokenizer files read bounded (a FIFO never blocks it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3convert.errors import CheckpointError, ConfigError, K3Error
from k3convert.runtime.forward_cmd import load_tokenizer
from k3convert.shard import shard
from k3convert.stream import open_stream
from k3convert.stream.format import StreamCorruptError
from k3convert.synth import synthesize
from tests.test_vllm_kimi_k3 import PREPROCESSOR

CLI = [sys.executable, "-m", "k3convert"]
PROC = "preprocessor_config.json"


def _write_vllm(**kw):
    from k3convert.engines.vllm_write import write_vllm

    return write_vllm(**kw)


def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


# -- 1. Kimi K3's preprocessor_config.json ---------------------------------------------
@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("k3") / "k3"
    synthesize(config="kimi-k3", out=out, tiny=True)
    return out


def _media(**edit) -> dict:
    return {**PREPROCESSOR, "media_proc_cfg": {**PREPROCESSOR["media_proc_cfg"], **edit}}


def _put(k3: Path, doc) -> Path:
    """``k3``'s processor config replaced by ``doc`` (an object, raw text, or "fifo")."""
    p = k3 / PROC
    if p.exists() or p.is_symlink():
        p.unlink()
    if doc == "fifo":
        os.mkfifo(p)
    else:
        p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


CFG = "media_proc_cfg"
POS = "must be a finite number > 0"
LIST3 = "must be a list of 3 numbers"
BAD = {
    "std 0": (_media(image_std=[0.5, 0.0, 0.5]), rf"{CFG}\.image_std\[1\] {POS}"),
    "std negative": (_media(image_std=[0.5, 0.5, -0.5]), rf"{CFG}\.image_std\[2\] {POS}"),
    "NaN": (
        '{"media_proc_cfg": {"image_mean": [NaN, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}}',
        "holds NaN, which is not JSON",
    ),
    "top-level list": ([PREPROCESSOR], "expected a JSON object, got list"),
    "lengths differ": (_media(image_mean=[0.5, 0.5]), rf"{CFG}\.image_mean {LIST3} .* 2 values"),
    "std of 4": (_media(image_std=[0.5] * 4), rf"{CFG}\.image_std {LIST3}"),
    "mean not a list": (_media(image_mean=0.5), rf"{CFG}\.image_mean {LIST3}"),
    "mean a string": (
        _media(image_mean=["0.5", 0.5, 0.5]),
        r"image_mean\[0\] must be a finite number, got str '0.5'",
    ),
    "std a bool": (_media(image_std=[True, 0.5, 0.5]), rf"image_std\[0\] {POS}, got bool True"),
    "std of 400 digits": (
        '{"media_proc_cfg": {"image_mean": [0, 0, 0], "image_std": [1, 1, 1' + "0" * 400 + "]}}",
        rf"image_std\[2\] {POS}, got int",
    ),
    "std tiny": (_media(image_std=[1e-300, 0.5, 0.5]), r"image_std is not a finite float32"),
    "std missing": (
        {CFG: {"image_mean": [0.5] * 3, "do_normalize": True}},
        rf"{CFG}\.image_std is missing",
    ),
    "nested not an object": ({CFG: [1, 2]}, f"{CFG} must be a JSON object, got list"),
    "image_processor a string": ({"image_processor": "x"}, "image_processor must be a JSON object"),
    "patch size 0": (_media(patch_size=0), rf"{CFG}\.patch_size must be a positive integer"),
    "patch size bool": (_media(patch_size=True), rf"{CFG}\.patch_size must be a positive integer"),
    "merge kernel float": (_media(merge_kernel_size=2.0), "merge_kernel_size must be a positive"),
    "do_normalize a string": (_media(do_normalize="yes"), "do_normalize must be true or false"),
    "rescale 0": (_media(rescale_factor=0), f"rescale_factor {POS}"),
    "invalid JSON": ('{"media_proc_cfg": {', "not valid JSON"),
    "duplicate key": ('{"media_proc_cfg": {}, "media_proc_cfg": {}}', "is listed twice"),
    "nested 100000 deep": ("[" * 100_000, "not valid JSON"),
    "FIFO": ("fifo", "not a regular file"),
    "2 MB": (json.dumps(PREPROCESSOR) + " " * (2 << 20), "more than the 1 MiB a processor file"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_processor_config_is_one_line_and_nothing_is_written(k3, tmp_path, case):
    doc, want = BAD[case]
    _put(k3, doc)
    out = tmp_path / "o"
    with pytest.raises(K3Error, match=want) as ei:
        _write_vllm(src=k3, out=out)
    # (a FIFO may be refused earlier, by the checkpoint reader's own aux-file check)
    assert isinstance(ei.value, CheckpointError if case == "FIFO" else ConfigError)
    msg = str(ei.value)
    assert PROC in msg and "\n" not in msg and len(msg) < 600, msg
    assert not out.exists()
    assert not any(tmp_path.iterdir())  # no stage left either


def test_a_bad_processor_config_through_the_cli(k3, tmp_path):
    _put(k3, _media(image_std=[0.5, 0.0, 0.5]))
    out = tmp_path / "o"
    r = _cli("shard", str(k3), str(out), "--target", "vllm")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert PROC in line and "media_proc_cfg.image_std[1]" in line, r.stderr
    assert not out.exists()
    _put(k3, "fifo")  # refused without blocking on it
    r = _cli("shard", str(k3), str(out), "--target", "vllm", timeout=120)
    assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not out.exists()


@pytest.mark.parametrize(
    "doc",
    [
        PREPROCESSOR,
        {"image_processor": PREPROCESSOR},  # nested one level deeper, as some releases are
        _media(merge_kernel_size=[2, 2], image_mean=[0, 0, 0], image_std=[1, 1, 1]),
        {"media_proc_cfg": {"do_normalize": False, "do_rescale": False}},  # identity
    ],
)
def test_a_good_processor_config_is_written(k3, tmp_path, doc):
    _put(k3, doc)
    res = _write_vllm(src=k3, out=tmp_path / "o")
    assert res.out.is_dir()


# -- 2. forward on a stream checks its carried files --------------------------------------
@pytest.fixture(scope="module")
def stream(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stream")
    src = root / "llama"
    synthesize(config="llama3-8b", out=src, tiny=True, overrides={"layers": 2})
    out = root / "out"
    shard(src=src, out=out)
    return out


@pytest.fixture
def copy(stream, tmp_path) -> Path:
    import shutil

    dst = tmp_path / "s"
    shutil.copytree(stream, dst)
    return dst


def _edit_eps(root: Path) -> None:
    cfg = json.loads((root / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5
    (root / "config.json").write_text(json.dumps(cfg, indent=2))


def test_forward_on_an_intact_stream_runs(copy):
    r = _cli("forward", str(copy), "--ids", "1 2 3")
    assert r.returncode == 0, r.stderr[-2000:]


def test_forward_refuses_an_edited_config(copy):
    _edit_eps(copy)
    r = _cli("forward", str(copy), "--ids", "1 2 3")
    assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "config.json" in lines[0] and "sha256 mismatch" in lines[0], r.stderr
    with pytest.raises(StreamCorruptError, match=r"config\.json does not match the manifest"):
        open_stream(copy)
    # shard --check reports it as before
    r = _cli("shard", "--check", str(copy))
    assert r.returncode == 1 and "config.json: sha256 mismatch" in r.stdout + r.stderr


def test_forward_refuses_a_config_of_the_same_size(copy):
    text = (copy / "config.json").read_text()
    assert '"rms_norm_eps": 1e-05' in text
    (copy / "config.json").write_text(
        text.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 9e-05')
    )
    with pytest.raises(StreamCorruptError, match="sha256 mismatch"):
        open_stream(copy)


@pytest.mark.parametrize("how", ["missing", "fifo", "directory"])
def test_a_config_that_is_not_the_carried_file_is_damage(copy, how):
    p = copy / "config.json"
    p.unlink()
    if how == "fifo":
        os.mkfifo(p)
    elif how == "directory":
        p.mkdir()
    with pytest.raises(StreamCorruptError, match=r"config\.json") as ei:
        open_stream(copy)
    assert "\n" not in str(ei.value)


def test_forward_refuses_an_edited_tokenizer_file(copy):
    names = [f["name"] for f in json.loads((copy / "manifest.json").read_text())["files"]]
    tok = next(n for n in names if n.startswith("tokenizer"))
    with open(copy / tok, "a") as fh:
        fh.write(" ")
    open_stream(copy)  # config.json itself is intact
    r = _cli("forward", str(copy), "--ids", "1 2 3")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert tok in r.stderr and "sha256 mismatch" in r.stderr, r.stderr


def test_forward_tokenizer_files_are_read_bounded(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")
    os.mkfifo(d / "tokenizer_config.json")  # would block transformers' open
    tok, note = load_tokenizer(d)
    assert tok is None and "is not a regular file" in note
    (d / "tokenizer_config.json").unlink()
    (d / "tokenizer_config.json").write_text("[" * 100_000)
    tok, note = load_tokenizer(d)
    assert tok is None and "not valid JSON" in note and "\n" not in note
    (d / "tokenizer_config.json").write_text('{"a": 1, "a": 2}')
    tok, note = load_tokenizer(d)
    assert tok is None and "listed twice" in note

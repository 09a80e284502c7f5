"""Every bad input reaches the user as one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3convert.cli import main

LLAMA_CFG = {
    "model_type": "llama",
    "vocab_size": 16,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def _st_bytes(entries: dict, data: bytes) -> bytes:
    raw = json.dumps(entries).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _model_dir(tmp_path: Path, st: bytes, cfg: dict | None = None) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg or LLAMA_CFG))
    (d / "model.safetensors").write_bytes(st)
    return d


def _good_entries():
    return {
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
    }


def _run(capsys, *args) -> tuple[int, str]:
    rc = main(["inspect", *map(str, args)])
    err = capsys.readouterr().err
    return rc, err


CASES = {
    "truncated file": (_good_entries(), 20, "truncated"),
    "header length past end": (None, None, "runs past the end"),
    "overlapping offsets": (
        {
            "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
        },
        24,
        "overlaps",
    ),
    "holed offsets": (
        {
            "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [20, 28]},
        },
        28,
        "hole of 4 bytes",
    ),
    "byte count mismatch": (
        {"a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 16]}},
        16,
        "byte-count mismatch",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_corrupt_safetensors(case, tmp_path, capsys):
    entries, nbytes, msg = CASES[case]
    if entries is None:
        st = struct.pack("<Q", 10_000) + b"{}"
    else:
        st = _st_bytes(entries, b"\0" * nbytes)
    d = _model_dir(tmp_path, st)
    rc, err = _run(capsys, d)
    assert rc == 2
    assert msg in err and "model.safetensors" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def _save_real(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    d = tmp_path / "real"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_CFG))
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, d / "a.safetensors")
    save_file({"model.norm.weight": torch.ones(8)}, d / "b.safetensors")
    return d


def test_index_names_missing_file(tmp_path, capsys):
    d = _save_real(tmp_path)
    (d / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.embed_tokens.weight": "a.safetensors",
                    "model.norm.weight": "gone.safetensors",
                }
            }
        )
    )
    rc, err = _run(capsys, d)
    assert rc == 2 and "gone.safetensors" in err and "does not exist" in err


def test_tensor_listed_twice(tmp_path, capsys):
    d = _save_real(tmp_path)
    shutil.copy(d / "b.safetensors", d / "c.safetensors")
    rc, err = _run(capsys, d)
    assert rc == 2 and "'model.norm.weight' is listed twice" in err


def test_unknown_model_type_and_unknown_names(tmp_path, capsys):
    d = _save_real(tmp_path)
    cfg = dict(LLAMA_CFG, model_type="gpt9000")
    (d / "config.json").write_text(json.dumps(cfg))
    rc, err = _run(capsys, d)
    assert rc == 2 and "unknown model_type 'gpt9000'" in err and "kimi_k25" in err
    (d / "config.json").write_text(json.dumps(LLAMA_CFG))
    from safetensors.torch import save_file

    save_file({"model.mystery.weight": torch.ones(3)}, d / "c.safetensors")
    rc, err = _run(capsys, d)
    assert rc == 2 and "model.mystery.weight" in err and "not part of architecture" in err


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_malicious_bin_is_refused_and_never_runs(tmp_path, capsys):
    d = tmp_path / "evil"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_CFG))
    marker = tmp_path / "pwned"
    torch.save({"model.norm.weight": torch.ones(8), "x": _Evil(str(marker))}, d / "model.bin")
    assert not marker.exists()
    rc, err = _run(capsys, d)
    assert rc == 2 and "refused" in err and "model.bin" in err
    assert not marker.exists(), "the pickle's payload ran"


def test_console_script_prints_no_traceback(tmp_path):
    d = _model_dir(tmp_path, _st_bytes(_good_entries(), b"\0" * 20))
    r = subprocess.run(
        [sys.executable, "-m", "k3convert.cli", "inspect", str(d)], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr


def test_not_a_checkpoint_and_bad_yaml(tmp_path, capsys):
    notes = tmp_path / "notes.yaml"
    notes.write_text("quantize: [\n")
    rc, err = _run(capsys, notes)
    assert rc == 2 and "not a checkpoint" in err
    rc = main(["quantize", str(tmp_path), str(tmp_path / "o"), "--recipe", str(notes)])
    err = capsys.readouterr().err
    assert rc == 2 and "notes.yaml:2:1: not valid YAML" in err and err.count("\n") == 1


def test_ctrl_c_says_how_to_resume_and_exits_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C mid-command: exit 130 and one line, on a line of its own (a progress bar may
    hold the cursor), that says what to do; no traceback."""
    import k3convert.synth

    def interrupted(*args, **kwargs):
        sys.stderr.write("convert [1/3 write]:   0%|          | 0/5")  # a bar, no newline
        raise KeyboardInterrupt

    monkeypatch.setattr(k3convert.synth, "synthesize", interrupted)
    rc = main(["synth", "llama3-8b", str(tmp_path / "m"), "--tiny"])
    err = capsys.readouterr().err
    assert rc == 130
    lines = err.splitlines()
    assert lines[-1].startswith("interrupted: ") and "rerun the same command" in lines[-1]
    assert lines[-2].endswith("0/5") and "Traceback" not in err, err


def _command(path: str):
    """The click command behind ``k3convert PATH`` (``recipe check``)."""
    import typer.main

    from k3convert.cli import app

    cmd = typer.main.get_command(app)
    for word in path.split():
        cmd = cmd.commands[word]
    return cmd


def test_every_command_has_examples_that_use_its_own_flags():
    """Each command's --help ends with examples; every flag an example uses is one of the
    command's options, so an example cannot drift from the flags it shows."""
    import shlex

    import typer.main

    from k3convert.cli import app
    from k3convert.cli_options import EXAMPLES

    group = typer.main.get_command(app)
    commands = {n for n, c in group.commands.items() if not hasattr(c, "commands")}
    commands |= {f"recipe {n}" for n in group.commands["recipe"].commands}
    assert commands == set(EXAMPLES), commands ^ set(EXAMPLES)
    for path, lines in EXAMPLES.items():
        cmd = _command(path)
        assert "Examples:" in (cmd.epilog or ""), path
        flags = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for line in lines:
            words = shlex.split(line)
            assert words[: 1 + len(path.split())] == ["k3convert", *path.split()], line
            used = {w.split("=")[0] for w in words if w.startswith("--")}
            assert used <= flags, (line, used - flags)
            if "--list-schemes" in words:  # eager: prints and exits before parsing the rest
                continue
            cmd.make_context(cmd.name, words[1 + len(path.split()) :])  # arguments, values


def test_short_help_is_one_line_and_schemes_are_one_flag_away(capsys):
    """The command list shows one line per command; quantize --list-schemes prints every
    registered scheme (its --help names the flag instead of an ellipsis)."""
    import typer.main

    from k3convert.cli import app
    from k3convert.quant.schemes import known_schemes

    for name, cmd in typer.main.get_command(app).commands.items():
        summary = (cmd.help or "").strip().split("\n\n")[0]
        assert summary and "\n" not in summary, (name, summary)  # the list's one line
    assert main(["quantize", "--list-schemes"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines()[1:]]
    assert names == known_schemes()
    scheme = next(p for p in _command("quantize").params if p.name == "scheme")
    assert "--list-schemes" in scheme.help


def test_a_folder_without_weights_points_only_at_what_is_there(tmp_path, capsys):
    """No weights and no config.json: the error does not suggest inspecting a
    config.json that does not exist; with a config.json it does."""
    d = tmp_path / "plain"
    d.mkdir()
    (d / "notes.txt").write_text("hi")
    assert main(["verify", str(d)]) == 2
    err = capsys.readouterr().err
    assert "no weights found" in err and "config.json`" not in err and "no config.json" in err
    (d / "config.json").write_text(json.dumps(LLAMA_CFG))
    assert main(["verify", str(d)]) == 2
    assert f"k3convert inspect {d / 'config.json'}" in capsys.readouterr().err


def test_help_reads_as_prose_with_named_arguments():
    """--help wraps paragraphs to the terminal (no docstring line break mid-sentence),
    names arguments in capitals and shows no '<bool>' on flags; every command that
    writes takes --no-progress."""
    from k3convert.cli import command

    root = command()
    for name in ("synth", "quantize", "shard", "verify", "convert", "demo"):
        cmd = root.commands[name]
        ctx = cmd.make_context(name, ["--help"], resilient_parsing=True)
        text = cmd.get_help(ctx)
        assert "<bool>" not in text and "{src}" not in text, (name, text[:400])
        assert "--no-progress" in text, name
    shard = root.commands["shard"]
    text = shard.get_help(shard.make_context("shard", [], resilient_parsing=True))
    assert "SRC" in text.splitlines()[0] and "OUT" in text.splitlines()[0], text.splitlines()[0]
    assert "per-rank, layer-ordered MUSA streaming\nformat" not in text

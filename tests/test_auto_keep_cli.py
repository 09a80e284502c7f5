"""``k3convert quantize --auto-keep BUDGET``: the sensitivity scan wired into quantize
(the scan and the selection themselves: tests/test_sensitivity.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from k3convert.checkpoint.reader import open_checkpoint
from k3convert.cli import main
from tests.models import QUANT_FAMILIES, save_model
from tests.test_calibrate_sequential import _ids_file

DATA = ["--num-samples", "4", "--seq-len", "16"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("autokeep")
    src = save_model("llama", root / "llama", dtype=torch.bfloat16, **QUANT_FAMILIES["llama"])
    return root, src, _ids_file(root / "ids.jsonl")


def _run(*args) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(["quantize", *map(str, args)])


def test_auto_keep_rtn_writes_report_plot_and_keeps_the_chosen(llama, capsys):
    root, src, data = llama
    out, png = root / "rtn", root / "sens.png"
    rc = _run(src, out, "--scheme", "w4a16", "--auto-keep", "10%", "--dataset", data, *DATA,
              "--plot", png)  # fmt: skip
    assert rc == 0
    cap = capsys.readouterr().out
    assert "auto-keep 10%" in cap and "sensitivity report" in cap
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads((out / "sensitivity.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    chosen = cfg["k3convert"]["auto_keep"]["names"]
    assert chosen, cfg["k3convert"]["auto_keep"]
    assert (
        cfg["k3convert"]["auto_keep"]["used_bytes"] <= cfg["k3convert"]["auto_keep"]["budget_bytes"]
    )
    assert len(rep["tensors"]) == 14  # 7 Linears x 2 layers, each scored
    q = open_checkpoint(out)
    for n in chosen:  # kept: the source's bf16 weight, bit for bit, and ignored in the config
        assert torch.equal(q.get(n), open_checkpoint(src).get(n))
        assert n.removesuffix(".weight") in cfg["quantization_config"]["ignore"]


def test_auto_keep_ladder_with_gptq(llama, capsys):
    root, src, data = llama
    out = root / "ladder"
    rc = _run(src, out, "--scheme", "w4a16", "--calibrate", "--algorithm", "gptq",
              "--dataset", data, *DATA, "--auto-keep", "4.5bpw",
              "--auto-keep-scheme", "int8-g128")  # fmt: skip
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    ak = cfg["k3convert"]["auto_keep"]
    assert ak["action"] == "int8-g128" and ak["names"] and ak["bpw"] <= 4.5 + 1e-9
    groups = cfg["quantization_config"]["config_groups"]
    assert {g["weights"]["num_bits"] for g in groups.values()} == {4, 8}
    assert cfg["k3convert"]["calibration"]["algorithm"] == "gptq"


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--auto-keep", "lots"], "budget"),
        (["--plot", "x.png"], "only apply with --auto-keep"),
        (["--auto-keep", "5%", "--auto-keep-scheme", "nope"], "nope"),
        (["--auto-keep", "5%", "--plot", "/nonexistent-k3/x.png"], "does not exist"),
    ],
)
def test_bad_auto_keep_input_exit_2_nothing_written(llama, capsys, args, msg):
    root, src, data = llama
    out = root / "bad"
    rc = _run(src, out, "--scheme", "w4a16", "--dataset", data, *DATA, *args)
    assert rc == 2
    cap = capsys.readouterr()
    assert msg in (cap.err + cap.out).lower(), cap
    assert not out.exists()


def test_recipe_calibrate_and_auto_keep_sections(llama, tmp_path, capsys):
    """Every calibration / auto-keep option is a recipe key; the CLI runs them."""
    _, src, data = llama
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "quantize:\n  scheme: w4a16-asym\n"
        f"  calibrate: {{algorithm: awq, dataset: '{data}', num_samples: 4, seq_len: 16,\n"
        "              awq_grid: 4, kv_cache: fp8}\n"
        "  auto_keep: {budget: 10%}\n"
    )
    out = tmp_path / "out"
    assert _run(src, out, "--recipe", recipe) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["k3convert"]["calibration"]["algorithm"] == "awq"
    assert cfg["k3convert"]["calibration"]["options"]["awq_grid"] == 4
    assert cfg["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    assert cfg["k3convert"]["auto_keep"]["names"]
    capsys.readouterr()
    for bad, msg in [
        ("  calibrate: {algorithm: gptqq}\n", "did you mean 'gptq'"),
        ("  calibrate: {alpha: 3}\n", "alpha must be a number in [0, 1]"),
        ("  calibrate: {num_sampels: 3}\n", "did you mean 'num_samples'"),
        ("  auto_keep: {budget: plenty}\n", "quantize.auto_keep"),
        ("  auto_keep: {budget: 5%, sensitivity: vibes}\n", "sensitivity"),
    ]:
        recipe.write_text("quantize:\n  scheme: w4a16\n" + bad)
        assert _run(src, tmp_path / "bad", "--recipe", recipe) == 2, bad
        err = capsys.readouterr().err
        assert msg.lower() in err.lower(), (bad, err)
        assert not (tmp_path / "bad").exists()


def test_shipped_recipes_load():
    from pathlib import Path

    from k3convert.recipe import load_recipe

    root = Path(__file__).resolve().parents[1] / "recipes"
    loaded = {p.name: load_recipe(p) for p in sorted(root.glob("*.yaml"))}
    awq = loaded["llama-w4a16-awq.yaml"].quantize
    assert awq.calibrate.algorithm == "awq" and awq.auto_keep.scheme == "int8-g128"


def test_recipe_auto_keep_takes_the_command_line_data(llama, tmp_path, capsys):
    """A recipe with only an auto_keep section: --dataset / --seq-len choose the scan's
    data; with a calibrate section they would be ignored, so they are refused."""
    _, src, data = llama
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quantize:\n  scheme: w4a16\n  auto_keep: {budget: 10%}\n")
    out = tmp_path / "out"
    assert _run(src, out, "--recipe", recipe, "--dataset", data, *DATA) == 0
    assert json.loads((out / "config.json").read_text())["k3convert"]["auto_keep"]["names"]
    recipe.write_text(
        "quantize:\n  scheme: w4a16\n  auto_keep: {budget: 10%}\n"
        f"  calibrate: {{algorithm: rtn, dataset: '{data}', num_samples: 4, seq_len: 16}}\n"
    )
    capsys.readouterr()
    assert _run(src, tmp_path / "o2", "--recipe", recipe, "--dataset", data) == 2
    assert "quantize.calibrate section sets" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_each_line_once_and_a_data_shortfall_said(llama, capsys):
    """The selection's summary is printed once; fewer samples than asked for (the data ran
    out) is a warning on the terminal; the throughput is a real rate, not 0.00 GB/s."""
    root, src, data = llama
    rc = _run(src, root / "once", "--scheme", "w4a16", "--auto-keep", "10%", "--dataset", data,
              "--num-samples", "4096", "--seq-len", "16")  # fmt: skip
    assert rc == 0
    cap = capsys.readouterr()
    both = cap.out + cap.err
    assert both.count("auto-keep 10%:") == 1, both
    assert "of the 4096 requested samples" in cap.err and "--num-samples" in cap.err
    summary = cap.out.strip().splitlines()[-1]
    assert summary.startswith("wrote ") and "GB/s" not in summary and summary.endswith("/s")

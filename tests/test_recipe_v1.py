"""Recipe schema version 1: round trips, the old quantize-only format, bad recipes refused
before any work (``recipe check`` and ``convert`` alike), ``--set`` overrides and paths
relative to the recipe file.

A bad recipe must end as one ``error:`` line naming the key path, exit code 2, and leave
nothing behind: ``convert`` creates neither OUT nor ``OUT.calib`` (calibration's journal)
when the recipe or its layout cannot work, even for a recipe that would calibrate.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from k3convert.cli import main
from k3convert.errors import ConfigError
from k3convert.pipeline.convert import convert
from k3convert.recipe import (
    LayoutSection,
    OutputSection,
    SourceSection,
    VerifySection,
    apply_overrides,
    dump_recipe,
    load_recipe,
    parse_recipe,
    recipe_to_dict,
)
from k3convert.synth import synthesize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PRESETS = sorted(RECIPES.glob("*.yaml"))
#: a llama whose every Linear input is 128 wide or more: FP8 128-blocks fit unsplit
WIDE = dict(hidden=128, intermediate=256, heads=4, kv_heads=2)
VOCAB = 256  # synth's tiny vocabulary


def _ids(path: Path, rows: int = 8, seq: int = 32) -> Path:
    rng = random.Random(0)
    path.write_text(
        "".join(
            json.dumps({"input_ids": [rng.randrange(3, VOCAB) for _ in range(seq)]}) + "\n"
            for _ in range(rows)
        )
    )
    return path


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _one_line_error(rc: int, err: str) -> None:
    assert rc == 2, err[:500]
    assert err.startswith("error: ") and err.count("\n") == 1, err[:1000]
    assert "Traceback" not in err and len(err) < 1000


# -- round trip ------------------------------------------------------------------------
@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_round_trips_through_dump(path):
    r = load_recipe(path)
    text = dump_recipe(r)
    back = parse_recipe(yaml.safe_load(text), str(path))
    assert back == r
    assert dump_recipe(back) == text
    assert recipe_to_dict(back) == recipe_to_dict(r)


def test_every_section_round_trips(tmp_path):
    """A recipe using every section (paths resolved, options, keeps, calibrate, auto-keep,
    thresholds) comes back equal, and its dump is stable."""
    ids = _ids(tmp_path / "ids.jsonl")
    doc = {
        "version": 1,
        "description": "all sections",
        "source": {"model_type": "llama"},
        "quantize": {
            "rules": [
                {"match": ["re:.*mlp.*"], "roles": ["dense_mlp"], "scheme": "w4a16",
                 "options": {"group_size": 32, "symmetric": False}},
                {"roles": ["attention"], "scheme": "fp8-dynamic"},
                {"match": ["*.o_proj.weight"], "scheme": "keep"},
            ],
            "keep": ["re:.*layers\\.0\\..*"],
            "default_keep": False,
            "calibrate": {"algorithm": "gptq", "dataset": "ids.jsonl", "num_samples": 8,
                          "seq_len": 32, "dampening": 0.05, "kv_cache": "fp8"},
            "auto_keep": {"budget": "5%", "scheme": "int8-g128", "sensitivity": "layer"},
        },
        "layout": {"tp": 4, "pp": 2, "moe_ep": 2, "pp_layers": [1, 1], "redundant_experts": 2},
        "output": {"compression": "zstd", "workers": 3, "unit_hash": "sha256"},
        "verify": {"data": "ids.jsonl", "samples": 3, "seq_len": 24, "decode": 1,
                   "kv_cache": "fp8", "max_kld": 0.02, "min_top1": 0.7, "dtype": "bf16"},
    }  # fmt: skip
    p = tmp_path / "all.yaml"
    p.write_text(yaml.safe_dump(doc))
    r = load_recipe(p)
    assert r.quantize.calibrate.dataset == str(ids) and r.verify.data == str(ids)
    assert r.layout.moe_tp is None and r.layout.layout().moe_tp == 2
    text = dump_recipe(r)
    back = parse_recipe(yaml.safe_load(text), str(p))
    assert back == r and dump_recipe(back) == text
    assert back.quantize.rules[0].options == {"group_size": 32, "symmetric": False}


# -- the first format --------------------------------------------------------------------
def test_quantize_only_recipe_loads_with_defaults(tmp_path):
    p = tmp_path / "old.yaml"
    p.write_text("description: int4 experts\nquantize:\n  rules:\n    - roles: [experts]\n"
                 "      scheme: w4a16\n  keep: ['re:.*layers\\.0\\..*']\n")  # fmt: skip
    r = load_recipe(p)
    assert r.version == 1 and r.description == "int4 experts"
    assert r.source == SourceSection() and r.layout == LayoutSection()
    assert r.output == OutputSection() and r.verify == VerifySection()
    assert (r.layout.tp, r.layout.pp, r.layout.moe_ep) == (1, 1, 1)
    assert (r.output.compression, r.verify.enabled, r.verify.samples) == ("none", True, 2)
    q = r.quantize
    assert q.scheme is None and q.default_keep is True and q.calibrate is None
    assert q.rules[0].scheme == "w4a16" and q.rules[0].roles == ("experts",)
    assert q.keep == ("re:.*layers\\.0\\..*",)


@pytest.mark.parametrize(
    ("key", "moved"),
    [("tp", "layout.tp"), ("pp", "layout.pp"), ("ep", "layout.moe_ep"),
     ("compress", "output.compression"), ("workers", "output.workers")],
)  # fmt: skip
def test_old_layout_keys_in_quantize_say_where_they_moved(key, moved, tmp_path, capsys):
    p = tmp_path / "old.yaml"
    p.write_text(f"description: x\nquantize:\n  scheme: w4a16\n  {key}: 8\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(p)
    assert f"'quantize.{key}' is not a quantize option" in str(e.value)
    assert f"it is '{moved}'" in str(e.value)
    rc, _, err = _run(capsys, "recipe", "check", p)
    _one_line_error(rc, err)
    assert f"'{moved}'" in err


# -- bad recipes: recipe check and convert ----------------------------------------------
CAL = "  calibrate: {algorithm: gptq, dataset: ids.jsonl, num_samples: 8, seq_len: 32}\n"

#: case -> (recipe text, model for the check: None / "tiny" / "wide", what the line says)
BAD = {
    "unknown key": (
        "quantize: {scheme: w8a8}\nlayout: {tp: 2, moe_epp: 1}\n", None,
        ["unknown key 'layout.moe_epp'", "did you mean 'moe_ep'?"],
    ),
    "wrong type": (
        'quantize: {scheme: w8a8}\nlayout: {tp: "eight"}\n', None,
        ["'layout.tp' must be an integer", "str 'eight'"],
    ),
    "impossible value": (
        "quantize: {scheme: w8a8}\nlayout: {tp: 0}\n", None, ["layout.tp must be at least 1"],
    ),
    "moe_tp * moe_ep != tp": (
        "quantize: {scheme: w8a8}\nlayout: {tp: 4, moe_tp: 2, moe_ep: 4}\n", None,
        ["layout.moe_tp * layout.moe_ep must equal layout.tp", "2 * 4 != 4"],
    ),
    "calibration file missing": (
        "quantize:\n  scheme: w8a8\n  calibrate: {algorithm: gptq, dataset: missing.jsonl}\n",
        None, ["quantize.calibrate.dataset", "missing.jsonl does not exist"],
    ),
    "expert_load calibration without calibrate": (
        "quantize: {scheme: w8a8}\nlayout: {tp: 2, expert_load: calibration}\n", None,
        ["layout.expert_load", "no quantize.calibrate section"],
    ),
    "unknown version": (
        "version: 2\nquantize: {scheme: w8a8}\n", None,
        ["'version' int 2 is not a recipe schema version", "(1)"],
    ),
    # model-dependent: the recipe is valid on its own, the model cannot take it
    "tp does not divide the heads": (
        "quantize:\n  scheme: w8a8\n" + CAL + "layout: {tp: 8}\n", "tiny",
        ["layout (tp=8 pp=1 moe_tp=8 moe_ep=1)", "4 attention heads do not divide into 8"],
    ),
    "fp8-block split cuts a 128-block": (
        "quantize:\n  scheme: fp8-block\nlayout: {tp: 4}\n", "wide",
        ["layout (tp=4 pp=1 moe_tp=4 moe_ep=1)", "mlp.", "(float-quantized, shape [",
         "would cut a quantization group/block of 128x128", "Degrees that work for this "
         "tensor: [1, 2]"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """synth's tiny llama (hidden 64, 4 heads, 2 KV heads) and a wider one."""
    root = tmp_path_factory.mktemp("recipe_v1_models")
    out = {"tiny": root / "tiny", "wide": root / "wide"}
    synthesize(config="llama3-8b", out=out["tiny"], tiny=True)
    synthesize(config="llama3-8b", out=out["wide"], tiny=True, overrides=WIDE)
    return out


def _bad(tmp_path: Path, case: str) -> tuple[Path, str | None, list[str]]:
    text, model, expect = BAD[case]
    d = tmp_path / "recipes"
    d.mkdir()
    _ids(d / "ids.jsonl")
    p = d / "bad.yaml"
    p.write_text(text)
    return p, model, expect


@pytest.mark.parametrize("case", list(BAD))
def test_bad_recipe_check_is_one_line_with_the_key_path(case, llamas, tmp_path, capsys):
    p, model, expect = _bad(tmp_path, case)
    if model is not None:  # valid alone; refused against the model
        rc, out, err = _run(capsys, "recipe", "check", p)
        assert rc == 0, err
        assert "valid (recipe version 1)" in out
        rc, _, err = _run(capsys, "recipe", "check", p, "--model", llamas[model])
    else:
        rc, _, err = _run(capsys, "recipe", "check", p)
    _one_line_error(rc, err)
    assert str(p) in err
    for s in expect:
        assert s in err, err


@pytest.mark.parametrize("case", list(BAD))
def test_bad_recipe_convert_fails_before_any_work(case, llamas, tmp_path, capsys):
    p, model, expect = _bad(tmp_path, case)
    out = tmp_path / "out"
    rc, stdout, err = _run(capsys, "convert", llamas[model or "tiny"], out, "-r", p,
                           "--no-progress")  # fmt: skip
    _one_line_error(rc, err)
    for s in expect:
        assert s in err, err
    assert not out.exists() and not (tmp_path / "out.calib").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["recipes"]
    assert stdout == ""


def test_bad_recipe_from_the_console_script(llamas, tmp_path):
    """The real entry point (a new process): the same one line, no traceback."""
    p, _, expect = _bad(tmp_path, "unknown key")
    r = subprocess.run([sys.executable, "-m", "k3convert", "recipe", "check", str(p)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    _one_line_error(r.returncode, r.stderr)
    assert all(s in r.stderr for s in expect), r.stderr


# -- --set -----------------------------------------------------------------------------
BASE = "description: x\nquantize:\n  rules:\n    - {roles: [attention], scheme: fp8-dynamic}\n"


def test_set_values_are_yaml(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(BASE + "verify: {max_kld: 0.02}\n")
    r = load_recipe(p, ["layout.tp=4", "layout.pp=2", "layout.pp_layers=[1, 1]",
                        "verify.max_kld=null", "quantize.rules[0].scheme=w8a8",
                        "quantize.keep=['re:.*lm_head']", "output.compression=zstd",
                        "verify.enabled=false", "quantize.rules[0].options={}"])  # fmt: skip
    assert r.layout.tp == 4 and isinstance(r.layout.tp, int)
    assert r.layout.pp_layers == (1, 1)
    assert r.verify.max_kld is None  # null unsets: the scheme's default applies
    assert r.quantize.rules[0].scheme == "w8a8" and r.quantize.rules[0].roles == ("attention",)
    assert r.quantize.keep == ("re:.*lm_head",)
    assert r.output.compression == "zstd" and r.verify.enabled is False
    # a new section and a new list element path are created; the file is not changed
    r = load_recipe(p, ["quantize.calibrate.dataset=default", "source.model_type=llama"])
    assert r.quantize.calibrate is not None and r.quantize.calibrate.algorithm == "gptq"
    assert r.source.model_type == "llama"
    assert "calibrate" not in p.read_text()
    # apply_overrides works on the parsed document and copies it
    doc = yaml.safe_load(p.read_text())
    new = apply_overrides(doc, ["layout.tp=2"])
    assert new["layout"] == {"tp": 2} and "layout" not in doc


@pytest.mark.parametrize(
    ("sets", "expect"),
    [
        (["layout.tq=2"], ["unknown key 'layout.tq'", "did you mean 'tp'?"]),
        (["quantize.rules[3].scheme=w8a8"], ["--set quantize.rules[3].scheme",
                                              "'quantize.rules[3]' is not an element"]),
        (["description.x=1"], ["--set description.x", "'description' is not a mapping"]),
        (["layout.tp.x=1"], ["'layout.tp' must be an integer, got dict"]),
        (["quantize.rules[x].scheme=w8a8"], ["bad index [x]"]),
        (["layout.tp"], ["expected KEY=VALUE"]),
        (["layout.tp=eight"], ["'layout.tp' must be an integer, got str 'eight'"]),
        (["layout.tp=[8]"], ["'layout.tp' must be an integer, got list"]),
        (["verify.dtype=fp64"], ["verify.dtype: 'fp64' is not one of fp32, bf16, fp16"]),
        (["quantize.rules[0].scheme=w9a9"], ["quantize.rules[0]", "w9a9"]),
        (["quantize.rules[0].options.block=[true, 128]"],
         ["'quantize.rules[0].options.block[0]' must be an integer, got bool True"]),
        (["quantize.rules[0].options.group_size=32"],
         ["unknown key 'quantize.rules[0].options.group_size'", "has no option 'group_size'"]),
        (["layout.tp={a: [}"], ["--set layout.tp: the value is not valid YAML"]),
    ],
)  # fmt: skip
def test_bad_set_names_the_key(sets, expect, tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text(BASE)
    with pytest.raises(ConfigError) as e:
        load_recipe(p, sets)
    for s in expect:
        assert s in str(e.value), str(e.value)
    rc, _, err = _run(capsys, "recipe", "check", p, *(a for s in sets for a in ("--set", s)))
    _one_line_error(rc, err)
    assert expect[0] in err


def test_set_on_a_recipe_object_in_convert_is_validated(llamas, tmp_path):
    """convert(recipe=Recipe, overrides=...) validates the result like a file's."""
    r = parse_recipe(yaml.safe_load(BASE))
    with pytest.raises(ConfigError, match=r"layout\.tp must be at least 1"):
        convert(src=llamas["tiny"], out=tmp_path / "o", recipe=r, overrides=["layout.tp=0"],
                progress=False)  # fmt: skip
    assert not (tmp_path / "o").exists()


# -- relative paths ----------------------------------------------------------------------
def test_relative_paths_resolve_against_the_recipe_directory(llamas, tmp_path, monkeypatch,
                                                             capsys):  # fmt: skip
    d = tmp_path / "proj"
    d.mkdir()
    ids = _ids(d / "ids.jsonl")
    p = d / "r.yaml"
    p.write_text(
        "quantize:\n  scheme: w8a8\n"
        "  calibrate: {algorithm: gptq, dataset: ids.jsonl, num_samples: 8, seq_len: 32}\n"
        "layout: {tp: 2}\nverify: {data: ids.jsonl, seq_len: 16, decode: 2, min_top1: 0.5}\n"
    )
    # (min_top1: the random model's next-token distributions are flat, see test_presets)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = load_recipe(p)
    assert r.quantize.calibrate.dataset == str(ids) and r.verify.data == str(ids)
    rc, out, err = _run(capsys, "recipe", "check", p)
    assert rc == 0, err
    assert f"dataset: {ids}" in out and f"data: {ids}" in out
    # a copy of the recipe without its data: refused although the cwd has a file of that
    # name (relative to the recipe, not to the working directory)
    _ids(elsewhere / "ids.jsonl")
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "r.yaml").write_text(p.read_text())
    rc, _, err = _run(capsys, "recipe", "check", lone / "r.yaml")
    _one_line_error(rc, err)
    assert "quantize.calibrate.dataset" in err and str(lone / "ids.jsonl") in err
    # end to end from the other directory: calibration and verify read proj/ids.jsonl
    res = convert(src=llamas["tiny"], out=tmp_path / "out", recipe=str(p), progress=False)
    assert res.passed is True, res.report["verify"]["failure"]
    cal = res.report["quantize"]["calibration"]
    assert cal["algorithm"] == "gptq" and str(ids) in json.dumps(cal["dataset"])
    inputs = res.report["verify"]["inputs"]
    assert inputs["kind"] == "data" and inputs["file"] == str(ids) and inputs["seq_len"] == 16
    assert not (elsewhere / "out").exists()


def test_recipe_dataclasses_are_frozen():
    r = load_recipe(RECIPES / "demo.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.layout.tp = 3  # type: ignore[misc]


def test_set_paths_are_taken_from_the_working_directory(tmp_path, monkeypatch):
    """A path given with --set is typed on the command line: it is relative to the
    working directory, while the recipe file's own paths are relative to its folder."""
    rdir, work = tmp_path / "recipes", tmp_path / "work"
    rdir.mkdir()
    work.mkdir()
    (work / "ids.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    rp = rdir / "r.yaml"
    rp.write_text("quantize:\n  scheme: w4a16\n  calibrate: {dataset: default}\n")
    monkeypatch.chdir(work)
    r = load_recipe(
        rp, ["quantize.calibrate.dataset=ids.jsonl", "quantize.calibrate.offload_dir=od"]
    )
    assert r.quantize.calibrate.dataset == str(work / "ids.jsonl")
    assert r.quantize.calibrate.offload_dir == str(work / "od")
    # a dataset name stays a name; the recipe's own relative offload_dir is its folder's
    rp.write_text("quantize:\n  scheme: w4a16\n  calibrate: {dataset: default, offload_dir: od}\n")
    r = load_recipe(rp)
    assert r.quantize.calibrate.dataset == "default"
    assert r.quantize.calibrate.offload_dir == str(rdir / "od")


@pytest.mark.parametrize("key", ["layout.pp", "layout.tp", "layout.redundant_experts"])
def test_absurd_layout_degrees_fail_at_once(tmp_path, key):
    rp = tmp_path / "r.yaml"
    rp.write_text("quantize: {scheme: fp8-dynamic}\n")
    with pytest.raises(ConfigError, match=f"{key}=100000000 is beyond any cluster"):
        load_recipe(rp, [f"{key}=100000000"])
    with pytest.raises(ConfigError, match="empty key path"):
        load_recipe(rp, [".=3"])


@pytest.mark.parametrize(
    ("calibrate", "message"),
    [
        ("{algorithm: gptq, alpha: 0.8}",
         "quantize.calibrate.alpha / quantize.calibrate.alpha_search / "
         "quantize.calibrate.sq_min_gain only apply with quantize.calibrate.algorithm "
         "smoothquant"),
        ("{algorithm: gptq, sq_min_gain: 0}",
         "quantize.calibrate.sq_min_gain only apply with quantize.calibrate.algorithm"),
        ("{algorithm: smoothquant, sq_min_gain: 1}",
         "calibration option sq_min_gain must be a number in [0, 1)"),
        ("{algorithm: smoothquant, alpha: 0.8, alpha_search: true}",
         "give quantize.calibrate.alpha or quantize.calibrate.alpha_search, not both"),
        ("{algorithm: awq, gptq_fp_target: 0.5}",
         "quantize.calibrate.gptq_fp_target only applies with quantize.calibrate.algorithm gptq"),
        ("{algorithm: gptq, awq_clip: false}",
         "quantize.calibrate.awq_clip only applies with quantize.calibrate.algorithm awq"),
        ("{algorithm: static, percentile: 99.9}",
         "quantize.calibrate.percentile only applies with quantize.calibrate.observer percentile"),
    ],
)  # fmt: skip
def test_recipe_calibrate_gets_the_flags_cross_option_checks(calibrate, message, tmp_path):
    """The checks `quantize --alpha` etc. get on the command line hold for a recipe's
    quantize.calibrate section too (they used to be the CLI's alone)."""
    rp = tmp_path / "r.yaml"
    rp.write_text(f"quantize:\n  scheme: w8a8\n  calibrate: {calibrate}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(rp)
    assert message in str(e.value) and str(rp) in str(e.value)


def test_recipe_calibrate_options_that_apply_are_accepted(tmp_path):
    rp = tmp_path / "r.yaml"
    rp.write_text(
        "quantize:\n  scheme: w8a8\n  calibrate: {algorithm: smoothquant+gptq, alpha: 0.8, "
        "gptq_fp_target: 0.5, observer: percentile, percentile: 99.9}\n"
    )
    cal = load_recipe(rp).quantize.calibrate
    assert (cal.alpha, cal.gptq_fp_target, cal.percentile) == (0.8, 0.5, 99.9)

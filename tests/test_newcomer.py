"""What a new user met in their first hour (issue 53, item 5), each held by a test: the
recipe check, the preset names, the rerun and --check messages, inspect of a preset,
the progress units, why a stream can outgrow its source, flag errors on one line, and a
--set value's error naming the --set."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from k3convert.cli import main
from k3convert.synth import synthesize

ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    c = capsys.readouterr()
    return rc, c.out, c.err


def _one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "Usage:" not in err
    return err


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nc") / "m"
    synthesize(config="llama3-8b", out=out, tiny=True, overrides={"num_hidden_layers": 2},
               progress=False)  # fmt: skip
    return out


def _recipe(tmp_path, model_type: str, roles: str) -> Path:
    p = tmp_path / f"r-{model_type}.yaml"
    p.write_text(
        f"version: 1\nsource: {{model_type: {model_type}}}\nquantize:\n  rules:\n"
        f"    - roles: {roles}\n      scheme: fp8-block\n"
    )
    return p


def test_recipe_check_refuses_an_unknown_role(tmp_path, capsys):
    """`recipe check` names a misspelled role as `convert` would, before any model is read;
    tensor kinds are those of source.model_type's architecture."""
    rc, _, err = _run(capsys, "recipe", "check", _recipe(tmp_path, "llama", "[expert]"))
    assert rc == 2 and "unknown role 'expert'. Did you mean 'experts'?" in _one_error_line(err)
    rc, out, err = _run(capsys, "recipe", "check", _recipe(tmp_path, "llama", "[experts, q_proj]"))
    assert rc == 0 and "valid" in out, err
    # q_a_proj is a kind of MLA models (DeepSeek-V3 / Kimi-K2), not of llama
    rc, _, err = _run(capsys, "recipe", "check", _recipe(tmp_path, "llama", "[q_a_proj]"))
    assert rc == 2 and "unknown role 'q_a_proj'" in err
    rc, _, err = _run(capsys, "recipe", "check", _recipe(tmp_path, "kimi_k2", "[q_a_proj]"))
    assert rc == 0, err


def test_every_preset_recipe_still_checks(capsys):
    from k3convert.recipe import presets

    for name in presets():
        rc, _, err = _run(capsys, "recipe", "check", name)
        assert rc == 0, (name, err)


def test_a_misspelled_recipe_name_gets_the_preset_and_the_list(llama, tmp_path, capsys):
    rc, _, err = _run(capsys, "convert", llama, tmp_path / "o", "--recipe", "kimi-k3-dayo")
    assert rc == 2 and "Did you mean the preset 'kimi-k3-day0'?" in _one_error_line(err)
    assert "`k3convert recipe list`" in err and not (tmp_path / "o").exists()
    rc, _, err = _run(capsys, "convert", llama, tmp_path / "o", "--recipe", "./w4a16-gptq.yaml")
    assert rc == 2 and "'w4a16-gptq'" in err  # a file that is not there: the preset hinted


def test_shard_rerun_names_the_flag_and_the_check(llama, tmp_path, capsys):
    out = tmp_path / "s"
    assert _run(capsys, "shard", llama, out, "--no-progress")[0] == 0
    rc, _, err = _run(capsys, "shard", llama, out, "--no-progress")
    assert rc == 2 and "force=True" not in _one_error_line(err)
    assert "--force replaces it" in err and f"k3convert shard --check {out}" in err
    # with the progress bar on: refused at once, so the error line alone (no empty bar)
    rc, _, err = _run(capsys, "shard", llama, out)
    assert rc == 2 and "--force replaces it" in _one_error_line(err)


def test_convert_rerun_says_it_verified_again(llama, tmp_path, capsys):
    """convert, unlike shard, reruns on its own finished OUT: it says so and why."""
    args = ["convert", llama, tmp_path / "c", "--recipe", "demo", "--set",
            "source.model_type=null", "--no-progress"]  # fmt: skip
    rc, out, err = _run(capsys, *args)
    assert rc == 0 and "already complete" not in out, err
    rc, out, err = _run(capsys, *args)
    assert rc == 0 and "OUT was already complete from this recipe and source: nothing " \
        "rewritten, verified again" in out, err  # fmt: skip


def test_inspect_takes_a_preset_as_plan_does(capsys):
    rc, out, err = _run(capsys, "inspect", "kimi-k3")
    assert rc == 0 and out.startswith("kimi-k3: kimi_k3") and "layers 93" in out, err
    assert "experts: 896 routed" in out
    rc, _, err = _run(capsys, "inspect", "kimi-k4")
    assert rc == 2 and "not a preset (kimi-k2" in _one_error_line(err)


def test_shard_check_on_a_checkpoint_says_what_it_is(llama, capsys):
    rc, out, err = _run(capsys, "shard", "--check", llama)
    assert rc == 2 and out == "" and "not_stream" not in err
    assert f"{llama}: a checkpoint, not a stream" in _one_error_line(err)
    assert f"`k3convert inspect {llama}`" in err


def test_resharding_a_stream_says_it_is_a_stream(llama, tmp_path, capsys):
    s = tmp_path / "s"
    assert _run(capsys, "shard", llama, s, "--no-progress")[0] == 0
    for verb in ("shard", "quantize"):
        extra = ["--scheme", "fp8"] if verb == "quantize" else []
        rc, _, err = _run(capsys, verb, s, tmp_path / f"again-{verb}", *extra, "--no-progress")
        assert rc == 2 and f"{s}: a k3convert stream" in _one_error_line(err), err
        assert "config.json" not in err


def test_progress_bars_count_the_units_the_summaries_print():
    """Binary units with binary labels, the count and the rate alike (tqdm's own
    scaling labels powers of 1024 'MB' and its rate in powers of 1000)."""
    from k3convert.units import byte_bar

    buf = io.StringIO()
    bar = byte_bar(total=3 * 2**20, desc="x", file=buf, mininterval=0)
    bar.update(2**20)
    bar.refresh()
    text = buf.getvalue()
    assert "1.0 MiB/3.0 MiB" in text and re.search(r"\d (?:B|KiB|MiB|GiB|TiB)/s\]", text), text
    bar.unit = "layer"  # convert's calibration stage counts layers
    bar.reset(total=4)
    bar.update(1)
    bar.refresh()
    assert "1 layer/4 layer" in buf.getvalue()
    bar.close()
    # every byte bar of the package is this one
    for f in (ROOT / "k3convert").rglob("*.py"):
        if f.name != "units.py":
            assert "unit_divisor" not in f.read_text(), f


def test_a_stream_larger_than_its_source_says_why(tmp_path, capsys):
    """tp 2 of a tiny K3 keeps the vision tower, norms and routers whole on both ranks:
    the summary says how much, and the figure is the plan's bytes less the source's."""
    from k3convert.checkpoint import open_checkpoint
    from k3convert.layout import Layout
    from k3convert.shard.plan import build_plan
    from k3convert.stream.format import nbytes_of

    k3 = tmp_path / "k3"
    synthesize(config="kimi-k3", out=k3, tiny=True, progress=False)
    ck = open_checkpoint(k3)
    plan = build_plan(ck, Layout(tp=2))
    planned = sum(nbytes_of(t.entry["dtype"], t.entry["shape"]) for u in plan.units
                  for t in u.tensors)  # fmt: skip
    source = sum(ck.meta(n).nbytes for n in ck.names())
    # the copies are the plan's bytes past the source's, less what a split leaves out:
    # Kimi K3's A_log is stored padded to 128 heads, and cut by the model's heads
    a_log = sum(ck.meta(n).nbytes for n in ck.names() if n.endswith(".A_log"))
    assert 0 <= plan.replicated_bytes() - (planned - source) < a_log
    assert plan.replicated_bytes() > 2**20
    assert build_plan(ck, Layout(tp=1)).replicated_bytes() == 0
    rc, out, err = _run(capsys, "shard", k3, tmp_path / "s", "--tp", "2", "--no-progress")
    assert rc == 0, err
    mib = plan.replicated_bytes() / 2**20
    assert f"{mib:.1f} MiB are copies held on more than one rank" in out, out


@pytest.mark.parametrize(
    "args, says",
    [
        (["shard", "m", "s", "--tpp", "2"], "No such option: --tpp"),
        (["shard"], "Missing argument 'SRC'."),
        (["shard", "m", "s", "--tp", "x"], "Invalid value for '--tp'"),
        (["frob"], "No such command 'frob'."),
    ],
)
def test_flag_errors_are_one_line(args, says, capsys):
    rc, out, err = _run(capsys, *args)
    assert rc == 2 and says in _one_error_line(err) and out == ""
    assert "--help` lists its" in err


def test_a_set_value_error_names_the_set(llama, tmp_path, capsys):
    rc, _, err = _run(capsys, "recipe", "check", "demo", "--set", "layout.tp=abc")
    assert rc == 2 and _one_error_line(err).startswith("error: --set layout.tp=abc: ")
    assert "(in recipe " in err
    rc, _, err = _run(capsys, "recipe", "check", "demo", "--set", "layout.tpp=2",
                      "--set", "layout.pp=1")  # fmt: skip
    assert rc == 2 and err.startswith("error: --set layout.tpp=2: unknown key"), err
    # the file's own error stays the file's, whatever --set adds
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nquantize: {scheme: fp8-blok}\n")
    rc, _, err = _run(capsys, "recipe", "check", bad, "--set", "layout.tp=2")
    assert rc == 2 and err.startswith(f"error: {bad}: ") and "--set" not in err, err


def test_docs_agree_on_the_vllm_venv_and_exit_codes():
    """The README and docs/serving.md give the vLLM venv's one size; the exit-code table
    says what a failed verify returns (1: tests/test_verify.py holds the CLI to it)."""
    sizes = {
        p: re.findall(r"([\d.]+) GB", (ROOT / p).read_text().split("vLLM CPU venv")[-1])[:1]
        for p in ("README.md", "docs/serving.md")
    }
    readme = re.search(r"about 5 minutes and ([\d.]+) GB", (ROOT / "README.md").read_text())
    assert readme and sizes["docs/serving.md"] == [readme.group(1)], sizes
    table = (ROOT / "docs" / "commands" / "index.md").read_text()
    row = next(ln for ln in table.splitlines() if ln.startswith("| 1 |"))
    assert "verify" in row and "damage" in row


def test_ci_runs_the_readme_test_command():
    """CI runs the README's second command verbatim (which prints the ten slowest tests)."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    test_cmd = [ln for ln in block.splitlines() if ln.startswith("pip ")][1]
    assert test_cmd.endswith("pytest -q --durations=10")
    assert test_cmd in (ROOT / ".ci" / "run").read_text()

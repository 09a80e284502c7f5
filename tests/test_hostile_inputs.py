"""Hostile inputs: each is a one-line K3Error (the CLI's ``error: ...``, exit 2, no
traceback) or bounded, never a hang, a Rust panic's traceback or a quadratic blow-up.

* a FIFO among a model's files (a weight, an index-listed weight, an aux file, the index,
  config.json, a tokenizer file) is refused by name without being opened blocking;
* ``python -m k3convert`` run inside a directory imports nothing from it;
* synth with a config listing 100k EOS ids is linear and refused early;
* a tokenizer.json the Rust ``tokenizers`` library panics on (at load or on a row, as a
  regex past its backtracking limit does) is a ConfigError naming the file;
* a chat template that loops, multiplies or grows past its bounds is a ConfigError
  naming tokenizer_config.json, in well under a second;
* the JSON input files of shard / calibrate / verify / convert are read bounded.

Anything that could block runs in a subprocess with a timeout, so a regression fails the
test instead of hanging the suite.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3convert.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "RUST_BACKTRACE": "1"}


def _k3(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "k3convert", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=ENV,
    )


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    """The CLI's failure: exit 2, no traceback, stderr one ``error:`` line."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "panicked" not in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny llama with synth's byte-level tokenizer (tokenizer.json + a chat template)."""
    from k3convert.synth import synthesize

    out = tmp_path_factory.mktemp("hostile") / "tiny"
    synthesize(config="llama3-8b", out=out, tiny=True, overrides={"layers": 2})
    return out


def _copy(tiny: Path, dst: Path) -> Path:
    shutil.copytree(tiny, dst)
    return dst


# -- 1. FIFOs ------------------------------------------------------------------------------
def test_fifo_weight_file_fails_inspect_fast(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    os.mkfifo(d / "x.safetensors")
    t0 = time.monotonic()
    line = _one_error_line(_k3("inspect", d))
    assert time.monotonic() - t0 < 60
    assert f"{d / 'x.safetensors'}: weight file is a FIFO" in line and "not a regular file" in line


_FIFO_SCRIPT = r"""
import json, os, sys
from pathlib import Path
from k3convert.checkpoint import open_checkpoint
from k3convert.errors import K3Error

tiny, base = Path(sys.argv[1]), Path(sys.argv[2])

def case(name, make, call=open_checkpoint):
    import shutil
    d = base / name
    shutil.copytree(tiny, d)
    target = make(d)
    try:
        call(target)
    except K3Error as e:
        print(name, "|", type(e).__name__, "|", e, flush=True)
    else:
        print(name, "| no error", flush=True)

def fifo(d, name):
    if (d / name).exists():
        (d / name).unlink()
    os.mkfifo(d / name)

def indexed(d):  # the index names a FIFO as the file of a tensor
    st = d / "model.safetensors"
    names = list(json.loads(st.read_bytes()[8:8 + int.from_bytes(st.read_bytes()[:8], "little")]))
    wm = {n: "model.safetensors" for n in names if n != "__metadata__"}
    wm[next(iter(wm))] = "shard-2.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    fifo(d, "shard-2.safetensors")
    return d

case("glob", lambda d: (fifo(d, "x.safetensors"), d)[1])
case("indexed", indexed)
case("aux", lambda d: (fifo(d, "notes.txt"), d)[1])
case("index", lambda d: (fifo(d, "model.safetensors.index.json"), d)[1])
case("config", lambda d: (fifo(d, "config.json"), d)[1])
case("single", lambda d: (fifo(d, "w.safetensors"), d / "w.safetensors")[1])
case("bin", lambda d: ((d / "model.safetensors").unlink(), fifo(d, "pytorch_model.bin"), d)[2])

from k3convert.calibrate.data import build_calibration_set
calib = lambda d: build_calibration_set(d, "default", num_samples=1, seq_len=8)
case("tokenizer.json", lambda d: (fifo(d, "tokenizer.json"), d)[1], calib)
case("tokenizer_config", lambda d: (fifo(d, "tokenizer_config.json"), d)[1], calib)

from k3convert.verify.inputs import load_data
case("data file", lambda d: (fifo(d, "data.jsonl"), d / "data.jsonl")[1],
     lambda p: load_data(p, seq_len=8, vocab=512, tokenizer_dir=p.parent))
text = lambda p: (p.parent / "t.txt").write_text("hello") and load_data(
    p.parent / "t.txt", seq_len=8, vocab=512, tokenizer_dir=p.parent)
case("verify tokenizer", lambda d: (fifo(d, "tokenizer.json"), d / "x")[1], text)

from k3convert.shard.plan import load_expert_load
case("expert load", lambda d: (fifo(d, "load.json"), d / "load.json")[1], load_expert_load)
from k3convert.calibrate.sensitivity_report import SensitivityReport
case("sensitivity", lambda d: (fifo(d, "sensitivity.json"), d / "sensitivity.json")[1],
     SensitivityReport.read)

# readers that skip an unreadable file: no hang, and the documented fallback
from k3convert.calibrate import sequential
from k3convert.pipeline.convert_report import read_losses
from k3convert.quant import fidelity
d = base / "skip"
d.mkdir()
os.mkfifo(d / sequential._JOURNAL)
os.mkfifo(d / fidelity.FILE)
print("journal |", sequential._read_journal(d))
print("losses |", read_losses(d))
"""


def test_fifos_are_refused_by_name_without_blocking(tiny, tmp_path):
    """Every place a model file, tokenizer file or JSON input is read: a one-line error
    naming the FIFO (or, for files that are optional, the documented fallback)."""
    script = tmp_path / "fifos.py"
    script.write_text(_FIFO_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tiny), str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=ENV)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = {ln.split(" | ")[0]: ln.split(" | ")[1:] for ln in r.stdout.splitlines()}
    fifo_in = {
        "glob": ("CheckpointError", "x.safetensors: weight file is a FIFO"),
        "indexed": ("CheckpointError", "shard-2.safetensors: weight file is a FIFO"),
        "aux": ("CheckpointError", "notes.txt: file (carried into outputs) is a FIFO"),
        "index": ("CheckpointError", "model.safetensors.index.json: index is a FIFO"),
        "config": ("CheckpointError", "config.json: config is a FIFO"),
        "single": ("CheckpointError", "w.safetensors: checkpoint file is a FIFO"),
        "bin": ("CheckpointError", "pytorch_model.bin: weight file is a FIFO"),
        "tokenizer.json": ("CalibrationDataError", "tokenizer.json: is not a regular file"),
        "tokenizer_config": ("CalibrationDataError", "tokenizer_config.json: is not a regular"),
        "data file": ("ConfigError", "data.jsonl: not a regular file"),
        "verify tokenizer": ("ConfigError", "tokenizer.json: is not a regular file"),
        "expert load": ("ConfigError", "load.json: is not a regular file"),
        "sensitivity": ("ConfigError", "sensitivity.json: is not a regular file"),
    }
    for name, (cls, text) in fifo_in.items():
        assert name in got, (name, r.stdout, r.stderr[-2000:])
        assert got[name][0] == cls and text in got[name][1], (name, got[name])
        assert "\n" not in got[name][1]
    assert got["journal"] == ["None"] and got["losses"] == ["None"]


# -- 2. the working directory is not on sys.path -----------------------------------------
def test_python_m_imports_nothing_from_the_working_directory(tmp_path):
    marker = tmp_path / "IMPORTED"
    for mod in ("xxhash", "typer", "torch", "yaml", "safetensors"):
        (tmp_path / f"{mod}.py").write_text(f"open({str(marker)!r}, 'a').write('{mod} ')\n")
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}  # the installed package
    r = subprocess.run([sys.executable, "-m", "k3convert", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Usage" in r.stdout
    assert not marker.exists(), marker.read_text()


# -- 3. synth with a huge EOS list --------------------------------------------------------
def test_synth_refuses_a_huge_eos_list_early(tmp_path):
    from k3convert.synth import preset_config, synthesize

    cfg = preset_config("llama3-8b")
    cfg["eos_token_id"] = list(range(100_000))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"config\.json: eos_token_id lists 100000 ids, more "
                       r"than the 1024"):  # fmt: skip
        synthesize(config=str(tmp_path / "config.json"), out=tmp_path / "o", tiny=True,
                   overrides={"layers": 2, "vocab": 200_000})  # fmt: skip
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "o").exists()  # refused before a weight was written
    line = _one_error_line(_k3("synth", tmp_path / "config.json", tmp_path / "o2", "--tiny"))
    assert "eos_token_id lists 100000 ids" in line


def test_synth_special_tokens_are_linear(monkeypatch):
    """Before: the second pass over the ids (text section = config for flat configs)
    tested each id against a list - 100k ids took 31 s. Now a set: well under a second."""
    from k3convert import synth_tokenizer as st

    monkeypatch.setattr(st, "MAX_SPECIAL_IDS", 10**6)
    cfg = {"eos_token_id": list(range(1000, 101_000))}
    t0 = time.monotonic()
    by_id, roles = st.special_tokens(cfg, cfg, 200_000)
    assert time.monotonic() - t0 < 2
    assert len(by_id) == 100_001 and by_id[1000] == "<|eos|>" and by_id[1001] == "<|eos_1|>"
    assert roles == {"eos": "<|eos|>", "bos": "<|bos|>"} and by_id[199_999] == "<|bos|>"
    # ids a list repeats, and ids in both sections, are one token each
    t = {"eos_token_id": [5, 6, 5]}
    by_id, _ = st.special_tokens({"text_config": t, "eos_token_id": [6, 7]}, t, 512)
    assert [by_id[i] for i in (5, 6, 7)] == ["<|eos|>", "<|eos_1|>", "<|eos_2|>"]


def test_synth_keeps_a_list_at_the_cap(tmp_path):
    from k3convert import synth_tokenizer as st

    cfg = {"eos_token_id": list(range(300, 300 + st.MAX_SPECIAL_IDS))}
    files = st.tokenizer_files(cfg, cfg, 4096)
    added = json.loads(files["tokenizer.json"])["added_tokens"]
    assert len(added) == st.MAX_SPECIAL_IDS + 1  # the EOS ids and a BOS at the top id


# -- 4. tokenizer.json the tokenizers library panics on -----------------------------------
def _tokenizer(d: Path, **changes) -> Path:
    f = d / "tokenizer.json"
    tok = json.loads(f.read_text(encoding="utf-8"))
    tok.update(changes)
    f.write_text(json.dumps(tok), encoding="utf-8")
    return d


def _catastrophic_split(d: Path) -> Path:
    """A Split pre-tokenizer whose regex backtracks exponentially: Oniguruma gives up at
    its retry limit, and tokenizers panics (on the rows that trigger it only)."""
    tok = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    split = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated",
             "invert": False}  # fmt: skip
    seq = {"type": "Sequence", "pretokenizers": [split, tok["pre_tokenizer"]]}
    return _tokenizer(d, pre_tokenizer=seq)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAA"}},  # at load
        {"normalizer": {"type": "Replace", "pattern": {"Regex": ""}, "content": "x"}},  # any text
    ],
    ids=["panics-loading", "panics-on-any-text"],
)
def test_tokenizer_panic_is_a_config_error(tiny, tmp_path, capfd, change):
    from k3convert.calibrate.data import build_calibration_set

    d = _tokenizer(_copy(tiny, tmp_path / "m"), **change)
    with pytest.raises(ConfigError) as e:
        build_calibration_set(d, "default", num_samples=1, seq_len=8)
    msg = str(e.value)
    assert (
        msg.startswith(f"{d / 'tokenizer.json'}: the tokenizers library crashed")
        and "\n" not in msg
    )
    assert "panicked" not in capfd.readouterr().err  # Rust's own report is held back


def test_tokenizer_panic_on_a_row_names_the_row(tiny, tmp_path):
    from k3convert.calibrate.data import build_calibration_set
    from k3convert.verify.inputs import load_data

    d = _catastrophic_split(_copy(tiny, tmp_path / "m"))
    rows = _jsonl(tmp_path / "r.jsonl", [{"text": "fine"}, {"text": "a" * 40 + "c"}])
    with pytest.raises(ConfigError, match=r"r\.jsonl: row 1, column 'text': the tokenizer of "
                       r".* crashed on this row \(tokenizers panic: .*retry-limit"):  # fmt: skip
        build_calibration_set(d, rows, num_samples=1, seq_len=64, shuffle=False)
    with pytest.raises(ConfigError, match=r"r\.jsonl line 2: the tokenizer of .* crashed"):
        load_data(rows, seq_len=8, vocab=512, tokenizer_dir=d)


def test_cli_tokenizer_panic_is_one_line(tiny, tmp_path):
    d = _tokenizer(
        _copy(tiny, tmp_path / "m"),
        normalizer={"type": "Replace", "pattern": {"Regex": ""}, "content": "x"},
    )
    r = _k3("quantize", d, tmp_path / "o", "--scheme", "w4a16", "--calibrate",
            "--num-samples", "2", "--seq-len", "16")  # fmt: skip
    assert "tokenizer.json: the tokenizers library crashed" in _one_error_line(r)


def test_tokenizer_files_are_size_capped(tiny, tmp_path):
    from k3convert.calibrate.data import build_calibration_set
    from k3convert.checkpoint.bounded import LIMITS

    d = _copy(tiny, tmp_path / "m")
    os.truncate(d / "tokenizer.json", LIMITS["tokenizer"] + 1)  # sparse: no bytes written
    with pytest.raises(ConfigError, match=r"tokenizer\.json: 64\.0 MiB, more than the 64 MiB"):
        build_calibration_set(d, "default", num_samples=1, seq_len=8)


# -- 5. chat templates --------------------------------------------------------------------
CHATS = [
    [{"role": "user", "content": "the keeper climbed the tower"},
     {"role": "assistant", "content": "and trimmed the lamp", "name": None}],
    [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hi", "reasoning_content": "greet"}],
]  # fmt: skip


def _with_template(tiny: Path, d: Path, template: str) -> Path:
    _copy(tiny, d)
    f = d / "tokenizer_config.json"
    cfg = json.loads(f.read_text())
    cfg["chat_template"] = template
    f.write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "template, why",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
         "asks for range() of 100,000 numbers (at most 10,000)"),
        ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
         "runs more than 1,000,000 loop iterations"),
        ("{% set s = 'ab' * 5000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
         "runs more than 1,000,000 loop iterations"),
        ("{{ 'x' * 1000000000 }}", "builds a value of more than"),
        ("{% set a = 'x' * 9000000 %}{% set b = a ~ a %}{% set c = b ~ b %}{{ c }}",
         "builds a value of more than"),
        ("{% set a = 'x' * 1000 %}{{ a|replace('x', a)|replace('x', a) }}",
         "builds a string of more than"),
        ("{% set a = 'x' * 9000000 %}{{ [a, a, a]|join }}", "builds a string of more than"),
        ("{{ 'x'|center(1000000000) }}", "passes filter 'center' a number too large"),
        ("{{ '%01000000000d' % 1 }}", "formats with a width or precision that is too large"),
        ("{{ '{:{}}'.format(1, 1000000000) }}", "passes format() a number too large"),
        ("{{ 7 ** 1000000000 }}", "computes a number of more than 65,536 bits"),
    ],
    ids=["issue-nested-100k", "nested-10k", "loop-over-string", "str-times", "concat-doubling",
         "replace-blowup", "join-refs", "center", "percent-width", "format-width", "pow"],
)  # fmt: skip
def test_chat_template_bounds(tiny, tmp_path, template, why):
    from k3convert.calibrate.data import build_calibration_set

    d = _with_template(tiny, tmp_path / "m", template)
    rows = _jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        build_calibration_set(d, rows, num_samples=2, seq_len=16, packing=False, min_len=1)
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert f"the chat template of {d / 'tokenizer_config.json'} {why}" in msg, msg
    assert "\n" not in msg and "give the data as a 'text' column" in msg


def test_chat_template_errors_name_the_row(tiny, tmp_path):
    from k3convert.calibrate.data import build_calibration_set

    cases = {
        "{{ raise_exception('roles must alternate') }}": "(TemplateError: roles must alternate)",
        "{{ ''.__class__.__mro__ }}": "(SecurityError: access to attribute '__class__'",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}": "(RecursionError:",
    }
    rows = _jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    for i, (template, why) in enumerate(cases.items()):
        d = _with_template(tiny, tmp_path / f"m{i}", template)
        with pytest.raises(ConfigError) as e:
            build_calibration_set(d, rows, num_samples=2, seq_len=16, packing=False,
                                  min_len=1, shuffle=False)  # fmt: skip
        assert str(e.value).startswith(
            f"{rows}: row 0, column 'messages': the chat template "
            f"of {d / 'tokenizer_config.json'} failed on this row"
        )
        assert why in str(e.value)
    d = _with_template(tiny, tmp_path / "syntax", "{% for %}")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: the chat template does not "
                       r"compile \(TemplateSyntaxError"):  # fmt: skip
        build_calibration_set(d, rows, num_samples=2, seq_len=16, packing=False, min_len=1)


RICH_TEMPLATE = """
{{- bos_token }}
{%- set ns = namespace(system='', n=0) %}
{%- for m in messages if m.role == 'system' %}{% set ns.system = m.content | trim %}{% endfor %}
{%- if ns.system %}<|system|>{{ ns.system }}{{ eos_token }}
{% endif %}
{%- for message in messages | rejectattr('role', 'equalto', 'system') %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('x') }}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    <|{{ message.role }}|>{{ loop.index }}/{{ loop.length }}{% if loop.last %}L{% endif %}
    {%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
    {%- if message.reasoning_content is defined %}[{{ message.thinking }}]{% endif %}
    {%- else %}{{ message.content }}{% endif %}
    {%- if message.name is defined %}NAME{% endif %}
{{ eos_token }}
{% endfor %}
{{- '%03d|%s' % (ns.n, 'x') }}{{ '{:>5}'.format('ab') }}{{ dict(a=1) | tojson }}
{%- for k, v in {'b': 2, 'a': 1} | dictsort %}{{ k }}={{ v }}{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}
"""  # noqa: E501


def test_bounded_rendering_matches_transformers(tiny, tmp_path):
    """The bounded sandbox renders as transformers' apply_chat_template does (its jinja
    settings, globals, filters, None keys dropped, reasoning aliases)."""
    from transformers import AutoTokenizer

    from k3convert.calibrate.data import build_calibration_set

    d = _with_template(tiny, tmp_path / "m", RICH_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(d)
    rows = _jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    cs = build_calibration_set(d, rows, num_samples=2, seq_len=256, packing=False, min_len=1,
                               shuffle=False)  # fmt: skip
    for i, chat in enumerate(CHATS):
        rendered = tok.apply_chat_template(copy.deepcopy(chat), tokenize=False)
        assert "NAME" not in rendered and "<|user|>1/" in rendered
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        assert cs.input_ids[i, : len(ids)].tolist() == ids
        assert int(cs.attention_mask[i].sum()) == len(ids)


# -- 6. bounded JSON inputs ---------------------------------------------------------------
def test_json_inputs_are_strict_and_capped(tmp_path):
    from k3convert.calibrate.sensitivity_report import SensitivityReport
    from k3convert.checkpoint.bounded import LIMITS
    from k3convert.shard.plan import load_expert_load
    from k3convert.verify.inputs import load_data

    dup = tmp_path / "dup.json"
    dup.write_text('{"0": [1, 2], "0": [3, 4]}')
    with pytest.raises(ConfigError, match=r"dup\.json: key '0' is listed twice"):
        load_expert_load(dup)
    big = tmp_path / "big.json"
    big.touch()
    os.truncate(big, LIMITS["report"] + 1)
    with pytest.raises(ConfigError, match=r"big\.json: 64\.0 MiB, more than the 64 MiB a report"):
        load_expert_load(big)
    with pytest.raises(ConfigError, match=r"big\.json: 64\.0 MiB"):
        SensitivityReport.read(big)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"deep\.json: not valid JSON \(nested too deeply"):
        SensitivityReport.read(deep)
    assert load_expert_load({"0": [1, 2]}) == {0: [1.0, 2.0]}
    rows = tmp_path / "d.jsonl"
    rows.write_text('{"input_ids": [1, 2]}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl line 2: not valid JSON \(nested too deeply"):
        load_data(rows, seq_len=8, vocab=512, max_samples=4)


def test_convert_losses_and_sidecar_fall_back(tmp_path):
    from k3convert.errors import OutputError
    from k3convert.pipeline import convert
    from k3convert.pipeline.convert_report import read_losses
    from k3convert.quant import fidelity

    (tmp_path / fidelity.FILE).write_text('{"a": 1, "a": 2}')
    assert read_losses(tmp_path) is None  # not readable as a loss report
    (tmp_path / convert.MANIFEST).write_text("{}")
    (tmp_path / convert.SIDECAR).write_text('{"identity": 1, "identity": 2}')
    with pytest.raises(OutputError, match="already holds a complete stream"):
        convert._check_out_early(tmp_path, False, None, None)


@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAA"}},  # at load
        {"normalizer": {"type": "Replace", "pattern": {"Regex": ""}, "content": "x"}},  # any text
    ],
    ids=["panics-loading", "panics-on-any-text"],
)
def test_forward_with_a_panicking_tokenizer_prints_ids(tiny, tmp_path, change):
    """forward never hides the logits behind a broken tokenizer: a Rust panic (a
    BaseException) becomes the usual note, exit 0, no traceback or panic report."""
    d = _tokenizer(_copy(tiny, tmp_path / "m"), **change)
    r = _k3("forward", d, "--ids", "1 2 3")
    assert r.returncode == 0, r.stderr
    assert "tokenizer: not loaded" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "panicked" not in r.stderr


def test_release_with_an_overflowing_scale_is_refused_by_every_scheme(tmp_path):
    """An MXFP4 expert whose E8M0 code 254 puts a value past float32's range (damaged in
    transit) is refused the same way whatever the target scheme: exit 2, one line naming
    the tensor, nothing written (issue 51: nvfp4 / fp8-block used to write it)."""
    from k3convert.synth import synthesize
    from tests.models import edit_tensors

    src = tmp_path / "k3"
    synthesize(config="kimi-k3", out=src, tiny=True, seed=5)
    name = "language_model.model.layers.2.block_sparse_moe.experts.1.w1.weight"

    def damage(sd) -> bool:
        if f"{name}_scale" not in sd:
            return False
        sd[f"{name}_scale"][0, 0] = 254
        sd[f"{name}_packed"][0, :16] = 0x77  # 6 * 2**127: +-inf in float32
        return True

    edit_tensors(src, damage)
    for scheme in ("nvfp4a16", "fp8-block", "int4-g32"):
        out = tmp_path / f"o-{scheme}"
        line = _one_error_line(_k3("quantize", src, out, "--scheme", scheme, "--no-progress",
                                   "--keep", r"re:^(?!.*\.experts\.\d+\.).*"))  # fmt: skip
        assert "experts.1.w1.weight" in line and "NaN/Inf" in line, (scheme, line)
        assert not out.exists(), scheme

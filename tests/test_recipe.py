"""Recipe files: bounded, strict YAML reading; typed values; one-line errors from the CLI.

A recipe is user input read before anything runs, so a hostile or broken one must cost
milliseconds and end as one short ``error:`` line with exit code 2: alias bombs are
refused before anything is expanded, values are quoted as type + short prefix, duplicate
keys, bools given for integers, non-UTF-8 bytes and absurd nesting are clear errors.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from k3convert.cli import main
from k3convert.errors import ConfigError
from k3convert.recipe import load_recipe


def _bomb(levels: int, under: str = "description") -> str:
    """Billion laughs: level i is a list of 9 aliases of level i-1 (9**levels leaves)."""
    lines = [f"{under}:", "  - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\nquantize: {scheme: fp8-dynamic}\n"


def _merge_bomb(levels: int) -> str:
    """Merge keys doubling a mapping per level (flattening copies the pairs)."""
    lines = ["description: x", "m0: &m0 {k0: 1}"]
    for i in range(1, levels):
        lines.append(f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}], k{i}: 1}}")
    return "\n".join(lines) + "\nquantize: {scheme: fp8-dynamic}\n"


RULE = "quantize:\n  rules:\n    - scheme: w4a16\n      options: {{{}}}\n"

#: case -> (recipe text or bytes, what the one-line error must say)
BAD = {
    "alias bomb": (_bomb(7), "alias bomb"),
    "alias bomb in a rule": (_bomb(8, under="x").replace("x:", "quantize:\n  keep:"), "alias"),
    "merge-key bomb": (_merge_bomb(18), "YAML nodes"),
    "recursive alias": ("description: &a [x, *a]\nquantize: {scheme: w4a16}\n", "recursive"),
    "duplicate key": ("quantize:\n  scheme: w4a16\n  scheme: fp8\n", ":3: duplicate key 'scheme'"),
    "duplicate key, one line": ("quantize: {scheme: w4a16, scheme: fp8}\n", "duplicate key"),
    "duplicate rule key": (
        "quantize:\n  rules:\n    - scheme: w4a16\n      roles: [experts]\n      scheme: fp8\n",
        ":5: duplicate key 'scheme' (first at line 3)",
    ),
    "group_size true": (
        RULE.format("group_size: true"),
        "'quantize.rules[0].options.group_size' must be an integer, got bool True",
    ),
    "num_bits false": (RULE.format("num_bits: false"), "options.num_bits' must be an integer"),
    "symmetric string": (RULE.format("symmetric: 'no'"), "options.symmetric' must be true or"),
    "block of bools": (
        "quantize:\n  rules:\n    - scheme: fp8-block\n      options: {block: [true, 128]}\n",
        "'quantize.rules[0].options.block[0]' must be an integer, got bool True",
    ),
    "option key not a string": (RULE.format("1: 2"), "has no option"),
    "option value a bomb": (
        _bomb(7).replace("quantize: {scheme: fp8-dynamic}", RULE.format("group_size: *l6")),
        "alias bomb",
    ),
    "non-UTF-8": ("description: caf\xe9\nquantize: {scheme: w4a16}\n".encode("latin-1"), "UTF-8"),
    "UTF-16": ("quantize: {scheme: w4a16}\n".encode("utf-16"), "not UTF-8"),
    "5000-deep lists": ("description: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than"),
    "5000-deep mappings": ("description: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n", "nested"),
    "larger than 1 MiB": ("description: x\n" + "# pad\n" * 200_000, "larger than 1024 KiB"),
    "list as description": (
        f"description: ['{'y' * 100_000}']\nquantize: {{scheme: w4a16}}\n",
        "'description' must be a string, got list ['yyy",
    ),
    "huge scheme name": ("quantize:\n  scheme: " + "w" * 100_000 + "\n", "unknown quantization"),
    "huge bad regex": (
        "quantize: {scheme: w4a16, keep: ['re:((" + "a" * 100_000 + "']}\n",
        "regex",
    ),
    "huge key": ("quantize:\n  ? " + "k" * 100_000 + "\n  : 1\n", "unknown key 'quantize.kkk"),
    "integer of 5000 digits": ("quantize: {scheme: w4a16, default_keep: " + "9" * 5000 + "}\n", ""),
    "NUL character": ("quantize: {scheme: w4a16}\x00\n", "not valid YAML"),
    "python tag": ("quantize: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
    "two documents": ("quantize: {scheme: w4a16}\n---\nquantize: {scheme: fp8}\n", "document"),
}


def _write(tmp_path, content, name="r.yaml"):
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return p


@pytest.mark.parametrize("case", list(BAD))
def test_bad_recipe_is_one_short_line_from_the_cli(case, model_factory, tmp_path, capsys):
    text, expect = BAD[case]
    recipe = _write(tmp_path, text)
    src = model_factory("llama")
    out = tmp_path / "out"
    t0 = time.perf_counter()
    rc = main(["quantize", str(src), str(out), "--recipe", str(recipe), "--dry-run"])
    seconds = time.perf_counter() - t0
    captured = capsys.readouterr()
    err = captured.err
    assert rc == 2, err[:500]
    assert err.startswith("error: ") and err.endswith("\n"), err[:500]
    assert err.count("\n") == 1 and len(err) < 500, f"{len(err)} chars: {err[:500]}"
    assert "Traceback" not in err and len(captured.out) < 500
    assert expect in err, err
    assert str(recipe) in err  # names the file (and, where it can, the line)
    assert seconds < 10, f"{seconds:.1f} s"  # milliseconds, but the machine is shared
    assert not out.exists()


def test_duplicate_key_names_key_and_both_lines(tmp_path):
    p = _write(tmp_path, "description: a\nquantize:\n  scheme: w4a16\n  keep: [x]\n  scheme: fp8\n")
    with pytest.raises(ConfigError, match=r"r\.yaml:5: duplicate key 'scheme' \(first at line 3\)"):
        load_recipe(p)


def test_bool_is_not_an_integer_anywhere(tmp_path):
    from k3convert.quant import get_scheme

    with pytest.raises(ConfigError, match=r"group_size must be a positive integer, got bool"):
        get_scheme("w4a16", group_size=True)
    with pytest.raises(ConfigError, match=r"block must be two positive ints"):
        get_scheme("fp8-block", block=(True, 128))
    with pytest.raises(ConfigError, match=r"symmetric must be true or false"):
        get_scheme("w4a16", symmetric="false")  # a truthy string is not False


def test_error_quotes_type_and_a_short_prefix(tmp_path):
    p = _write(tmp_path, "description:\n  - " + "z" * 10_000 + "\nquantize: {scheme: w4a16}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert "must be a string, got list ['zzz" in msg and len(msg) < 200, msg


def test_aliases_merge_keys_and_anchors_still_work(tmp_path):
    """Ordinary YAML features stay: a few aliases, and merge keys whose explicit key
    overrides a merged one (not a duplicate)."""
    p = _write(
        tmp_path,
        textwrap.dedent(
            """\
            description: &d shared options
            quantize:
              rules:
                - &int4 {roles: [experts], scheme: w4a16, options: &g32 {group_size: 32}}
                - {<<: *int4, roles: [shared], options: {<<: *g32, group_size: 64}}
                - {roles: [attention], scheme: fp8-block}
              keep: [*d]
            """
        ),
    )
    r = load_recipe(p)
    assert [x.options for x in r.quantize.rules] == [{"group_size": 32}, {"group_size": 64}, {}]
    assert r.quantize.rules[1].scheme == "w4a16" and r.quantize.rules[1].roles == ("shared",)
    assert r.quantize.keep == ("shared options",)


BOMB_SCRIPT = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # 1 GiB: the old code hit 12.5 GB
from k3convert.errors import ConfigError
from k3convert.recipe import load_recipe
t0 = time.perf_counter()
try:
    load_recipe(sys.argv[1])
except ConfigError as e:
    print(len(str(e)), round(time.perf_counter() - t0, 3), str(e)[:300])
    sys.exit(3)
sys.exit(0)
"""


def test_billion_laughs_is_refused_before_expansion(tmp_path):
    """9**10 leaves (a 2 GB repr): refused in milliseconds. Bounded (1 GiB address space,
    20 s) so the unfixed reader fails this test instead of taking the machine down."""
    p = _write(tmp_path, _bomb(10))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", BOMB_SCRIPT, str(p)],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("reading the alias bomb ran past 20 s")
    wall = time.perf_counter() - t0
    assert proc.returncode == 3, (proc.returncode, proc.stdout[:300], proc.stderr[-300:])
    length, seconds, msg = proc.stdout.split(" ", 2)
    assert int(length) < 500 and "alias bomb" in msg
    assert float(seconds) < 1.0, f"refusing took {seconds} s"
    print(f"alias bomb refused in {seconds} s (subprocess {wall:.2f} s)")

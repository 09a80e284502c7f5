"""The documentation builds (``mkdocs build --strict``: a broken link, a page missing
from the nav, an unknown anchor fails) and the README's walkthrough runs as written
(its shell block, command by command, on the paths it names moved under a temp dir)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra")
def test_docs_site_builds_strict(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "glossary" / "index.html").is_file()
    assert (tmp_path / "site" / "stream-format" / "index.html").is_file()


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


TASK_PAGES = sorted((ROOT / "docs" / "tasks").glob("*.md"))


def _commands(text: str) -> list[str]:
    """The commands of a text's bash blocks (the install block aside: the suite runs in
    the installed tree), one per line, comments cut."""
    blocks = [b for b in _shell_blocks(text) if "pip " not in b]
    lines = [ln.split("  #")[0].strip() for b in blocks for ln in b.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _run_all(commands: list[str], tmp_path: Path) -> None:
    """Each command in order, /tmp/ moved under tmp_path; each must exit 0."""
    for cmd in commands:
        argv = shlex.split(cmd.replace("/tmp/", f"{tmp_path}/"))
        if argv[0] == "k3convert":
            argv = [sys.executable, "-m", "k3convert", *argv[1:]]
        elif argv[0] == "torchrun":  # the same interpreter's torchrun
            argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])


def test_readme_walkthrough_runs_as_written(tmp_path):
    """Every k3convert command of the README's shell blocks exits 0."""
    commands = _commands((ROOT / "README.md").read_text())
    assert len(commands) >= 5 and all(c.startswith("k3convert ") for c in commands), commands
    _run_all(commands, tmp_path)


def test_task_pages_are_in_the_site():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert len(TASK_PAGES) >= 5
    for page in TASK_PAGES:
        assert f"tasks/{page.name}" in nav, page.name
        assert _commands(page.read_text()), f"{page.name} has no bash block to run"


@pytest.mark.parametrize("page", TASK_PAGES, ids=lambda p: p.stem)
def test_task_page_runs_as_written(page, tmp_path):
    """Every command of a task page's bash blocks exits 0, in order, on the tiny models
    the page builds (its console blocks, for the full-size release, are parsed below)."""
    commands = _commands(page.read_text())
    assert all(c.split()[0] in ("k3convert", "torchrun") for c in commands), commands
    _run_all(commands, tmp_path)


def _documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every ``k3convert`` command in any code block of the README
    and docs/, ``$ `` prompts and comments cut."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```(?:bash|console|sh)\n(.*?)```", page.read_text(), re.S):
            for ln in block.splitlines():
                ln = ln.split("  #")[0].strip().removeprefix("$ ")
                if ln.startswith("k3convert ") and "<" not in ln and "..." not in ln:
                    out.append((page.name, ln))
    return out


def test_every_documented_command_parses():
    """Every k3convert command in the docs' code blocks (those for the full-size release
    too) names a real command and real flags, with the arguments it takes."""
    import typer.main

    from k3convert.cli import app

    group = typer.main.get_command(app)
    found = _documented_commands()
    assert len(found) >= 30, len(found)
    for page, line in found:
        words = shlex.split(line)[1:]
        cmd, rest = group, words
        while hasattr(cmd, "commands") and rest and rest[0] in cmd.commands:
            cmd, rest = cmd.commands[rest[0]], rest[1:]
        assert not hasattr(cmd, "commands"), (page, line)
        if "--help" in rest or "--list-schemes" in rest:
            continue
        try:
            cmd.make_context(cmd.name, list(rest))
        except Exception as e:  # click's usage errors
            raise AssertionError(f"{page}: {line!r}: {e}") from e


def test_plots_need_only_the_readme_install():
    """`--plot` (plan, verify, sensitivity) is on task pages that run as written after the
    README's first install (`pip install -e .`, no extra): matplotlib is a dependency of
    the package itself, not of the test extra."""
    from importlib.metadata import requires

    reqs = requires("k3convert") or []
    core = [r for r in reqs if "extra ==" not in r]
    assert any(r.startswith("matplotlib") for r in core), core
    pages = [p for p in [ROOT / "README.md", *TASK_PAGES] if "--plot" in p.read_text()]
    assert pages  # the page the newcomer ran: plan-layout

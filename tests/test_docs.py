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


def test_readme_walkthrough_runs_as_written(tmp_path):
    """Every k3convert command of the README's shell blocks (the install block aside:
    the suite runs in the installed tree) exits 0."""
    blocks = [b for b in _shell_blocks((ROOT / "README.md").read_text()) if "pip " not in b]
    lines = [ln.split("  #")[0].strip() for b in blocks for ln in b.splitlines()]
    commands = [ln for ln in lines if ln]
    assert len(commands) >= 5 and all(c.startswith("k3convert ") for c in commands), commands
    for cmd in commands:
        argv = shlex.split(cmd.replace("/tmp/", f"{tmp_path}/"))[1:]
        r = subprocess.run([sys.executable, "-m", "k3convert", *argv], capture_output=True,
                           text=True, timeout=600, cwd=tmp_path)  # fmt: skip
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])

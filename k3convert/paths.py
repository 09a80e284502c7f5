"""Where the data folders that ship next to the package are found (``calibration/``,
``recipes/``): an environment variable, the source checkout (editable install), then
``<sys.prefix>/share/k3convert/NAME`` (where a wheel's data-files put them)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def data_dirs(env: str, name: str) -> list[Path]:
    """The existing folders for ``name``, first match first: ``$env``, the checkout's
    ``NAME/``, the installed ``share/k3convert/NAME``."""
    dirs = []
    if os.environ.get(env):
        dirs.append(Path(os.environ[env]))
    dirs.append(Path(__file__).resolve().parents[1] / name)
    dirs.append(Path(sys.prefix) / "share" / "k3convert" / name)
    return [d for d in dirs if d.is_dir()]

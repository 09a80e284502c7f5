"""``python -m k3convert`` (and ``torchrun -m k3convert verify ...``)."""

import os
import sys


def _drop_working_directory() -> None:
    """Remove the working directory from ``sys.path`` before anything else is imported.

    ``python -m`` puts the working directory first on ``sys.path``, so a model directory
    that holds an ``xxhash.py`` or ``torch/`` would run its code on a plain
    ``cd model && python -m k3convert inspect .``. k3convert itself is already imported
    here (found through the installed package, or this very entry), and the package's
    ``__init__`` imports nothing, so no dependency was looked up there yet.
    """
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:  # the working directory was removed: only '' can name it
        cwd = None

    def is_cwd(entry: str) -> bool:
        if entry in ("", "."):
            return True
        try:
            return cwd is not None and os.path.realpath(entry) == cwd
        except (OSError, ValueError):
            return False

    pkg_parent = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    sys.path[:] = [p for p in sys.path if not is_cwd(p) or os.path.realpath(p or ".") == pkg_parent]


_drop_working_directory()

from .cli import entry  # noqa: E402  (after the working directory left sys.path)

entry()

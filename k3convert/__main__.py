"""``python -m k3convert`` (and ``torchrun -m k3convert verify ...``)."""

from .cli import entry

entry()

"""Every user-facing failure is a K3Error subclass.

The CLI maps any K3Error to a one-line message on stderr and exit code 2, so the
message itself must say what is wrong, where (file, tensor, key path) and what to do.
Anything that is not a K3Error is a bug in k3convert and keeps its traceback.
"""

from __future__ import annotations

import reprlib
from typing import Any


class K3Error(Exception):
    """Base class of every error a user can cause with bad input. ``where``: the place
    the message already names (a recipe key path such as ``R.yaml: quantize.rules[1]``),
    for callers that add context; None when the message names none."""

    exit_code = 2
    where: str | None = None


class CheckpointError(K3Error):
    """A checkpoint directory or file is missing, malformed or inconsistent."""


class SafetensorsFormatError(CheckpointError):
    """A .safetensors file violates the format (header, offsets, dtype/shape/bytes)."""


class UnsafePickleError(CheckpointError):
    """A PyTorch .bin/.pt file needs full unpickling, which k3convert refuses."""


class ArchError(K3Error):
    """Unknown model_type, bad config values, or tensor names the architecture lacks."""


class UnknownTensorsError(ArchError):
    """Tensor names that match no pattern of the architecture."""

    def __init__(self, arch: str, names: list[str], where: str = ""):
        self.names = list(names)
        shown = ", ".join(self.names[:8])
        more = f" (and {len(self.names) - 8} more)" if len(self.names) > 8 else ""
        loc = f" in {where}" if where else ""
        super().__init__(
            f"{len(self.names)} tensor name(s){loc} are not part of architecture "
            f"'{arch}': {shown}{more}. Check that config.json's model_type matches the "
            f"weights, or report the names so the architecture table can learn them."
        )


class ConfigError(K3Error):
    """A config.json / option value that k3convert cannot use."""


class OutputError(K3Error):
    """An output path exists, is not writable, or there is not enough free disk."""


class NonFiniteError(K3Error):
    """A computation on the user's weights or inputs produced NaN / inf."""


# -- values in messages ---------------------------------------------------------------
# -- quantization (raised by k3convert.quant.schemes) ---------------------------------
class UnknownSchemeError(ConfigError):
    """A scheme name that is not registered (the message lists the known ones)."""


class GroupSizeError(ConfigError):
    """A group size that does not divide a tensor's input dimension; ``tensor``: its name
    (None where not known)."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class NonFiniteWeightError(CheckpointError):
    """A source weight holds NaN or Inf (or a scale about to be written is not finite)."""


class WeightRangeError(CheckpointError):
    """A finite weight too large for the scheme: no finite scale of its scale dtype (or
    no finite dequantized value) represents it."""


SHORT = 60

_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = SHORT
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def short_repr(value: Any, limit: int = SHORT) -> str:
    """``type prefix``: the value's type and at most ``limit`` characters of its repr.

    Bounded work whatever the value (reprlib stops at depth 2, four items, 60 characters
    of a string), so a huge or alias-expanded value never reaches a message.
    """
    try:
        r = _REPR.repr(value)
    except Exception:  # an int beyond str()'s digit limit, a broken __repr__
        r = "..."
    if len(r) > limit:
        r = r[: limit - 3] + "..."
    return f"{type(value).__name__} {r}"


def short_list(values, head: int = 8) -> str:
    """A list for a message: the first ``head`` items and a count of the rest."""
    values = list(values)
    if len(values) <= head:
        return str(values)
    shown = ", ".join(map(str, values[:head]))
    return f"[{shown}, ... ({len(values) - head} more)]"

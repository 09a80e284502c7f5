"""Small parsers for option values given on the command line."""

from __future__ import annotations

from .errors import ConfigError


def int_list(text: str, option: str) -> list[int]:
    """'20,21,20' -> [20, 21, 20]; a clear error naming the option otherwise."""
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise ConfigError(
            f"{option} must be comma-separated integers like '20,21,20', got '{text}'."
        ) from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"{option} must list non-negative integers, got '{text}'.")
    return values

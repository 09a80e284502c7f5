"""Sizes and counts, defined once: the byte formatter and the parsers of every option that
takes a size (``--device-mem 141GB``, an ``--auto-keep`` byte budget) or a token count
(``--context 128k``)."""

from __future__ import annotations

import math
import re

from .errors import ConfigError

#: byte units, case-insensitive: powers of 1000 (``GB``) and of 1024 (``GiB``); a bare
#: ``G`` is refused (10^9 or 2^30 bytes? a budget off by 7 % is not a detail)
SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
#: token-count units: k = 1024, M = 1024**2 (a 1M context is 1,048,576 tokens)
TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20}
#: a non-negative decimal number, optionally with an exponent (no sign)
NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"


def human_bytes(n: float | None, digits: int = 1) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``1.5 GiB``; ``512 B``;
    ``-`` for None)."""
    if n is None:
        return "-"
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or suffix == "TiB":
            return f"{n:.{digits}f} {suffix}" if suffix != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n}"


def split_unit(text: str | int, units: dict[str, int]) -> tuple[float, str] | None:
    """(number, unit lower-cased) of ``text`` such as ``1.5GB``, when the unit is one of
    ``units``; None when it is not a number followed by such a unit."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    s = text.strip() if isinstance(text, str) else ""
    m = re.fullmatch(rf"({NUMBER})\s*([a-zA-Z]*)", s)
    if m is None or m.group(2).lower() not in units:
        return None
    return float(m.group(1)), m.group(2).lower()


def parse_size(text: str | int, option: str = "--device-mem") -> int:
    """``141GB`` (10^9) / ``140GiB`` (2^30) / ``1.5TB`` / ``80000000000`` -> bytes."""
    got = split_unit(text, SIZE_UNITS)
    if got is None:
        raise ConfigError(
            f"{option} '{text}' is not a size; give a number with a unit: B, KB, MB, GB, TB "
            f"(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 141GB or 140GiB."
        )
    n = got[0] * SIZE_UNITS[got[1]]
    if not math.isfinite(n) or n < 1:
        raise ConfigError(f"{option} '{text}' must be at least one byte.")
    return int(n)


def parse_tokens(text: str | int, option: str = "--context") -> int:
    """``131072`` / ``128k`` (x 1024) / ``1M`` (x 1024^2 = 1,048,576) -> a positive count."""
    s = str(text).strip() if isinstance(text, (str, int)) and not isinstance(text, bool) else ""
    got = split_unit(s.removeprefix("-"), TOKEN_UNITS)
    if got is None:
        raise ConfigError(
            f"{option} '{text}' is not a token count; give an integer, or k / M for 1024 / "
            f"1,048,576 tokens (128k = 131072, 1M = 1048576)."
        )
    v = got[0] * TOKEN_UNITS[got[1]]
    if s.startswith("-") or not math.isfinite(v) or v < 1 or v != int(v):
        raise ConfigError(f"{option} '{text}' must be a positive whole number of tokens.")
    return int(v)


def byte_bar(**kwargs):
    """A tqdm progress bar counting bytes in the binary units the summaries print
    (``25.5 MiB/100.0 MiB [00:02<00:06, 12.1 MiB/s]``): tqdm's own scaling labels powers of
    1024 "MB" and its rate in powers of 1000. Keyword arguments are tqdm's; a bar whose
    ``unit`` is set to another name later counts plain numbers of it."""
    from tqdm import tqdm

    class _Bytes(tqdm):
        @property
        def format_dict(self):
            d = super().format_dict
            rate = d["rate"] if d["rate"] else (d["n"] / d["elapsed"] if d["elapsed"] else None)
            unit = d["unit"]
            fmt = human_bytes if unit == "B" else (lambda x: f"{x:g} {unit}")  # a stage in
            d.update(  # other units (convert's calibration counts layers)
                n_b=fmt(d["n"]),
                total_b=fmt(d["total"]) if d["total"] else "?",
                rate_b=f"{fmt(round(rate, 2))}/s" if rate else f"? {unit}/s",
            )
            return d

    kwargs.setdefault(
        "bar_format",
        "{l_bar}{bar}| {n_b}/{total_b} [{elapsed}<{remaining}, {rate_b}]",
    )
    # shown after half a second: a run refused at once (an OUT already complete) prints
    # its error line alone, not under an empty bar
    kwargs.setdefault("delay", 0.5)
    return _Bytes(unit="B", **kwargs)

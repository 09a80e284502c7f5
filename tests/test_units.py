"""The one byte formatter and the size / token-count parsers (k3convert.units), and the
budget parser that reads its byte units."""

from __future__ import annotations

import pytest

from k3convert.calibrate.sensitivity import parse_budget
from k3convert.errors import ConfigError
from k3convert.units import human_bytes, parse_size, parse_tokens


@pytest.mark.parametrize(
    ("text", "n"),
    [("141GB", 141 * 10**9), ("140GiB", 140 * 2**30), ("1.5TB", 15 * 10**11),
     (" 80000000000 ", 80 * 10**9), (4096, 4096), ("1.5e3 MiB", 1500 * 2**20)],
)  # fmt: skip
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize(
    "text", ["12 parsecs", "GB", "-1GB", "0.1", "", True, None, "nan GB", "1G", "2k"]
)
def test_parse_size_refuses_with_the_option(text):
    with pytest.raises(ConfigError, match="--device-mem"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "n"), [("131072", 131072), ("128k", 131072), ("1M", 1 << 20), (7, 7)]
)
def test_parse_tokens(text, n):
    assert parse_tokens(text) == n


@pytest.mark.parametrize("text", ["-5", "0", "1.5", "2q", "", "1.5k" + "x"])
def test_parse_tokens_refuses(text):
    with pytest.raises(ConfigError, match="--context"):
        parse_tokens(text)


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(1536, 2) == "1.50 KiB"
    assert human_bytes(3 * 2**40) == "3.0 TiB"
    assert human_bytes(5 * 2**50) == "5120.0 TiB"
    assert human_bytes(-2048, 2) == "-2.00 KiB"
    assert human_bytes(None) == "-"


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [("5%", "percent", 5.0), ("300MiB", "bytes", 300 * 2**20), ("1.5GB", "bytes", 1.5e9),
     ("2000000", "bytes", 2e6), ("4.5bpw", "bpw", 4.5), ("2GB", "bytes", 2e9)],
)  # fmt: skip
def test_budget_reads_the_same_units(text, kind, value):
    b = parse_budget(text)
    assert (b.kind, b.value) == (kind, value)


@pytest.mark.parametrize("text", ["2g", "1G", "5k"])
def test_budget_refuses_the_ambiguous_units_size_options_refuse(text):
    """One unit table for every size option: a bare G (GB or GiB?) is refused by
    --auto-keep as by --device-mem."""
    with pytest.raises(ConfigError, match="not understood"):
        parse_budget(text)


@pytest.mark.parametrize("text", ["1e400", "1e309k", "nan", "inf"])
def test_parse_tokens_refuses_what_no_count_is(text):
    with pytest.raises(ConfigError, match="--context"):
        parse_tokens(text)

"""A model directory's tokenizer files, opened safely: what transformers may read is
checked first (regular files under the tokenizer size cap: a FIFO would block it, a huge
file eat memory), and a panic of the Rust ``tokenizers`` library (a BaseException that
``except Exception`` lets through, with a backtrace printed on stderr) becomes one line.
Used by calibration, ``verify``'s inputs and ``forward``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError, K3Error
from .bounded import check_file

#: files whose presence means the model directory ships a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                   "spiece.model", "tokenizer_config.json")  # fmt: skip
#: every file transformers may read to build a tokenizer: each must be a regular file
#: under the tokenizer size cap before transformers opens it (a FIFO would block it)
TOKENIZER_READS = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt",
                   "vocab.txt", "chat_template.jinja", "chat_template.json")  # fmt: skip


def check_tokenizer_files(d: Path, error: type[K3Error] = ConfigError) -> None:
    """``error`` naming the file unless every tokenizer file of ``d`` that exists is a
    regular file under the tokenizer size cap (:mod:`..checkpoint.bounded`): transformers
    would block on a FIFO and read any size."""
    for name in TOKENIZER_READS:
        f = d / name
        if os.path.lexists(f):
            check_file(f, "tokenizer", error)


def is_panic(e: BaseException) -> bool:
    """A Rust panic surfaced by pyo3 (``pyo3_runtime.PanicException``, a BaseException
    and not an Exception, so ``except Exception`` lets it through)."""
    return type(e).__name__ == "PanicException"


def panic_message(d: Path, e: BaseException) -> str:
    f = d / "tokenizer.json"
    return (
        f"{f if f.exists() else d}: the tokenizers library crashed loading or using it "
        f"(panic: {one_line(e, 200)}); the tokenizer is damaged or hostile - fix or replace "
        f"the file, or pre-tokenize the data into a .jsonl with an 'input_ids' column."
    )


def one_line(e: BaseException, limit: int) -> str:
    text = str(e).strip()
    return (text.splitlines()[0][:limit] if text else "") or type(e).__name__


@contextlib.contextmanager
def quiet_panics() -> Iterator[None]:
    """Standard error (file descriptor 2) held back while the body runs: a Rust panic
    prints its message and backtrace there before Python sees it; that text is dropped
    when the body panics (the error message repeats what matters), and written out
    unchanged otherwise (warnings and the like)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, AttributeError, ValueError):  # no usable stderr: nothing to hide
        yield
        return
    panicked = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException as e:
            panicked = is_panic(e)
            raise
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked:
                held.seek(0)
                with contextlib.suppress(OSError):
                    while data := held.read(1 << 20):
                        while data:
                            data = data[os.write(2, data) :]

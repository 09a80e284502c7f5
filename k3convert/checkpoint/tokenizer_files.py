"""A model directory's tokenizer files, opened safely: what transformers may read is
checked first (regular files under the tokenizer size cap: a FIFO would block it, a huge
file eat memory), and a panic of the Rust ``tokenizers`` library (a BaseException that
``except Exception`` lets through, with a backtrace printed on stderr) becomes one line.
Used by calibration, ``verify``'s inputs and ``forward``; the JSON files a serving
engine parses are checked before an output carries them (:func:`check_engine_json`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError, K3Error
from .bounded import check_file, read_text

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


#: carried files a serving engine parses as JSON objects when it loads the model (the
#: tokenizer's and the generation settings)
ENGINE_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "generation_config.json")  # fmt: skip


def check_engine_json(paths, error: type[K3Error] = ConfigError) -> None:
    """``error`` (one line: the file, why, what to do) unless each of ``paths`` named in
    :data:`ENGINE_JSON` is one JSON object, read bounded - refused before anything is
    written rather than carried into an output its engine cannot load. A key given twice
    is let through: the engines' loaders take the last."""
    for p in paths:
        if p.name not in ENGINE_JSON:
            continue
        try:
            doc = json.loads(read_text(p, "tokenizer", error))
            why = None if isinstance(doc, dict) else "not a JSON object"
        except RecursionError:
            why = "not valid JSON (nested too deeply)"
        except ValueError as e:
            why = f"not valid JSON ({e})"
        if why:
            raise error(
                f"{p}: {why}; serving engines parse it when they load the model - restore "
                f"the release's file, or remove it if the model needs none."
            )


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

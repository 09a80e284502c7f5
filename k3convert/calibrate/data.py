"""Calibration data: token blocks (and image paths) for layer-sequential calibration.

One entry point, :func:`build_calibration_set`, turns a dataset into a
:class:`CalibrationSet` (``input_ids`` / ``attention_mask`` ``[N, S]`` int64, a sha256
fingerprint of the exact ids and options, provenance). A dataset is

* a local file or directory of ``.jsonl`` / ``.json`` / ``.parquet`` / ``.txt`` files
  (read with ``datasets``; a ``.txt`` file gives one row per blank-line paragraph),
* the name of a definition in ``calibration/*.yaml`` (``default`` is the built-in
  corpus: :func:`builtin_corpus`, needing no download), or
* a Hugging Face dataset name that is already in the local ``datasets`` cache. Nothing is
  ever downloaded: the load runs in offline mode and a name that is not cached is an
  error.

Columns (auto-detected, or ``column=``): a string column is text, a list of
``{"role", "content"}`` dicts is a chat rendered with the checkpoint's chat template, a
list of integers is pre-tokenized ``input_ids``. The tokenizer is
``AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)``, loaded only when
the model directory has tokenizer files; code from the model directory never runs.
A checkpoint without a tokenizer takes only pre-tokenized data (jsonl or parquet with an
``input_ids`` column of integer lists). Rows with a local image path column (``images``:
a list of paths, or ``image``: one path) are accepted only when config.json has a
``vision_config``; the paths are checked and returned, pixels are not read here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from ..arch import load_config
from ..checkpoint.tokenizer_files import (
    TOKENIZER_FILES,
    check_tokenizer_files,
    is_panic,
    one_line,
    panic_message,
    quiet_panics,
)
from ..errors import ConfigError
from ..paths import data_dirs

if TYPE_CHECKING:
    from .rows import RowTokenizer

#: file suffix -> ``datasets`` packaged builder
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
IMAGE_COLUMNS = ("images", "image")
BUILTIN = "builtin"
HUB_PREFIX = "hub:"
ENV_DIR = "K3CONVERT_CALIBRATION_DIR"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_FINGERPRINT_VERSION = "k3convert-calibration-v1"
_ROW = "__k3convert_row__"


class CalibrationDataError(ConfigError):
    """A calibration dataset, column or option that cannot give calibration samples."""


# -- options and result -----------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationOptions:
    """How rows become samples (the table in docs/architecture.md, "Calibration data").

    packing=True: every row is tokenized, followed by EOS (unless it already ends with
    it), concatenated, and cut into ``seq_len`` blocks; the last partial block is dropped.
    packing=False: one sample per row; a row longer than ``seq_len`` is truncated to its
    first ``seq_len`` tokens, a row shorter than ``min_len`` tokens (default: ``seq_len``,
    so every sample is full) is skipped, and a kept shorter row is right-padded with the
    pad id (attention_mask 0). Image rows always use one sample per row.
    """

    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    shuffle: bool = True
    packing: bool = True
    min_len: int | None = None
    column: str | None = None

    def check(self) -> None:
        for key in ("num_samples", "seq_len"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CalibrationDataError(
                    f"calibration option {key} must be a positive integer, got {v!r}."
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise CalibrationDataError(
                f"calibration option seed must be a non-negative integer, got {self.seed!r}."
            )
        if self.min_len is not None and not 1 <= self.min_len <= self.seq_len:
            raise CalibrationDataError(
                f"calibration option min_len must be between 1 and seq_len ({self.seq_len}), "
                f"got {self.min_len!r}."
            )

    @property
    def effective_min_len(self) -> int:
        return self.seq_len if self.min_len is None else self.min_len


@dataclass
class CalibrationSet:
    """Calibration samples: ``input_ids`` / ``attention_mask`` are int64 ``[N, S]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    source: str
    fingerprint: str
    images: list[list[str]] | None = None
    options: dict = field(default_factory=dict)
    tokenizer: str | None = None
    rows_read: int = 0
    rows_skipped: int = 0

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def describe(self) -> dict:
        """Provenance as a JSON-serialisable dict (written next to calibrated outputs)."""
        return {
            "source": self.source,
            "fingerprint": self.fingerprint,
            "num_samples": self.num_samples,
            "requested_samples": self.options.get("num_samples"),
            "seq_len": self.seq_len,
            "tokens": int(self.attention_mask.sum()),
            "padded_tokens": int((self.attention_mask == 0).sum()),
            "rows_read": self.rows_read,
            "rows_skipped": self.rows_skipped,
            "tokenizer": self.tokenizer,
            "images": None if self.images is None else sum(len(i) for i in self.images),
            "options": dict(self.options),
        }


# -- built-in corpus and definitions ------------------------------------------------------
def calibration_dirs() -> list[Path]:
    """Where ``calibration/*.yaml`` definitions are looked up, first match wins.

    ``$K3CONVERT_CALIBRATION_DIR``, then the ``calibration/`` folder of a source checkout
    (editable install), then ``<sys.prefix>/share/k3convert/calibration`` (where a wheel
    installs the same files, see pyproject's data-files).
    """
    return data_dirs(ENV_DIR, "calibration")


def _definitions_dir() -> Path:
    dirs = calibration_dirs()
    if not dirs:
        raise CalibrationDataError(
            "the calibration/ definitions folder was not found (looked in "
            f"${ENV_DIR}, the source checkout and {sys.prefix}/share/k3convert); "
            f"set {ENV_DIR} to a folder of *.yaml definitions or pass a data file path."
        )
    return dirs[0]


def builtin_corpus() -> list[str]:
    """The default calibration texts, in a fixed order, no download needed.

    The ``calibration/texts/*.txt`` files (one document each, sorted by name), then every
    topic of CPython's ``pydoc_data.topics`` (sorted by key). The topics text follows the
    Python version, which the fingerprint of a built set records through its token ids.
    """
    from pydoc_data.topics import topics  # a large module: loaded only for this corpus

    docs = []
    texts = _definitions_dir() / "texts"
    if texts.is_dir():
        for f in sorted(texts.glob("*.txt")):
            t = f.read_text(encoding="utf-8").strip()
            if t:
                docs.append(t)
    docs.extend(topics[k].strip() for k in sorted(topics) if topics[k].strip())
    return docs


@dataclass(frozen=True)
class DatasetDefinition:
    """One ``calibration/*.yaml``: name, source, column and default sizes."""

    name: str
    source: str
    file: Path
    column: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    description: str = ""


def load_definitions() -> dict[str, DatasetDefinition]:
    """Every ``calibration/*.yaml`` definition by name (``yaml.safe_load``)."""
    out: dict[str, DatasetDefinition] = {}
    for f in sorted(_definitions_dir().glob("*.yaml")):
        try:
            raw = yaml.safe_load(f.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise CalibrationDataError(f"{f}: not valid YAML ({e}); fix the definition.") from e
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise CalibrationDataError(f"{f}: a definition is a mapping with a 'name' string.")
        if not isinstance(raw.get("source"), str):
            raise CalibrationDataError(
                f"{f}: 'source' must be a string: '{BUILTIN}', a path relative to the file, "
                f"or '{HUB_PREFIX}<dataset name>'."
            )
        unknown = set(raw) - {"name", "source", "column", "num_samples", "seq_len", "description"}
        if unknown:
            raise CalibrationDataError(f"{f}: unknown key(s) {sorted(unknown)}.")
        for key in ("num_samples", "seq_len"):
            v = raw.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise CalibrationDataError(f"{f}: '{key}' must be a positive integer, got {v!r}.")
        if raw["name"] in out:
            raise CalibrationDataError(
                f"{f}: dataset name '{raw['name']}' is also defined in {out[raw['name']].file}."
            )
        out[raw["name"]] = DatasetDefinition(
            name=raw["name"],
            source=raw["source"],
            file=f,
            column=raw.get("column"),
            num_samples=raw.get("num_samples"),
            seq_len=raw.get("seq_len"),
            description=str(raw.get("description") or ""),
        )
    return out


# -- dataset resolution ---------------------------------------------------------------------
@dataclass(frozen=True)
class ResolvedDataset:
    """What ``--dataset NAME`` means: kind is 'builtin', 'files' or 'hub'."""

    kind: str
    source: str
    files: tuple[Path, ...] = ()
    definition: DatasetDefinition | None = None


def looks_like_path(text: str) -> bool:
    return (
        text.startswith((".", "/", "~"))
        or (os.sep in text.rstrip(os.sep) and not _HUB_NAME.match(text))
        or Path(text).suffix.lower() in BUILDERS
    )


def _local_files(p: Path, where: str) -> tuple[Path, ...]:
    if p.is_file():
        if p.suffix.lower() not in BUILDERS:
            raise CalibrationDataError(
                f"{where}: {p.name} is not a calibration data file; use one of "
                f"{', '.join(BUILDERS)}."
            )
        return (p,)
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in BUILDERS)
    if not files:
        raise CalibrationDataError(
            f"{where}: the directory {p} has no {', '.join(BUILDERS)} files; the dataset is empty."
        )
    kinds = {BUILDERS[f.suffix.lower()] for f in files}
    if len(kinds) > 1:
        raise CalibrationDataError(
            f"{where}: the directory {p} mixes file kinds ({', '.join(sorted(kinds))}); "
            f"keep one kind per directory or pass a single file."
        )
    return tuple(files)


def resolve_dataset(name: str | os.PathLike) -> ResolvedDataset:
    """``--dataset NAME``: an existing path, a ``calibration/*.yaml`` name, or a hub name."""
    text = os.fspath(name)
    if not text.strip():
        raise CalibrationDataError("--dataset is empty; give a file, a directory or a name.")
    p = Path(text).expanduser()
    if p.exists():
        return ResolvedDataset("files", str(p.resolve()), _local_files(p.resolve(), text))
    if text.startswith(HUB_PREFIX):
        return ResolvedDataset("hub", text[len(HUB_PREFIX) :])
    if looks_like_path(text):
        raise CalibrationDataError(
            f"calibration dataset path {text} does not exist; check the path (relative paths "
            f"are taken from {Path.cwd()})."
        )
    defs = load_definitions() if calibration_dirs() else {}
    if text in defs:
        d = defs[text]
        if d.source == BUILTIN:
            return ResolvedDataset(BUILTIN, f"{BUILTIN}:{d.name}", definition=d)
        if d.source.startswith(HUB_PREFIX):
            return ResolvedDataset("hub", d.source[len(HUB_PREFIX) :], definition=d)
        sp = (d.file.parent / d.source).resolve()
        if not sp.exists():
            raise CalibrationDataError(
                f"{d.file}: source {d.source} does not exist ({sp}); fix the definition."
            )
        return ResolvedDataset("files", str(sp), _local_files(sp, str(d.file)), definition=d)
    if _HUB_NAME.match(text):
        return ResolvedDataset("hub", text)
    raise CalibrationDataError(
        f"calibration dataset '{text}' is not a path, not a definition "
        f"({', '.join(sorted(defs)) or 'none'}) and not a dataset name."
    )


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Offline mode for one ``datasets`` call (env and the already-imported constants)."""
    # datasets / huggingface_hub are heavy to import: imported only when data is read
    import datasets.config as dconfig
    import huggingface_hub.constants as hconst

    saved_env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    import datasets

    saved = (dconfig.HF_HUB_OFFLINE, hconst.HF_HUB_OFFLINE)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    dconfig.HF_HUB_OFFLINE = hconst.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dconfig.HF_HUB_OFFLINE, hconst.HF_HUB_OFFLINE = saved
        if bars:
            datasets.enable_progress_bars()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _known_names() -> str:
    names = sorted(load_definitions()) if calibration_dirs() else []
    return f" (calibration/*.yaml defines: {', '.join(names)})" if names else ""


def _hub_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    import datasets.config as dconfig  # heavy: see _offline

    return Path(os.path.expanduser(str(cache_dir or dconfig.HF_DATASETS_CACHE)))


def _hub_is_cached(name: str, cache_dir: Path) -> bool:
    # datasets keeps a loaded hub dataset under <cache>/<namespace>___<name>/<config>/<ver>/<h>
    parts = name.split("/")
    root = cache_dir / "___".join(parts)
    alt = cache_dir / "___".join([*parts[:-1], _snake(parts[-1])])
    return any(any(d.is_dir() for d in r.glob("*/*/*")) for r in {root, alt} if r.is_dir())


def _snake(name: str) -> str:
    s = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z\d])([A-Z])", r"\1_\2", s).lower()


def load_rows(resolved: ResolvedDataset, *, cache_dir: str | os.PathLike | None = None):
    """The rows of a file or cached hub dataset as a ``datasets.Dataset`` (offline)."""
    import datasets  # heavy: see _offline

    dl = datasets.DownloadConfig(local_files_only=True)
    if resolved.kind == BUILTIN:
        return datasets.Dataset.from_dict({"text": builtin_corpus()})
    if resolved.kind == "hub":
        cache = _hub_cache_dir(cache_dir)
        if not _hub_is_cached(resolved.source, cache):
            raise CalibrationDataError(
                f"dataset '{resolved.source}' is not a file or directory here and not in the "
                f"local Hugging Face datasets cache ({cache}); k3convert never downloads. "
                f"Load it once with datasets on a machine with network (same cache dir), or "
                f"export it to a .jsonl/.parquet file and pass that path{_known_names()}."
            )
        try:
            with _offline():
                ds = datasets.load_dataset(
                    resolved.source, cache_dir=str(cache), download_config=dl
                )
        except Exception as e:  # datasets raises ConnectionError / FileNotFoundError / ValueError
            raise CalibrationDataError(
                f"dataset '{resolved.source}' could not be read from the local cache {cache} "
                f"in offline mode ({type(e).__name__}: {e}); export it to a .jsonl/.parquet "
                f"file and pass that path."
            ) from e
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else sorted(ds)[0]
            ds = ds[split]
        return ds
    if all(f.stat().st_size < 4096 and not f.read_bytes().strip() for f in resolved.files):
        raise CalibrationDataError(
            f"{resolved.source}: the dataset is empty (no bytes in "
            f"{', '.join(f.name for f in resolved.files[:4])}); give it rows."
        )
    builder = BUILDERS[resolved.files[0].suffix.lower()]
    kwargs: dict[str, Any] = {"sample_by": "paragraph"} if builder == "text" else {}
    # a throw-away cache: a local file is re-read every time, so an edited file is never
    # served from a stale arrow cache, and nothing is left in the user's HF cache
    with tempfile.TemporaryDirectory(prefix="k3calib-") as tmp, _offline():
        try:
            ds = datasets.load_dataset(
                builder,
                data_files=[str(f) for f in resolved.files],
                split="train",
                cache_dir=tmp,
                keep_in_memory=True,
                download_config=dl,
                **kwargs,
            )
        except Exception as e:  # a malformed json / parquet file
            if "corresponds to no data" in str(e):  # datasets' words for a file of 0 rows
                raise CalibrationDataError(
                    f"{resolved.source}: the dataset is empty (0 rows); give it rows."
                ) from e
            raise CalibrationDataError(
                f"{resolved.source}: could not be read as {builder} ({type(e).__name__}: "
                f"{str(e)[:300]}); fix the file or convert it to .jsonl."
            ) from e
    return ds


# -- model side ---------------------------------------------------------------------------
@dataclass
class ModelInfo:
    """What calibration data needs from a checkpoint: limits, special ids, a tokenizer."""

    model_dir: Path
    max_positions: int | None
    vocab_size: int | None
    has_vision: bool
    eos_id: int | None
    pad_id: int | None
    tokenizer: Any = None
    tokenizer_name: str | None = None
    #: image / video placeholder ids: a row without an image must not hold them
    media_ids: frozenset[int] = frozenset()
    #: why text rows cannot be tokenized (tokenizer is None)
    no_tokenizer: str = f"has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)"
    #: the file the tokenizer's chat template comes from (for messages)
    template_file: Path | None = None


def _first_id(v: Any) -> int | None:
    if isinstance(v, list):
        v = v[0] if v else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _media_ids(raw: dict) -> frozenset[int]:
    vision = raw.get("vision_config") if isinstance(raw.get("vision_config"), dict) else {}
    if not vision:
        return frozenset()
    keys = ("image_token_id", "video_token_id", "media_placeholder_token_id")
    return frozenset(
        i for k in keys for d in (raw, vision) if (i := _first_id(d.get(k))) is not None
    )


def model_info(model_dir: str | os.PathLike) -> ModelInfo:
    """config.json limits and, when the directory has tokenizer files, its tokenizer."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CalibrationDataError(
            f"model directory {d} does not exist or is not a directory; point at the checkpoint."
        )
    raw = load_config(d)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}

    def pick(key):
        v = raw.get(key, text.get(key))
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    info = ModelInfo(
        model_dir=d,
        max_positions=pick("max_position_embeddings"),
        vocab_size=pick("vocab_size"),
        has_vision=isinstance(raw.get("vision_config"), dict),
        eos_id=_first_id(raw.get("eos_token_id", text.get("eos_token_id"))),
        pad_id=_first_id(raw.get("pad_token_id", text.get("pad_token_id"))),
        media_ids=_media_ids(raw),
    )
    if any(os.path.lexists(d / f) for f in TOKENIZER_FILES):
        try:  # optional and heavy: only with tokenizer files, and only text rows need it
            from transformers import AutoTokenizer
        except ImportError:
            info.no_tokenizer = "has tokenizer files, but transformers (which loads them) is "
            info.no_tokenizer += "not installed: pip install transformers"
            return info

        check_tokenizer_files(d, CalibrationDataError)
        try:
            with _offline(), quiet_panics():  # a local directory; never a hub lookup either
                tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
                tok(_PROBE)  # a tokenizer that crashes on any text does so here, not mid-data
        except Exception as e:  # remote-code tokenizers, broken files
            raise CalibrationDataError(
                f"{d}: the tokenizer could not be loaded ({type(e).__name__}: "
                f"{one_line(e, 300)}): its files are broken, or it needs code from the model "
                f"directory, and k3convert never runs model code. Fix the tokenizer files, or "
                f"pre-tokenize the data into a .jsonl with an 'input_ids' column."
            ) from e
        except BaseException as e:  # a Rust panic of the tokenizers library
            if not is_panic(e):
                raise
            raise CalibrationDataError(panic_message(d, e)) from None
        info.tokenizer = tok
        info.template_file = next(
            (d / f for f in ("chat_template.jinja", "chat_template.json") if (d / f).is_file()),
            d / "tokenizer_config.json",
        )
        info.tokenizer_name = f"{type(tok).__name__}({d.name}, vocab {len(tok)})"
        if tok.eos_token_id is not None:
            info.eos_id = int(tok.eos_token_id)
        if tok.pad_token_id is not None:
            info.pad_id = int(tok.pad_token_id)
    return info


# -- hostile tokenizer files ---------------------------------------------------------------
#: text every tokenizer must encode: a panic here is reported as a broken tokenizer
_PROBE = "Probe: 1 2 3, \u00fc\u00f1\u00ee \u65e5\u672c\n\tend."


# -- rows -> token ids -----------------------------------------------------------------------
def _pick_column(ds, column: str | None, source: str) -> str:
    cols = list(ds.column_names)
    if column is not None:
        if column not in cols:
            raise CalibrationDataError(
                f"{source}: column '{column}' does not exist; the dataset has columns "
                f"{', '.join(cols) or '(none)'}. Pass one of them."
            )
        return column
    for c in ("input_ids", "messages", "text"):
        if c in cols:
            return c
    raise CalibrationDataError(
        f"{source}: no 'input_ids', 'messages' or 'text' column; the dataset has columns "
        f"{', '.join(cols) or '(none)'}. Pass column= to choose one."
    )


def _image_paths(value: Any, base: Path | None, where: str) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if not isinstance(item, str):
            raise CalibrationDataError(
                f"{where}: images must be local file paths (strings), got "
                f"{type(item).__name__}; store the paths, not the pixels."
            )
        p = Path(item).expanduser()
        if not p.is_absolute() and base is not None:
            p = base / p
        if not p.is_file():
            raise CalibrationDataError(
                f"{where}: image {item} does not exist ({p}); fix the path (relative paths "
                f"are taken from the data file's directory)."
            )
        out.append(str(p.resolve()))
    return out


def fingerprint(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    options: dict,
    images: list[list[str]] | None,
) -> str:
    """sha256 of the exact token ids, the mask, the options and the image paths."""
    h = hashlib.sha256()
    meta = {"v": _FINGERPRINT_VERSION, "shape": list(input_ids.shape), "options": options}
    h.update(json.dumps(meta, sort_keys=True).encode())
    h.update(input_ids.to(torch.int64).contiguous().numpy().astype("<i8").tobytes())
    h.update(attention_mask.to(torch.int64).contiguous().numpy().astype("<i8").tobytes())
    h.update(json.dumps(images).encode())
    return h.hexdigest()


def _packed_samples(
    ds, col: str, tokenize: RowTokenizer, opts: CalibrationOptions, info: ModelInfo, source: str
) -> tuple[list[list[int]], list[list[int]], int, int]:
    """packing=True: the rows' ids (each followed by EOS) concatenated and cut into
    ``seq_len`` blocks -> (rows, masks, rows read, rows skipped)."""
    S, N = opts.seq_len, opts.num_samples
    read = skipped = 0
    stream: list[int] = []
    for k, row in enumerate(ds.select_columns([col, _ROW] if opts.shuffle else [col])):
        read += 1
        ids = tokenize(row[col], row.get(_ROW, k))
        if not ids:
            skipped += 1
            continue
        stream.extend(ids)
        if info.eos_id is not None and ids[-1] != info.eos_id:
            stream.append(info.eos_id)
        if len(stream) >= N * S:
            break
    rows = [stream[k : k + S] for k in range(0, len(stream) - S + 1, S)][:N]
    masks = [[1] * S for _ in rows]
    if not rows:
        raise CalibrationDataError(
            f"{source}: {read} row(s) give {len(stream)} token(s), fewer than one "
            f"seq_len block of {S}; the dataset is empty at this seq_len. Lower seq_len "
            f"or add data."
        )
    return rows, masks, read, skipped


def _row_samples(
    ds,
    col: str,
    image_col: str | None,
    tokenize: RowTokenizer,
    opts: CalibrationOptions,
    info: ModelInfo,
    base: Path | None,
    source: str,
) -> tuple[list[list[int]], list[list[int]], list[list[str]] | None, int, int]:
    """One sample per row (truncated, right-padded; rows under min_len skipped), with the
    image paths of an image column -> (rows, masks, images, rows read, rows skipped)."""
    S, N = opts.seq_len, opts.num_samples
    pad = info.pad_id if info.pad_id is not None else (info.eos_id or 0)
    rows: list[list[int]] = []
    masks: list[list[int]] = []
    images: list[list[str]] | None = [] if image_col is not None else None
    read = skipped = 0
    min_len = opts.effective_min_len
    cols = [col] if image_col is None else [col, image_col]
    for k, row in enumerate(ds.select_columns([*cols, _ROW] if opts.shuffle else cols)):
        i = row.get(_ROW, k)
        if len(rows) >= N:
            break
        read += 1
        ids = tokenize(row[col], i, images=image_col is not None)[:S]
        if len(ids) < min_len:
            skipped += 1
            continue
        if images is not None:
            images.append(_image_paths(row[image_col], base, f"{source}: row {i}"))
        masks.append([1] * len(ids) + [0] * (S - len(ids)))
        rows.append(ids + [pad] * (S - len(ids)))
    if not rows:
        raise CalibrationDataError(
            f"{source}: none of {read} row(s) has at least min_len={min_len} tokens, so "
            f"the calibration set is empty; lower min_len / seq_len or enable packing."
        )
    return rows, masks, images, read, skipped


def build_calibration_set(
    model_dir: str | os.PathLike,
    dataset: str | os.PathLike = "default",
    *,
    num_samples: int | None = None,
    seq_len: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    packing: bool = True,
    min_len: int | None = None,
    column: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> CalibrationSet:
    """A :class:`CalibrationSet` for the checkpoint at ``model_dir`` from ``dataset``.

    ``num_samples`` / ``seq_len`` default to the dataset definition's values, else 128 /
    512. Fewer samples than requested come back when the data runs out (``describe()``
    shows both); none at all is an error.
    """
    resolved = resolve_dataset(dataset)
    d = resolved.definition
    opts = CalibrationOptions(
        num_samples=num_samples
        if num_samples is not None
        else (d.num_samples if d and d.num_samples else 128),
        seq_len=seq_len if seq_len is not None else (d.seq_len if d and d.seq_len else 512),
        seed=seed,
        shuffle=shuffle,
        packing=packing,
        min_len=min_len,
        column=column or (d.column if d else None),
    )
    opts.check()
    info = model_info(model_dir)
    if info.max_positions is not None and opts.seq_len > info.max_positions:
        raise CalibrationDataError(
            f"seq_len {opts.seq_len} is beyond the model's max_position_embeddings "
            f"{info.max_positions} ({info.model_dir / 'config.json'}); use seq_len <= "
            f"{info.max_positions}."
        )
    source = resolved.source if resolved.kind != "hub" else f"{HUB_PREFIX}{resolved.source}"
    ds = load_rows(resolved, cache_dir=cache_dir)
    if len(ds) == 0:
        raise CalibrationDataError(f"{source}: the dataset is empty (0 rows); give it rows.")
    col = _pick_column(ds, opts.column, source)
    image_col = next((c for c in IMAGE_COLUMNS if c in ds.column_names), None)
    if image_col is not None and not info.has_vision:
        raise CalibrationDataError(
            f"{source}: column '{image_col}' holds images, but {info.model_dir} is a "
            f"text-only model (config.json has no vision_config); drop the image column or "
            f"calibrate a model with a vision tower."
        )
    if opts.shuffle:
        # error messages name a row by its place in the file, not in the shuffled order
        ds = ds.add_column(_ROW, list(range(len(ds)))).shuffle(seed=opts.seed)
    base = resolved.files[0].parent if resolved.files else None
    from .rows import RowTokenizer

    tokenize = RowTokenizer(info, source, col)
    if opts.packing and image_col is None:
        rows, masks, read, skipped = _packed_samples(ds, col, tokenize, opts, info, source)
        images = None
    else:
        rows, masks, images, read, skipped = _row_samples(
            ds, col, image_col, tokenize, opts, info, base, source
        )
    input_ids = torch.tensor(rows, dtype=torch.int64)
    attention_mask = torch.tensor(masks, dtype=torch.int64)
    options = asdict(opts)
    options["column"] = col
    options["packing"] = opts.packing and image_col is None
    return CalibrationSet(
        input_ids=input_ids,
        attention_mask=attention_mask,
        source=source,
        fingerprint=fingerprint(input_ids, attention_mask, options, images),
        images=images,
        options=options,
        tokenizer=info.tokenizer_name,
        rows_read=read,
        rows_skipped=skipped,
    )

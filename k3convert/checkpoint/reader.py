"""``open_checkpoint``: lazy, validated access to a Hugging Face model directory.

Opening reads only headers (and, for packed int-N weights, the two-int ``weight_shape``
tensors). Data is mapped one tensor at a time when asked for, so memory follows what
the caller holds, never the checkpoint size. Physical tensors that belong together
(a weight and its scales / zero points / activation scales) are grouped under one
logical name, so every consumer sees ``...weight`` with an encoding.

A tensor's encoding is decided from what is stored (the registry in
:mod:`k3convert.formats`), never from config.json: a quantization_config that claims a
Linear quantized while the file stores it plain (the Kimi K3 release's ``ignore`` list
misses some bf16 Linears) reads as plain, and the claim is kept as data in
:attr:`Checkpoint.claimed_plain` for ``inspect`` to report.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError, UnsafePickleError
from ..formats import FORMATS
from .encodings import (
    ALL_PARTS,
    ENCODINGS,
    FP8_DTYPES,
    QuantParams,
    detect_encoding,
)
from .output import refuse_partial
from .safetensors_io import RawTensorInfo, map_tensor, open_regular, read_header

INDEX_NAMES = ("model.safetensors.index.json",)
BIN_INDEX_NAMES = ("pytorch_model.bin.index.json",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_HASH_CHUNK = 8 << 20
#: dtypes a packed weight's ``weight_shape`` part may have (it holds [out, in])
_INT_DTYPES = (
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)


@dataclass(frozen=True, slots=True)
class PartMeta:
    """One physical tensor: where it lives and what it is (no data)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    raw: RawTensorInfo | None = None  # None for torch .bin tensors


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A logical tensor: its shape once dequantized and the physical parts storing it."""

    name: str
    shape: tuple[int, ...]
    encoding: str  # "plain" or a key of ENCODINGS
    parts: dict[str, PartMeta]
    quant: QuantParams = field(default_factory=QuantParams)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def main(self) -> PartMeta:
        for k in ("weight", "weight_packed"):
            if k in self.parts:
                return self.parts[k]
        return next(iter(self.parts.values()))

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the main stored part (e.g. float8_e4m3fn, int32 for packed)."""
        return self.main.dtype

    @property
    def file(self) -> Path:
        return self.main.file

    @property
    def storage(self) -> str:
        """Human label of how the values are stored: 'bfloat16', 'float8_e4m3fn', 'int4',
        'mxfp4', 'nvfp4'."""
        if self.encoding == "pack-quantized":
            return f"int{self.quant.num_bits}" if self.quant.num_bits else "int?"
        label = FORMATS[self.encoding].storage_label if self.encoding in FORMATS else None
        return label or str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FileInfo:
    path: Path
    size: int


def load_json(path: Path, kind: str = "config") -> dict:
    """A config / index JSON object of the model directory: a regular file under its size
    cap, strict JSON (:mod:`.bounded`)."""
    from .bounded import read_json

    return read_json(path, kind, CheckpointError)


def _split_part(name: str) -> tuple[str, str]:
    """``a.b.weight_scale`` -> (``a.b``, ``weight_scale``); plain names -> (name, '')."""
    head, _, tail = name.rpartition(".")
    if head and tail in ALL_PARTS:
        return head, tail
    return name, ""


class QuantConfig:
    """Resolves config.json's quantization_config to per-tensor QuantParams."""

    def __init__(self, qc: dict | None):
        self.qc = qc or {}
        self.method = self.qc.get("quant_method")
        self.groups: list[tuple[list[str], dict]] = []
        self.formats: list[str | None] = []
        if self.method == "compressed-tensors":
            for gname, g in (self.qc.get("config_groups") or {}).items():
                if not isinstance(g, dict):
                    raise ConfigError(
                        f"config.json: quantization_config.config_groups.{gname} must be an object."
                    )
                self.groups.append((list(g.get("targets") or []), g.get("weights") or {}))
                self.formats.append(g.get("format") or self.qc.get("format"))
        # ``ignore`` compiled once: exact module names and regexes (a writer may list
        # every kept module of a mixed template by name - 10^5 entries for K3)
        ignore = [t for t in (self.qc.get("ignore") or []) if isinstance(t, str)]
        self._ignore_names = {t for t in ignore if not t.startswith("re:")}
        self._ignore_rx = [re.compile(t[3:]) for t in ignore if t.startswith("re:")]

    def claimed_format(self, module: str) -> str | None:
        """The format a compressed-tensors config.json claims for Linear ``module`` (None:
        not quantized, or in ``ignore``). The class target ``Linear`` is taken to match
        every module but embeddings (the reader sees names, not module classes; inspect
        drops routers, norms and heads by role). DeepSeek's ``fp8`` configs name no
        modules, so they claim nothing."""
        if self.method != "compressed-tensors":
            return None
        if module in self._ignore_names or any(rx.match(module) for rx in self._ignore_rx):
            return None
        for (targets, weights), f in zip(self.groups, self.formats, strict=True):
            if not weights:
                continue
            for t in targets:
                if t == "Linear" and "embed" in module.rpartition(".")[2]:
                    continue
                if _target_matches(t, module):
                    return f or "compressed-tensors"
        return None

    def params(self, module: str, shape: tuple[int, ...]) -> QuantParams:
        if self.method == "fp8":
            b = self.qc.get("weight_block_size") or [128, 128]
            return QuantParams(num_bits=8, block=(int(b[0]), int(b[1])))
        w = self._weights_for(module)
        if not w:
            return QuantParams()
        strategy = w.get("strategy")
        block = None
        if strategy in ("group", "tensor_group") and w.get("group_size"):
            block = (1, int(w["group_size"]))
        elif strategy == "block" and w.get("block_structure"):
            bs = w["block_structure"]
            block = (int(bs[0]), int(bs[1]))
        return QuantParams(
            num_bits=w.get("num_bits"),
            block=block,
            symmetric=w.get("symmetric"),
            extra={"strategy": strategy, "type": w.get("type")},
        )

    def _weights_for(self, module: str) -> dict:
        for targets, weights in self.groups:
            for t in targets:
                if t.startswith("re:"):
                    if re.match(t[3:], module):
                        return weights
                elif t in ("Linear", module):
                    return weights
        return {}


def _target_matches(t: str, module: str) -> bool:
    if t.startswith("re:"):
        return re.match(t[3:], module) is not None
    return t in ("Linear", module)


class Checkpoint:
    """Read-only view of one checkpoint directory. Build it with :func:`open_checkpoint`."""

    #: whether values are stored and cheap to read (False: computed when read, or a
    #: metadata-only description): engine writers check values up front only if so
    values_stored = True

    def __init__(
        self,
        root: Path,
        config: dict,
        metas: dict[str, TensorMeta],
        files,
        claimed_plain: list[tuple[str, str]] | None = None,
    ):
        self.root = root
        self.config = config
        self._metas = metas
        self._files: list[Path] = files
        self._sha: dict[Path, str] = {}
        self._bin_cache: dict[Path, dict] = {}
        self._bin_lock = threading.Lock()
        #: (tensor, format config.json claims) for 2-D weights config.json says are
        #: quantized but the files store plain; they are read as stored (plain)
        self.claimed_plain: list[tuple[str, str]] = list(claimed_plain or [])

    # -- metadata ---------------------------------------------------------------
    def names(self) -> list[str]:
        """Logical tensor names in storage order (file, then offset)."""
        return list(self._metas)

    def __contains__(self, name: str) -> bool:
        return name in self._metas

    def __len__(self) -> int:
        return len(self._metas)

    def meta(self, name: str) -> TensorMeta:
        try:
            return self._metas[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: no tensor named '{name}'.") from None

    def files(self) -> list[FileInfo]:
        return [FileInfo(p, p.stat().st_size) for p in self._files]

    def file_stamps(self) -> list[list]:
        """[path relative to the root, size, mtime_ns] of every weight file: what an
        output written from this checkpoint records to recognise it on a rerun."""
        return [[str(f.path.relative_to(self.root)), f.size, f.path.stat().st_mtime_ns]
                for f in self.files()]  # fmt: skip

    def sha256(self, path: str | os.PathLike) -> str:
        """sha256 of one source file, streamed and cached."""
        p = Path(path)
        if p not in self._sha:
            h = hashlib.sha256()
            with open_regular(p, CheckpointError) as fh:
                while chunk := fh.read(_HASH_CHUNK):
                    h.update(chunk)
            self._sha[p] = h.hexdigest()
        return self._sha[p]

    @cached_property
    def aux_files(self) -> list[Path]:
        """Tokenizer / processor / other non-weight files, carried along untouched
        (k3convert's own ``.k3-*`` bookkeeping files excepted).

        Checked by :func:`open_checkpoint`: none of them resolves outside the directory.
        """
        skip = {"config.json", *INDEX_NAMES, *BIN_INDEX_NAMES}
        files = []
        for p in sorted(self.root.iterdir()):
            if p.name in skip or p.name.endswith(WEIGHT_SUFFIXES) or p.name.startswith(".k3-"):
                continue  # (.k3-*: k3convert's own bookkeeping, not the model's)
            if _regular(p, "file (carried into outputs)", missing_ok=True, dir_ok=True):
                files.append(p)
        for f in files:
            _check_inside(self.root, f, "file (carried into outputs)")
        return files

    # -- data -------------------------------------------------------------------
    def get_parts(self, name: str) -> dict[str, torch.Tensor]:
        """The stored physical tensors of ``name``, keyed by part ('weight_scale', ...)."""
        m = self.meta(name)
        return {k: self._load_part(p) for k, p in m.parts.items()}

    def part_tensor(self, name: str, part: str) -> torch.Tensor:
        """One stored physical tensor of ``name`` (``get_parts(name)[part]`` alone)."""
        return self._load_part(self.meta(name).parts[part])

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, dequantized if encoded (float32 unless ``dtype``)."""
        m = self.meta(name)
        if m.encoding == "plain":
            t = self._load_part(m.main)
            return t if dtype is None or t.dtype == dtype else t.to(dtype)
        parts = self.get_parts(name)
        try:
            return ENCODINGS[m.encoding].dequantize_to(parts, m.quant, dtype)
        except ValueError as e:
            raise CheckpointError(
                f"{m.file}: cannot dequantize '{name}' ({m.encoding}): {e}."
            ) from e

    def iter_tensors(self, dtype=None) -> Iterator[tuple[str, torch.Tensor]]:
        for n in self.names():
            yield n, self.get(n, dtype)

    def _load_part(self, p: PartMeta) -> torch.Tensor:
        if p.raw is not None:
            return map_tensor(p.file, p.raw)
        return self._bin(p.file)[p.name]

    def _bin(self, path: Path) -> dict:
        with self._bin_lock:  # units / tensors are read on several threads
            got = self._bin_cache.get(path)
            if got is None:
                got = load_bin(path)
                self._bin_cache = {path: got}  # keep one file mapped at a time
            return got

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.root)!r}, {len(self)} tensors, {len(self._files)} files)"


def load_bin(path: Path) -> dict:
    """A torch .bin/.pt state dict via the safe unpickler only (weights_only, mmap)."""
    _regular(path, "weight file")  # torch.load would block on a FIFO
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises UnpicklingError / RuntimeError variants
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unpickl" in type(e).__name__:
            raise UnsafePickleError(
                f"{path}: refused - loading it needs full unpickling, which can run "
                f"arbitrary code ({msg[:200]}). Convert it to safetensors in a trusted "
                f"environment first."
            ) from e
        raise CheckpointError(
            f"{path}: cannot load as a PyTorch zip checkpoint ({msg[:200]}). Legacy "
            f"(non-zip) files are not supported; re-save with torch.save or convert to "
            f"safetensors."
        ) from e
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors (a state dict).")
    return sd


def _resolved(p: Path) -> Path:
    try:
        return p.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise CheckpointError(
            f"{p}: cannot resolve the path ({e}); fix or remove the symbolic link."
        ) from e


def _allowed_roots(root: Path) -> list[Path]:
    """Where the files of ``root`` may really live: the directory itself, and for a
    Hugging Face hub-cache snapshot (``models--X/snapshots/REV``, whose files are links
    to ``../../blobs/SHA``) that model's own ``blobs`` directory."""
    r = _resolved(root)
    roots = [r]
    if r.parent.name == "snapshots" and r.parent.parent.name.startswith("models--"):
        roots.append(r.parent.parent / "blobs")
    return roots


def _outside(root: Path, p: Path) -> Path | None:
    """Where ``p`` really is if that is outside ``root`` (after every symlink), else None."""
    real = _resolved(p)
    return None if any(real.is_relative_to(a) for a in _allowed_roots(root)) else real


def _check_inside(root: Path, p: Path, what: str) -> None:
    """Refuse a file of the model directory that resolves (by a symlink) outside it."""
    real = _outside(root, p)
    if real is not None:
        raise CheckpointError(
            f"{p}: {what} resolves to {real}, outside the model directory {root}; "
            f"k3convert reads nothing outside it - copy the real file in (`cp -L`) or "
            f"remove the link."
        )


def _regular(p: Path, what: str, *, missing_ok: bool = False, dir_ok: bool = False) -> bool:
    """Whether ``p`` (after symlinks) is a regular file, without opening it: False when it
    does not exist (``missing_ok``) or is a directory (``dir_ok``); a FIFO, socket or
    device - which would block or never end when read - is refused, naming it."""
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        if missing_ok:
            return False
        raise CheckpointError(f"{p}: {what} does not exist.") from None
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read the {what} ({e.strerror}).") from e
    if stat.S_ISREG(mode):
        return True
    if dir_ok and stat.S_ISDIR(mode):
        return False
    kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO, socket or device"
    raise CheckpointError(
        f"{p}: {what} is {kind}, not a regular file; k3convert reads only regular files "
        f"(a FIFO would hang every command) - replace it with the real file or remove it."
    )


def _weight_files(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """Weight files to read and the index's weight_map (None without an index).

    Every file must resolve inside ``root``: an index entry or a symlink that leads
    elsewhere is refused, so nothing outside the model directory is ever read.
    """
    for idx_name in INDEX_NAMES + BIN_INDEX_NAMES:
        idx = root / idx_name
        if _regular(idx, "index", missing_ok=True):
            _check_inside(root, idx, "index")
            data = load_json(idx, "index")
            wm = data.get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise CheckpointError(f"{idx}: 'weight_map' must map tensor names to files.")
            files = sorted(set(wm.values()))
            for f in files:
                real = None if Path(f).is_absolute() else _outside(root, root / f)
                if Path(f).is_absolute() or real is not None:
                    users = [k for k, v in wm.items() if v == f]
                    to = f" (it resolves to {real})" if real is not None else ""
                    more = f" (and {len(users) - 1} more)" if len(users) > 1 else ""
                    raise CheckpointError(
                        f"{idx}: weight_map entry '{users[0]}'{more} names '{f}', outside "
                        f"the model directory {root}{to}; weight files must be inside it - "
                        f"put the file in {root} and name it relative to the directory."
                    )
                if not _regular(root / f, "weight file", missing_ok=True):
                    users = [k for k, v in wm.items() if v == f]
                    raise CheckpointError(
                        f"{idx}: names file '{f}' (for {len(users)} tensors, e.g. "
                        f"'{users[0]}') but it does not exist in {root}; the download is "
                        f"incomplete."
                    )
            return [root / f for f in files], wm
    st = sorted(root.glob("*.safetensors"))
    if not st:
        st = sorted(p for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    for f in st:
        _regular(f, "weight file")
        _check_inside(root, f, "weight file")
    return st, None


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a Hugging Face model directory (or a single .safetensors/.bin file).

    Validates every header, the index, and the grouping of quantized parts up front;
    reads no tensor data.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory.")
    if not p.is_dir():
        _regular(p, "checkpoint file")
    refuse_partial(p)
    if p.is_file():
        if p.suffix not in WEIGHT_SUFFIXES:
            raise CheckpointError(
                f"{p}: not a checkpoint; give a model directory, a .safetensors / .bin file, "
                f"or (for inspect) its config.json."
            )
        root, files, wm = p.parent, [p], None
    else:
        root = p
        files, wm = _weight_files(root)
    cfg_path = root / "config.json"
    if _regular(cfg_path, "config", missing_ok=True):
        _check_inside(root, cfg_path, "config")
        config = load_json(cfg_path)
    else:
        config = {}
    if not files:
        if (root / "manifest.json").is_file():  # a stream's commit marker (stream.format)
            raise CheckpointError(
                f"{root}: a k3convert stream (it has a manifest.json), not a checkpoint; "
                f"shard and quantize read the checkpoint a stream was cut from (to change "
                f"the layout, shard that again). `k3convert verify {root}` runs this one, "
                f"`k3convert inspect {root}` describes it."
            )
        hint = (
            f" For parameter arithmetic on a config alone use `k3convert inspect {cfg_path}`."
            if cfg_path.is_file()
            else " Is this the model directory (it has no config.json either)?"
        )
        raise CheckpointError(
            f"{root}: no weights found (expected model.safetensors, *.safetensors with "
            f"model.safetensors.index.json, or pytorch_model*.bin).{hint}"
        )
    raw: dict[str, PartMeta] = {}
    for f in files:
        for part in _file_parts(f):
            if part.name in raw:
                raise CheckpointError(
                    f"tensor '{part.name}' is listed twice: in {raw[part.name].file.name} "
                    f"and {f.name}; remove the duplicate file or fix the index."
                )
            raw[part.name] = part
    if wm is not None:
        _check_index(root, wm, raw)
    qcfg = QuantConfig(quant_config_of(config))
    claims: list[tuple[str, str]] = []
    metas = group_parts(raw, qcfg, claims)
    ck = Checkpoint(root, config, metas, files, claims)
    ck.aux_files  # noqa: B018  (refuses an aux file that links outside, up front)
    return ck


def quant_config_of(config: dict) -> dict | None:
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    return qc


def _file_parts(f: Path) -> Iterator[PartMeta]:
    if f.suffix == ".safetensors":
        h = read_header(f)
        for info in sorted(h.tensors.values(), key=lambda t: t.start):
            yield PartMeta(info.name, f, info.dtype, info.shape, info.nbytes, info)
    else:
        for name, t in load_bin(f).items():
            yield PartMeta(name, f, t.dtype, tuple(t.shape), t.numel() * t.element_size())


def _check_index(root: Path, wm: dict[str, str], raw: dict[str, PartMeta]) -> None:
    missing = [n for n in wm if n not in raw]
    if missing:
        raise CheckpointError(
            f"{root}: the index lists {len(missing)} tensor(s) that are in no weight file "
            f"(e.g. '{missing[0]}' expected in {wm[missing[0]]}); the files and the index "
            f"disagree."
        )
    wrong = [n for n, pm in raw.items() if n in wm and pm.file != root / wm[n]]
    extra = [n for n in raw if n not in wm]
    if wrong or extra:
        n = (wrong or extra)[0]
        raise CheckpointError(
            f"{root}: tensor '{n}' is in {raw[n].file.name} but the index "
            f"{'puts it in ' + wm[n] if n in wm else 'does not list it'}; regenerate "
            f"the index."
        )


#: the dtypes a described checkpoint's tensors may have (what safetensors files store)
_DESCRIBED_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
              torch.float8_e4m3fn, torch.float8_e5m2, *_INT_DTYPES, torch.bool)
}  # fmt: skip


def described_checkpoint(root: Path, config: dict, doc, where: str,
                         max_bytes: int | None = None) -> Checkpoint:  # fmt: skip
    """A metadata-only :class:`Checkpoint` (names, parts, shapes, encodings; no values)
    from the tensor list a planned checkpoint wrote of itself (``layout_doc``:
    ``{"tensors": [[name, dtype, shape], ...], "shapes": {logical: shape}}``) and its
    config. ``where`` names the file in errors (ValueError: a malformed list, an empty
    tensor, or more than ``max_bytes`` of tensors, refused as soon as it is exceeded)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), list):
        raise ValueError(f"{where}: not a tensor list ('tensors' missing)")
    if not isinstance(config, dict) or not isinstance(quant_config_of(config), dict | None):
        raise ValueError("config.json: quantization_config is not an object")
    shapes = doc.get("shapes")
    if not isinstance(shapes, dict):
        raise ValueError(f"{where}: 'shapes' must be an object")

    def dims(v, what: str) -> tuple[int, ...]:
        if not isinstance(v, list) or not all(type(d) is int and d >= 0 for d in v):
            raise ValueError(f"{where}: {what}: shape {v!r} is not a list of sizes")
        return tuple(v)

    raw: dict[str, PartMeta] = {}
    total = 0
    for e in doc["tensors"]:
        if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and e[0]):
            raise ValueError(f"{where}: entry {e!r} is not [name, dtype, shape]")
        name, dt = e[0], _DESCRIBED_DTYPES.get(e[1]) if isinstance(e[1], str) else None
        if dt is None or name in raw:
            raise ValueError(f"{where}: '{name}': unknown dtype {e[1]!r} or listed twice")
        shape = dims(e[2], name)
        n = 1
        for d in shape:
            n *= d
        total += n * dt.itemsize
        if n == 0 or (max_bytes is not None and total > max_bytes):
            raise ValueError(f"'{name}': empty, or more tensor bytes than {max_bytes}")
        raw[name] = PartMeta(name, root / where, dt, shape, n * dt.itemsize, None)
    logical = {k: dims(v, k) for k, v in shapes.items()}
    metas = group_parts(raw, QuantConfig(quant_config_of(config)), None, logical)
    ck = Checkpoint(Path(root), config, metas, [])
    ck.values_stored = False
    return ck


def group_parts(
    raw: dict[str, PartMeta],
    qcfg: QuantConfig,
    claims: list[tuple[str, str]] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, TensorMeta]:
    """Physical tensors grouped into logical ones. ``shapes``: logical shapes known
    without reading data (a planned, not yet written checkpoint), used for encodings that
    store theirs as a tensor (``weight_shape``)."""
    groups: dict[str, dict[str, PartMeta]] = {}
    for name, pm in raw.items():
        base, part = _split_part(name)
        if not part:
            groups.setdefault(name, {})[""] = pm
            continue
        groups.setdefault(f"{base}.weight", {})[part] = pm
    metas: dict[str, TensorMeta] = {}
    for logical, parts in groups.items():
        module = logical.removesuffix(".weight")
        if "" in parts:
            if len(parts) > 1:
                raise CheckpointError(f"tensor '{logical}' appears both plain and as parts.")
            pm = parts[""]
            metas[logical] = TensorMeta(logical, pm.shape, "plain", {"weight": pm})
            _note_claim(claims, qcfg, logical, module, pm)
            continue
        sig = {k: (v.shape, v.dtype) for k, v in parts.items()}
        if "weight" not in parts and "weight_packed" not in parts:
            # activation-only parameters (e.g. a kv-cache scale): plain tensors of their own
            for _k, pm in parts.items():
                metas[pm.name] = TensorMeta(pm.name, pm.shape, "plain", {"weight": pm})
            continue
        enc = detect_encoding(logical, sig)
        if enc is None:
            w = parts["weight"]
            fp8 = w.dtype in FP8_DTYPES and len(w.shape) == 2
            if fp8 and qcfg.method in ("fp8", "compressed-tensors"):
                raise CheckpointError(
                    f"{w.file}: '{logical}' is stored as {w.dtype} but has no "
                    f"weight_scale_inv / weight_scale; the checkpoint is incomplete."
                )
            shape = w.shape
            metas[logical] = TensorMeta(logical, shape, "plain", parts)
            _note_claim(claims, qcfg, logical, module, w)
            continue
        shape = enc.stored_shape(sig)
        if shape is None and shapes is not None and logical in shapes:
            shape = tuple(shapes[logical])
        if shape is None:  # the logical shape is stored as data: [out, in]
            shape = _stored_shape(logical, parts[enc.shape_part], parts.get("weight_packed"))
        q = qcfg.params(module, shape)
        try:
            q = enc.resolve_quant(logical, sig, shape, q)
        except CheckpointError as e:
            raise CheckpointError(f"{enc_file(enc, parts)}: {e}") from None
        metas[logical] = TensorMeta(logical, shape, enc.name, parts, q)
        _check_scales(metas[logical])
    return metas


def enc_file(enc, parts: dict[str, PartMeta]) -> Path:
    """The file of an encoded tensor's values part (for messages)."""
    return parts[enc.values_part].file


def _note_claim(claims, qcfg: QuantConfig, logical: str, module: str, pm: PartMeta) -> None:
    if claims is None or len(pm.shape) != 2 or not logical.endswith(".weight"):
        return
    claimed = qcfg.claimed_format(module)
    if claimed is not None:
        claims.append((logical, claimed))


def _stored_shape(logical: str, sp: PartMeta, packed: PartMeta | None) -> tuple[int, int]:
    """A packed weight's [out, in] from its ``weight_shape`` part, checked against the
    packed words (int32 [out, ceil(in * bits / 32)] for some bits in 1..8)."""
    if sp.raw is None:
        raise CheckpointError(f"'{logical}': packed weights must come from safetensors.")
    where = f"{sp.file}: tensor '{sp.name}'"
    fix = "the checkpoint is corrupt - re-export or re-download it."
    dtype = str(sp.dtype).removeprefix("torch.")
    if sp.dtype not in _INT_DTYPES or sp.shape != (2,):
        raise CheckpointError(
            f"{where} must hold the two integers [out, in] of '{logical}' but is "
            f"{dtype}{list(sp.shape)}; {fix}"
        )
    out, inp = map_tensor(sp.file, sp.raw).tolist()
    if packed is None:
        return out, inp
    if packed.dtype != torch.int32 or len(packed.shape) != 2:
        raise CheckpointError(
            f"{packed.file}: tensor '{packed.name}' must be int32 [out, words] but is "
            f"{str(packed.dtype).removeprefix('torch.')}{list(packed.shape)}; {fix}"
        )
    rows, words = packed.shape
    fits = any(-(-inp * b // 32) == words for b in range(1, 9))
    if out < 1 or inp < 1 or out != rows or not fits:
        raise CheckpointError(
            f"{where} says [{out}, {inp}], but '{packed.name}' is int32 "
            f"{list(packed.shape)}, which does not hold {out} x {inp} values of 1..8 bits; "
            f"{fix}"
        )
    return out, inp


def _check_scales(m: TensorMeta) -> None:
    """Catch scale / weight shape disagreements at open time, not mid-conversion."""
    enc = ENCODINGS[m.encoding]
    if len(m.shape) != 2:
        raise CheckpointError(f"{m.file}: encoded tensor '{m.name}' must be 2-D, got {m.shape}.")
    sig = {k: (v.shape, v.dtype) for k, v in m.parts.items()}
    why = enc.problem(m.name, m.shape, sig, m.quant)
    if why:
        s = m.parts[enc.scale_part]
        raise CheckpointError(f"{s.file}: '{m.name}' {m.encoding}: {why}.")

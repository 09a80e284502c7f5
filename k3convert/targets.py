"""Output targets: what ``shard --target``, a recipe's ``output.format``, ``convert``,
``shard --check`` and ``verify`` consult instead of lists of their own.

A :class:`Target` names a kind of output k3convert writes, the families it writes them
for, how to recognise a directory it wrote and how to check one. Adding a target (an
engine's pre-sharded format) means one entry here and its own module under
``engines/``; the modules are imported only when a target is used, so ``--help`` stays
fast.
"""

from __future__ import annotations

import difflib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError


@dataclass(frozen=True)
class Target:
    name: str
    #: one line for ``--help`` and the docs
    summary: str
    #: "module:function" of ``is_output(path) -> bool``: whether a directory is this
    #: target's complete output
    is_output_fn: str
    #: "module:function" of ``check(path) -> str``: the one-line verdict of an intact
    #: output, StreamCorruptError (exit 1) naming the first problem otherwise
    check_fn: str | None
    #: "module:NAME" of the ``model_type`` -> engine class mapping this target writes;
    #: None: every family k3convert reads
    families_attr: str | None = None
    #: the families of ``families_attr`` as ``--help`` names them (kept here, not imported
    #: from the engine module, so ``--help`` stays fast; tests/test_vllm_target.py checks
    #: it names exactly that mapping's model types, and the README's list too)
    families_help: str = ""
    #: "module:function" of ``convert(recipe, *, src, out, force, progress, report_html,
    #: verify, log, keep_intermediate) -> (report, files written, files kept from an
    #: interrupted run, verify report)``, the job ``convert`` runs for a recipe's
    #: ``output.format`` of this target; None: convert's own pipeline (the stream)
    convert_fn: str | None = None
    #: "module:function" of ``summary(report) -> str``, convert's summary of that report
    summary_fn: str | None = None
    #: an engine's pre-sharded files (tied to one serving engine: the serving check runs
    #: for the machine's device), not an engine-neutral format
    engine: bool = False
    #: "module:function" of ``shard(src, out, *, tp, pp, ep, force, progress,
    #: before_write) -> str`` (the written summary line; ``before_write(checkpoint)``: the
    #: serving check): ``shard --target NAME``; None: the stream
    shard_fn: str | None = None
    #: "module:callable" of ``source(path, *, check) -> weight source`` that ``verify`` runs a
    #: written directory from (every tensor mapped back from the rank files)
    source_fn: str | None = None

    def _load(self, ref: str):
        mod, name = ref.split(":")
        return getattr(importlib.import_module(mod, __package__), name)

    def is_output(self, path: str | os.PathLike) -> bool:
        return bool(self._load(self.is_output_fn)(Path(path)))

    def check(self, path: str | os.PathLike) -> str:
        if self.check_fn is None:
            raise ConfigError(f"--target {self.name} has no check of its own.")
        return self._load(self.check_fn)(Path(path))

    def families(self) -> tuple[str, ...] | None:
        return None if self.families_attr is None else tuple(self._load(self.families_attr))

    def convert(self, recipe, **kw):
        return self._load(self.convert_fn)(recipe, **kw)

    def shard(self, src, out, **kw) -> str:
        return self._load(self.shard_fn)(src, out, **kw)

    def source(self, path: str | os.PathLike, check: bool):
        return self._load(self.source_fn)(Path(path), check=check)

    def render(self, report: dict) -> str:
        """convert's summary of ``report`` (``summary_fn``)."""
        return self._load(self.summary_fn)(report)


TARGETS: dict[str, Target] = {
    "stream": Target(
        "stream",
        "k3convert's per-rank, layer-ordered streaming format (formats/musa-stream.md), "
        "run by verify / forward",
        ".stream.format:is_stream_dir",
        None,  # (shard --check reports a stream with a CheckReport of its own)
    ),
    "vllm": Target(
        "vllm",
        "vLLM's pre-sharded files for load_format='sharded_state', one per tp / pp rank",
        ".engines.vllm_index:is_vllm_dir",
        ".engines.vllm_index:check_vllm",
        ".engines.vllm_sharded:FAMILIES",
        "llama, qwen2, qwen3, mistral, qwen3_moe, deepseek_v3 / kimi_k2 and kimi_k3",
        convert_fn=".pipeline.convert_vllm:convert_target",
        summary_fn=".pipeline.convert_vllm:render_vllm_summary",
        engine=True,
        shard_fn=".engines.vllm_write:shard_target",
        source_fn=".engines.vllm_source:VllmSource",
    ),
}


def target_help() -> str:
    """``shard --target``'s help: each target, its summary and the families it writes."""
    return (
        " or ".join(
            f"{t.name} ({t.summary}"
            + (f"; {t.families_help}; --tp / --pp / --ep" if t.families_help else "")
            + ")"
            for t in TARGETS.values()
        )
        + "."
    )


def names() -> tuple[str, ...]:
    return tuple(TARGETS)


def get(name: str, where: str = "--target") -> Target:
    """The target called ``name``; ConfigError naming the choices (and the nearest)."""
    t = TARGETS.get(name) if isinstance(name, str) else None
    if t is not None:
        return t
    near = difflib.get_close_matches(str(name), TARGETS, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise ConfigError(f"{where}: '{name}' is not a target{hint}; choose {' or '.join(TARGETS)}.")


def written_by(path: str | os.PathLike) -> Target | None:
    """The target whose complete output ``path`` is, or None."""
    for t in TARGETS.values():
        if t.is_output(path):
            return t
    return None

"""One calibration row's value -> token ids, by the kind its type says: text (the
checkpoint's tokenizer), a chat (its chat template, rendered under bounds:
:mod:`.chat_template`), or ids given as they are (checked against the vocabulary and the
model's image placeholders)."""

from __future__ import annotations

from typing import Any

from ..checkpoint.tokenizer_files import is_panic, one_line, quiet_panics
from .data import CalibrationDataError, ModelInfo


def kind_of(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "input_ids"
        if all(isinstance(v, dict) for v in value):
            return "messages"
    return None


class RowTokenizer:
    """A row value -> token ids, by the kind its type says."""

    def __init__(self, info: ModelInfo, source: str, column: str):
        self.info, self.source, self.column = info, source, column

    def __call__(self, value: Any, row: int, *, images: bool = False) -> list[int]:
        """The row's ids; ``images``: the row comes with images, so it may hold the
        model's image / video placeholder tokens (a row without images may not)."""
        ids = self._ids(value, row)
        media = sorted(self.info.media_ids.intersection(ids)) if not images else []
        if media:
            n = sum(i in media for i in ids)
            others = (self.info.vocab_size or 0) - len(self.info.media_ids)
            raise CalibrationDataError(
                f"{self.source}: row {row}, column '{self.column}': holds {n} image / video "
                f"placeholder token(s) (id {', '.join(map(str, media))}) but the row has no "
                f"image; drop those ids from the row (random ids: draw them from the other "
                f"{others} ids) or give the row an image column.")  # fmt: skip
        return ids

    def _ids(self, value: Any, row: int) -> list[int]:
        kind = kind_of(value)
        where = f"{self.source}: row {row}, column '{self.column}'"
        if kind is None:
            raise CalibrationDataError(
                f"{where}: expected a string, a list of chat messages or a list of token "
                f"ids, got {type(value).__name__} {str(value)[:60]!r}."
            )
        tok = self.info.tokenizer
        if kind == "input_ids":
            ids = [int(v) for v in value]
        elif tok is None:
            raise CalibrationDataError(
                f"{where}: is {kind}, which needs a tokenizer, but {self.info.model_dir} "
                f"{self.info.no_tokenizer}. Or give pre-tokenized data: a .jsonl with an "
                f"'input_ids' column of integer lists."
            )
        elif kind == "text":
            ids = self._encode(value, True, where)
        else:
            if not getattr(tok, "chat_template", None):
                raise CalibrationDataError(
                    f"{where}: chat messages need a chat template, and the tokenizer of "
                    f"{self.info.model_dir} has none; use a 'text' column instead."
                )
            for m in value:
                if not isinstance(m.get("role"), str) or "content" not in m:
                    raise CalibrationDataError(
                        f"{where}: every message needs 'role' and 'content', got {str(m)[:60]!r}."
                    )
            rendered = self._render(value, where)
            ids = self._encode(rendered, False, where)
        v = self.info.vocab_size
        bad = [i for i in ids if i < 0 or (v is not None and i >= v)]
        if bad:
            raise CalibrationDataError(
                f"{where}: token id {bad[0]} is outside the model's vocabulary "
                f"(0..{(v or 0) - 1}); the ids were made for another tokenizer."
            )
        return ids

    def _encode(self, text: str, special: bool, where: str) -> list[int]:
        try:
            with quiet_panics():
                return list(self.info.tokenizer(text, add_special_tokens=special)["input_ids"])
        except BaseException as e:  # a Rust panic of the tokenizers library on this text
            if not is_panic(e):
                raise
            raise CalibrationDataError(
                f"{where}: the tokenizer of {self.info.model_dir} crashed on this row "
                f"(tokenizers panic: {one_line(e, 200)}); its tokenizer.json is damaged - "
                f"fix it, or pre-tokenize the data into an 'input_ids' column."
            ) from None

    def _render(self, messages: list, where: str) -> str:
        """The row's chat rendered as transformers' ``apply_chat_template(messages,
        tokenize=False)`` renders it, but bounded (:func:`render_chat_template`)."""
        tok = self.info.tokenizer
        source = str(self.info.template_file or self.info.model_dir)
        try:
            template = tok.get_chat_template()
        except (ValueError, TypeError) as e:
            raise CalibrationDataError(f"{source}: {one_line(e, 300)}") from None
        if not isinstance(template, str):
            raise CalibrationDataError(f"{source}: the chat template must be a string.")
        special = getattr(tok, "special_tokens_map", None) or {}
        variables = {**special, "tools": None, "documents": None, "add_generation_prompt": False}
        from .chat_template import chat_messages, render_chat_template

        variables["messages"] = chat_messages(messages)
        return render_chat_template(template, variables, where=where, source=source)

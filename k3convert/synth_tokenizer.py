"""The tokenizer ``synth`` writes next to a synthetic checkpoint.

A rehearsal model needs a tokenizer for everything that starts from text: calibration on
the built-in corpus, ``verify --data file.txt``, chat data. The release's own tokenizer
is not at hand (and Kimi's runs custom code, which k3convert never runs), so synth writes
a small byte-level BPE in the Hugging Face ``tokenizers`` JSON format: the 256 byte
symbols (GPT-2's byte-to-unicode table), no merges, the config's special tokens (BOS,
EOS, PAD, image / video placeholders) at the ids config.json gives them (BOS / EOS at the
top ids when it gives none), every other id a reserved token that no text maps to. Any text encodes
and decodes back exactly; ``transformers.AutoTokenizer`` loads it as a
``PreTrainedTokenizerFast`` without remote code. Plain JSON: no tokenizer library is
needed to write it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError

#: config.json keys whose ids become special tokens, and the token each one gets
SPECIAL_KEYS = {
    "bos_token_id": "<|bos|>",
    "eos_token_id": "<|eos|>",
    "pad_token_id": "<|pad|>",
    "image_token_id": "<|image|>",
    "video_token_id": "<|video|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "media_placeholder_token_id": "<|media_pad|>",
}
#: what a chat row renders to (calibration on chat messages needs a template)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
FILES = ("tokenizer.json", "tokenizer_config.json")
#: the most ids one special-token key of config.json may list: a release lists a handful
#: (Llama 3.1's eos_token_id has three); each id becomes a token of the tokenizer
MAX_SPECIAL_IDS = 1024


def byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE writes bytes 0..255 as (GPT-2's table:
    printable Latin-1 bytes stand for themselves, the others are shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _ids(value) -> list[int]:
    vals = value if isinstance(value, list) else [value]
    return [v for v in vals if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def check_special_ids(cfg: dict, text: dict) -> None:
    """ConfigError for a special-token key (``eos_token_id``, ...) listing more than
    :data:`MAX_SPECIAL_IDS` ids: no tokenizer has that many, and the config is damaged."""
    for key in SPECIAL_KEYS:
        for d in (text, cfg):
            v = d.get(key)
            if isinstance(v, list) and len(v) > MAX_SPECIAL_IDS:
                where = "" if d is cfg else "text_config."
                raise ConfigError(
                    f"config.json: {where}{key} lists {len(v)} ids, more than the "
                    f"{MAX_SPECIAL_IDS} any tokenizer has special tokens for; the config is "
                    f"damaged - keep the model's real ids (a handful)."
                )


def special_tokens(cfg: dict, text: dict, vocab: int) -> tuple[dict[int, str], dict[str, str]]:
    """(id -> token, role -> token) for the special ids of config.json below ``vocab``
    (text section first, then the top level). Every id is its own token (a second EOS id
    is ``<|eos_1|>``); an id two roles share (BOS = EOS) is one token both roles name. A
    config without BOS / EOS (K3's) gets them at the top free ids."""
    check_special_ids(cfg, text)
    by_id: dict[int, str] = {}
    roles: dict[str, str] = {}
    for key, token in SPECIAL_KEYS.items():
        ids: dict[int, None] = {}  # the ids in order, each once (a set of what is seen)
        for d in (text, cfg):
            ids.update((i, None) for i in _ids(d.get(key)) if i < vocab)
        for k, i in enumerate(ids):
            by_id.setdefault(i, token if k == 0 else token.replace("|>", f"_{k}|>"))
        if ids:
            roles[key.removesuffix("_token_id")] = by_id[next(iter(ids))]
    for role in ("eos", "bos"):
        top = next((i for i in range(vocab - 1, -1, -1) if i not in by_id), None)
        if role not in roles and top is not None:
            by_id[top] = roles[role] = f"<|{role}|>"
    return by_id, roles


def tokenizer_files(cfg: dict, text: dict, vocab: int) -> dict[str, str] | None:
    """{file name: JSON text}, or None when ``vocab`` cannot hold the 256 bytes next to
    the special tokens."""
    specials, roles = special_tokens(cfg, text, vocab)
    if vocab < 256 + len(specials):
        return None
    free = (i for i in range(vocab) if i not in specials)
    byte_vocab = {sym: next(free) for sym in byte_symbols()}
    # one entry per id, as the releases' tokenizers have (loaders renumber added tokens
    # past a shorter vocabulary): the specials, and the ids no text maps to reserved
    byte_vocab.update({t: i for i, t in specials.items()})
    byte_vocab.update({f"<|reserved_{i}|>": i for i in free})
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in sorted(specials.items())
    ]  # fmt: skip
    by_token = {t: i for i, t in specials.items()}
    bos = roles.get("bos")
    post = None
    if bos is not None:  # BOS first, as the releases' tokenizers add it
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [by_token[bos]], "tokens": [bos]}},
        }  # fmt: skip
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}  # fmt: skip
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": post,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": byte_vocab, "merges": []},
    }  # fmt: skip
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
            "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}  # fmt: skip
    for role in ("bos", "eos", "pad"):
        if role in roles:
            conf[f"{role}_token"] = roles[role]
    conf.setdefault("pad_token", roles["eos"])
    return {
        "tokenizer.json": json.dumps(tok, ensure_ascii=False, indent=1) + "\n",
        "tokenizer_config.json": json.dumps(conf, indent=2) + "\n",
    }


def write_tokenizer(folder: Path, cfg: dict, text: dict, vocab: int) -> bool:
    """Write the tokenizer files into ``folder``; False when the vocabulary is too small."""
    files = tokenizer_files(cfg, text, vocab)
    if files is None:
        return False
    for name, body in files.items():
        (folder / name).write_text(body, encoding="utf-8")
    return True

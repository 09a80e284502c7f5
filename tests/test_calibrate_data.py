"""Calibration data (k3convert.calibrate.data): every input kind, packing, per-row rules,
seed determinism, fingerprints and every user error.

The expected token ids are computed here with the tokenizer transformers loads
(AutoTokenizer) and with datasets' own shuffle, not with k3convert's code.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from k3convert.calibrate import (
    CalibrationDataError,
    build_calibration_set,
    builtin_corpus,
    load_definitions,
    resolve_dataset,
)
from k3convert.errors import ConfigError, K3Error

SENTENCES = [
    "the keeper climbed the tower and trimmed the lamp",
    "a ship passed the rocks in the dark and saw the light",
    "weights are divided by a scale and rounded to four bits",
    "the router picks two experts for every token",
    "bread needs flour water salt and yeast",
    "the log book lists every ship that passed the headland",
]
TEMPLATE = "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
EOS, PAD = 3, 1


def _config(d: Path, vocab: int, *, max_pos: int = 64, vision: bool = False, **extra) -> None:
    cfg = {"model_type": "llama", "max_position_embeddings": max_pos, "vocab_size": vocab}
    if vision:
        cfg = {"model_type": "kimi_k25", "text_config": cfg, "vision_config": {"depth": 2}}
    cfg.update(extra)
    (d / "config.json").write_text(json.dumps(cfg))


def _tokenizer_dir(d: Path, sentences: list[str], *, vision: bool = False) -> Path:
    d.mkdir(parents=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"])
    tok.train_from_iterator(sentences, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
        eos_token="</s>",
    )  # fmt: skip
    fast.chat_template = TEMPLATE
    fast.save_pretrained(d)
    _config(d, len(fast), vision=vision)
    return d


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return _tokenizer_dir(tmp_path_factory.mktemp("calib") / "model", SENTENCES)


@pytest.fixture(scope="module")
def tok(model):
    t = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
    assert t.eos_token_id == EOS and t.pad_token_id == PAD
    return t


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _packed(streams: list[list[int]], seq_len: int, n: int) -> torch.Tensor:
    flat: list[int] = []
    for ids in streams:
        flat += ids + ([] if ids[-1] == EOS else [EOS])
    blocks = [flat[k : k + seq_len] for k in range(0, len(flat) - seq_len + 1, seq_len)][:n]
    return torch.tensor(blocks, dtype=torch.int64)


# -- input kinds ------------------------------------------------------------------------------
def test_text_jsonl_packing_equals_concatenation(model, tok, tmp_path):
    f = _jsonl(tmp_path / "t.jsonl", [{"text": s, "other": 1} for s in SENTENCES])
    cs = build_calibration_set(model, f, num_samples=100, seq_len=8, shuffle=False)
    want = _packed([tok(s)["input_ids"] for s in SENTENCES], 8, 100)
    assert want.shape[0] == sum(len(tok(s)["input_ids"]) + 1 for s in SENTENCES) // 8
    assert torch.equal(cs.input_ids, want)
    assert cs.input_ids.dtype == torch.int64 and torch.equal(
        cs.attention_mask, torch.ones_like(want)
    )
    assert cs.images is None and cs.source == str(f.resolve())
    d = cs.describe()
    assert d["tokens"] == want.numel() and d["options"]["column"] == "text"
    assert d["rows_read"] == len(SENTENCES) and len(cs.fingerprint) == 64
    # num_samples caps the blocks; reading stops once enough tokens are there
    few = build_calibration_set(model, f, num_samples=2, seq_len=8, shuffle=False)
    assert torch.equal(few.input_ids, want[:2]) and few.rows_read < len(SENTENCES)


def test_json_parquet_txt_give_the_same_rows(model, tok, tmp_path):
    rows = [{"text": s} for s in SENTENCES]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    (tmp_path / "a.txt").write_text("\n\n".join(SENTENCES) + "\n")
    ref = build_calibration_set(
        model, _jsonl(tmp_path / "a.jsonl", rows), num_samples=50, seq_len=8, shuffle=False
    )
    for name in ("a.json", "a.parquet", "a.txt"):
        cs = build_calibration_set(model, tmp_path / name, num_samples=50, seq_len=8, shuffle=False)
        assert torch.equal(cs.input_ids, ref.input_ids), name
    # a directory of one file kind reads every file, in name order
    dd = tmp_path / "dir"
    dd.mkdir()
    _jsonl(dd / "1.jsonl", rows[:3])
    _jsonl(dd / "2.jsonl", rows[3:])
    cs = build_calibration_set(model, dd, num_samples=50, seq_len=8, shuffle=False)
    assert torch.equal(cs.input_ids, ref.input_ids)


def test_messages_use_the_chat_template(model, tok, tmp_path):
    chats = [
        [{"role": "user", "content": SENTENCES[i]}, {"role": "assistant", "content": s}]
        for i, s in zip(range(0, 6, 2), SENTENCES[1::2], strict=True)
    ]
    f = _jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in chats])
    cs = build_calibration_set(model, f, num_samples=10, seq_len=64, packing=False, min_len=1,
                               shuffle=False)  # fmt: skip
    for i, c in enumerate(chats):
        rendered = tok.apply_chat_template(c, tokenize=False)
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        assert rendered.startswith("<s> user : ") and ids[0] == 2 and ids[-1] == EOS
        assert cs.input_ids[i, : len(ids)].tolist() == ids
        assert cs.attention_mask[i].sum() == len(ids)
        assert (cs.input_ids[i, len(ids) :] == PAD).all()
    assert cs.options["column"] == "messages"


def test_pretokenized_ids_without_tokenizer(tmp_path):
    d = tmp_path / "notok"
    d.mkdir()
    _config(d, 100, eos_token_id=[7, 8])
    rows = [{"input_ids": list(range(10 + i, 20 + i))} for i in range(5)]
    f = _jsonl(tmp_path / "ids.jsonl", rows)
    cs = build_calibration_set(d, f, num_samples=20, seq_len=11, shuffle=False)
    flat = [t for r in rows for t in [*r["input_ids"], 7]]  # first eos id of the list
    assert cs.input_ids.flatten().tolist() == flat[: len(flat) // 11 * 11]
    assert cs.tokenizer is None
    # text data needs a tokenizer
    t = _jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    with pytest.raises(CalibrationDataError, match=r"no tokenizer files.*input_ids"):
        build_calibration_set(d, t, seq_len=8)
    # ids beyond the vocabulary were made for another tokenizer
    # (named by its row in the file, not in the shuffled order)
    bad = _jsonl(
        tmp_path / "bad.jsonl", [{"input_ids": [1, 2, 100 if i == 3 else 3]} for i in range(6)]
    )
    for seed in range(3):
        with pytest.raises(CalibrationDataError, match="row 3, column 'input_ids': token id 100"):
            build_calibration_set(d, bad, seq_len=2, seed=seed)


def test_one_sample_per_row_truncates_skips_and_pads(model, tok, tmp_path):
    texts = ["the keeper", SENTENCES[1], "bread needs flour water salt and yeast"]
    f = _jsonl(tmp_path / "r.jsonl", [{"text": t} for t in texts])
    lens = [len(tok(t)["input_ids"]) for t in texts]
    assert lens == [2, 12, 7]
    # default min_len = seq_len: only full rows, truncated to seq_len
    full = build_calibration_set(model, f, seq_len=6, packing=False, shuffle=False)
    assert full.input_ids.tolist() == [
        tok(texts[1])["input_ids"][:6],
        tok(texts[2])["input_ids"][:6],
    ]
    assert full.rows_skipped == 1 and bool(full.attention_mask.all())
    padded = build_calibration_set(model, f, seq_len=8, packing=False, min_len=3, shuffle=False)
    assert padded.input_ids[1].tolist() == tok(texts[2])["input_ids"] + [PAD]
    assert padded.attention_mask.tolist() == [[1] * 8, [1] * 7 + [0]]
    assert padded.describe()["padded_tokens"] == 1 and padded.rows_skipped == 1


def test_builtin_default_set_and_definitions(model):
    corpus = builtin_corpus()
    assert corpus == builtin_corpus() and len(corpus) > 80
    assert corpus[0].startswith("Notes on converting") and sum(map(len, corpus)) > 400_000
    defs = load_definitions()
    assert {"default", "chat"} <= set(defs) and defs["default"].seq_len == 512
    assert resolve_dataset("default").kind == "builtin"
    assert resolve_dataset("chat").files[0].name == "chat.jsonl"
    cs = build_calibration_set(model, "default", num_samples=4, seq_len=32)
    assert cs.input_ids.shape == (4, 32) and cs.source == "builtin:default"
    assert cs.options["num_samples"] == 4 and bool(cs.attention_mask.all())
    chat = build_calibration_set(model, "chat", seq_len=64, packing=False, min_len=4)
    assert chat.options["column"] == "messages" and chat.num_samples == 8


def test_definitions_from_env_dir(model, tok, tmp_path, monkeypatch):
    (tmp_path / "defs").mkdir()
    _jsonl(tmp_path / "defs" / "mine.jsonl", [{"body": s} for s in SENTENCES])
    (tmp_path / "defs" / "mine.yaml").write_text(
        "name: mine\nsource: mine.jsonl\ncolumn: body\nnum_samples: 3\nseq_len: 5\n"
    )
    monkeypatch.setenv("K3CONVERT_CALIBRATION_DIR", str(tmp_path / "defs"))
    cs = build_calibration_set(model, "mine", shuffle=False)
    assert cs.input_ids.shape == (3, 5) and cs.options["column"] == "body"
    assert torch.equal(cs.input_ids, _packed([tok(s)["input_ids"] for s in SENTENCES], 5, 3))
    (tmp_path / "defs" / "bad.yaml").write_text("name: bad\nsource: mine.jsonl\nseq_len: -1\n")
    with pytest.raises(CalibrationDataError, match=r"bad\.yaml: 'seq_len' must be a positive"):
        build_calibration_set(model, "mine")


def test_cached_hub_dataset_offline(model, tok, tmp_path, monkeypatch):
    # lay out a datasets cache entry as a hub load leaves it: <ns>___<name>/<config>/<v>/<h>
    rows = _jsonl(tmp_path / "h.jsonl", [{"text": s} for s in SENTENCES])
    datasets.load_dataset(
        "json", data_files=str(rows), split="train", cache_dir=str(tmp_path / "b")
    )
    src = next(p for p in (tmp_path / "b" / "json").glob("*/*/*") if p.is_dir())
    dst = tmp_path / "hf" / "someorg___tiny_text" / "default" / "0.0.0" / src.name
    shutil.copytree(src, dst)
    for f in dst.glob("json-*.arrow"):
        f.rename(f.with_name(f.name.replace("json-", "tiny_text-")))
    # online flags as a user without HF_HUB_OFFLINE has them; any connection attempt fails
    import datasets.config as dconfig
    import huggingface_hub.constants as hconst

    monkeypatch.setattr(dconfig, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hconst, "HF_HUB_OFFLINE", False)

    attempts = []  # datasets swallows connection errors, so record every attempt

    def no_network(*a, **k):
        attempts.append(a[:2])
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    cs = build_calibration_set(model, "someorg/tiny_text", num_samples=50, seq_len=8,
                               shuffle=False, cache_dir=tmp_path / "hf")  # fmt: skip
    assert cs.source == "hub:someorg/tiny_text"
    assert torch.equal(cs.input_ids, _packed([tok(s)["input_ids"] for s in SENTENCES], 8, 50))
    assert attempts == []  # (a plain datasets.load_dataset of the same name tries the hub)
    assert dconfig.HF_HUB_OFFLINE is False and hconst.HF_HUB_OFFLINE is False  # restored
    with pytest.raises(CalibrationDataError, match="not in the local Hugging Face datasets cache"):
        build_calibration_set(model, "someorg/other", seq_len=8, cache_dir=tmp_path / "hf")
    assert attempts == []


# -- seeds and fingerprints -------------------------------------------------------------------
def test_seed_determinism_follows_datasets_shuffle(model, tok, tmp_path):
    f = _jsonl(tmp_path / "s.jsonl", [{"text": s} for s in SENTENCES])
    a = build_calibration_set(model, f, num_samples=50, seq_len=4, seed=5)
    b = build_calibration_set(model, f, num_samples=50, seq_len=4, seed=5)
    c = build_calibration_set(model, f, num_samples=50, seq_len=4, seed=6)
    assert torch.equal(a.input_ids, b.input_ids) and a.fingerprint == b.fingerprint
    assert not torch.equal(a.input_ids, c.input_ids) and a.fingerprint != c.fingerprint
    order = datasets.Dataset.from_list([{"text": s} for s in SENTENCES]).shuffle(seed=5)["text"]
    assert torch.equal(a.input_ids, _packed([tok(s)["input_ids"] for s in order], 4, 50))


def test_fingerprint_changes_with_every_input(model, tmp_path, tmp_path_factory):
    f = _jsonl(tmp_path / "f.jsonl", [{"text": s} for s in SENTENCES])
    g = _jsonl(tmp_path / "g.jsonl", [{"text": s} for s in [*SENTENCES[:-1], "the lamp"]])
    base = dict(num_samples=20, seq_len=6, seed=0)  # every row is used
    fp = build_calibration_set(model, f, **base).fingerprint
    assert build_calibration_set(model, f, **base).fingerprint == fp
    # the same words counted differently: WordLevel numbers its vocabulary by frequency
    other_tok = _tokenizer_dir(tmp_path_factory.mktemp("tok2") / "m", [*SENTENCES, "yeast " * 9])
    variants = [
        build_calibration_set(model, g, **base),  # data
        build_calibration_set(model, f, **{**base, "seq_len": 5}),
        build_calibration_set(model, f, **{**base, "num_samples": 3}),
        build_calibration_set(model, f, **{**base, "seed": 1}),
        build_calibration_set(model, f, **base, shuffle=False),
        build_calibration_set(model, f, **base, packing=False, min_len=2),
        build_calibration_set(other_tok, f, **base),  # same text, other ids
    ]
    prints = [v.fingerprint for v in variants]
    assert fp not in prints and len(set(prints)) == len(prints)


# -- images -----------------------------------------------------------------------------------
def test_images_need_a_vision_tower(model, tmp_path):
    (tmp_path / "img").mkdir()
    for n in ("a.png", "b.png"):
        (tmp_path / "img" / n).write_bytes(b"\x89PNG\r\n\x1a\n")
    vlm = tmp_path / "vlm"
    shutil.copytree(model, vlm)
    _config(vlm, json.loads((model / "config.json").read_text())["vocab_size"], vision=True)
    rows = [
        {"text": SENTENCES[0], "images": ["img/a.png", "img/b.png"]},
        {"text": SENTENCES[1], "images": [str(tmp_path / "img" / "b.png")]},
    ]
    f = _jsonl(tmp_path / "v.jsonl", rows)
    cs = build_calibration_set(vlm, f, seq_len=16, min_len=1, shuffle=False)
    img = tmp_path.resolve() / "img"
    assert cs.images == [[str(img / "a.png"), str(img / "b.png")], [str(img / "b.png")]]
    assert cs.num_samples == 2 and cs.options["packing"] is False
    assert cs.describe()["images"] == 3
    one = _jsonl(tmp_path / "one.jsonl", [{"text": SENTENCES[0], "image": "img/a.png"}])
    assert build_calibration_set(vlm, one, seq_len=16, min_len=1).images == [[str(img / "a.png")]]
    with pytest.raises(CalibrationDataError, match="text-only model"):
        build_calibration_set(model, f, seq_len=16, min_len=1)
    missing = _jsonl(tmp_path / "m.jsonl", [{"text": SENTENCES[0], "image": "img/zz.png"}])
    with pytest.raises(CalibrationDataError, match=r"row 0: image img/zz\.png does not exist"):
        build_calibration_set(vlm, missing, seq_len=16, min_len=1)


# -- errors -----------------------------------------------------------------------------------
def test_user_errors(model, tmp_path):
    f = _jsonl(tmp_path / "e.jsonl", [{"text": s, "id": i} for i, s in enumerate(SENTENCES)])
    one = _jsonl(tmp_path / "one.jsonl", [{"text": SENTENCES[0]}])
    cases = [
        ((tmp_path / "empty.jsonl", {}), "dataset is empty"),
        ((tmp_path / "empty_list.json", {}), "dataset is empty"),
        ((f, {"column": "prompt"}), "column 'prompt' does not exist.*columns text, id"),
        ((f, {"seq_len": 65}), "seq_len 65 is beyond the model's max_position_embeddings 64"),
        ((tmp_path / "nope.jsonl", {}), "path .*nope.jsonl does not exist"),
        ((str(tmp_path / "nodir" / "x"), {}), "does not exist"),
        (("not_cached_org/not_cached_ds", {"cache_dir": tmp_path}), "never downloads"),
        ((f, {"seq_len": 60, "min_len": 60, "packing": False}), "none of 6 row"),
        ((one, {"seq_len": 64}), "1 row.*fewer than one seq_len block of 64"),
        ((f, {"num_samples": 0}), "num_samples must be a positive integer"),
        ((f, {"min_len": 9, "seq_len": 8}), "min_len must be between 1 and seq_len"),
        ((_jsonl(tmp_path / "n.jsonl", [{"x": 1}]), {}), "no 'input_ids', 'messages' or 'text'"),
        ((tmp_path / "broken.jsonl", {}), "broken.jsonl: could not be read as json"),
        ((tmp_path / "mixed", {}), r"mixes file kinds \(json, text\)"),
        (("defualt", {"cache_dir": tmp_path}), r"calibration/\*\.yaml defines: chat, default"),
        ((_jsonl(tmp_path / "i.jsonl", [{"text": 5}]), {}), "row 0, column 'text': expected"),
    ]
    (tmp_path / "broken.jsonl").write_text('{"text": "unterminated\n')
    (tmp_path / "mixed").mkdir()
    _jsonl(tmp_path / "mixed" / "a.jsonl", [{"text": "a"}])
    (tmp_path / "mixed" / "b.txt").write_text("b")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty_list.json").write_text("[]")
    for (ds, kw), msg in cases:
        kw = {"seq_len": 8, **kw}
        with pytest.raises(CalibrationDataError, match=msg) as e:
            build_calibration_set(model, ds, **kw)
        assert isinstance(e.value, ConfigError) and isinstance(e.value, K3Error)
    with pytest.raises(CalibrationDataError, match=r"model directory .* does not exist"):
        build_calibration_set(tmp_path / "no_model", f, seq_len=8)


def test_model_code_never_runs(model, tmp_path):
    evil = tmp_path / "evil"
    shutil.copytree(model, evil)
    cfg = json.loads((evil / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    cfg["tokenizer_class"] = "EvilTokenizer"
    (evil / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "RAN"
    (evil / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    with pytest.raises(CalibrationDataError, match="never runs model code"):
        build_calibration_set(evil, "default", num_samples=2, seq_len=8)
    assert not marker.exists()


def test_media_placeholder_in_a_row_without_image_is_named_with_its_fix(tmp_path):
    """Random ids that hit the image placeholder fail at the data, naming the row, the id
    and the fix (before: the runtime's 'no pixel_values were given' mid-calibration)."""
    d = tmp_path / "vl"
    d.mkdir()
    _config(d, 100, vision=True, media_placeholder_token_id=99)
    rows = [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 99, 6, 99]}]
    f = _jsonl(tmp_path / "ids.jsonl", rows)
    with pytest.raises(CalibrationDataError) as e:
        build_calibration_set(d, f, seq_len=4, shuffle=False)
    msg = str(e.value)
    assert "row 1" in msg and "2 image / video placeholder token(s) (id 99)" in msg
    assert "drop those ids" in msg and "other 99 ids" in msg
    ok = _jsonl(tmp_path / "ok.jsonl", [rows[0], {"input_ids": [5, 98, 6, 7]}])
    assert build_calibration_set(d, ok, seq_len=4, shuffle=False).input_ids.shape[1] == 4


def test_synth_tokenizer_calibrates_the_builtin_corpus(tmp_path):
    """synth writes a byte-level tokenizer that transformers loads without remote code:
    any text round-trips, BOS leads, and the default (built-in) corpus calibrates the
    tiny model with no pre-tokenized file."""
    from k3convert.synth import synthesize

    out = tmp_path / "k3"
    synthesize(config="kimi-k3", out=out, tiny=True)
    tok = AutoTokenizer.from_pretrained(out)
    text = "héllo wörld, 日本語 <x>\n\tend"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text
    cfg = json.loads((out / "config.json").read_text())
    media = cfg["media_placeholder_token_id"]
    assert tok.convert_ids_to_tokens(media) == "<|media_pad|>" and media not in ids
    cs = build_calibration_set(out, "default", num_samples=4, seq_len=64)
    assert cs.input_ids.shape == (4, 64) and "vocab 512" in cs.tokenizer
    assert int(cs.input_ids.max()) < cfg["text_config"]["vocab_size"]

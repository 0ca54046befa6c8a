"""Tokenizer loading: byte, a BPE trained on the fly, HF files, tiktoken files/names, sentencepiece."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from conftest import shared_path
from shardkit.text.tokenizers import load_tokenizer, train_bpe

TEXTS = ["Hello, world! Ünïcödé text, numbers 12345 and <|endoftext|> literally.",
         "The quick brown fox jumps over the lazy dog. " * 20, "日本語のテキスト", "a"]
CORPUS = [f"document {i}: the cat sat on the mat while {i % 7} dogs barked loudly." for i in range(400)]


def test_byte_round_trip():
    tok = load_tokenizer("byte")
    ids = tok.encode(TEXTS[0])
    assert ids.max() < 256 and len(ids) == len(TEXTS[0].encode())
    assert tok.decode(ids) == TEXTS[0]
    assert tok.info.kind == "byte" and tok.info.eos_id == 256 and tok.info.vocab_size == 258
    assert [len(x) for x in tok.encode_batch(TEXTS)] == [len(t.encode()) for t in TEXTS]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(CORPUS, vocab_size=400, output=path)
    return path


def test_trained_bpe_loads_by_file_and_directory(trained):
    tok = load_tokenizer(str(trained))
    assert tok.info.kind == "hf" and tok.info.eos_id == 0 and 257 + 20 < tok.info.vocab_size <= 400
    assert tok.info.vocab_sha256 == hashlib.sha256(trained.read_bytes()).hexdigest()
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(CORPUS[0])) < len(CORPUS[0])  # merges were learned
    by_dir = load_tokenizer(str(trained.parent))
    assert by_dir.encode(CORPUS[1]).tolist() == tok.encode(CORPUS[1]).tolist()


def test_hf_directory_config_names_eos(trained, tmp_path):
    directory = tmp_path / "hf"
    directory.mkdir()
    shutil.copy(trained, directory / "tokenizer.json")
    vocab = json.loads(trained.read_text())["model"]["vocab"]
    some = next(t for t in vocab if t not in ("<|endoftext|>",))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": some}))
    assert load_tokenizer(str(directory)).info.eos_id == vocab[some]


def test_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   model_type="bpe", minloglevel=2)
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    assert tok.info.kind == "sentencepiece" and tok.info.eos_id == 2 and tok.info.vocab_size == 60
    assert tok.decode(tok.encode(CORPUS[3])) == CORPUS[3]


def test_bad_specs():
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_tokenizer("/nonexistent/tokenizer.json")
    with pytest.raises(ValueError, match="vocab_size= must be at least"):  # a Python call: its keyword
        train_bpe(CORPUS, vocab_size=100)


@pytest.mark.shared
@pytest.mark.parametrize("name, vocab, eos", [("r50k_base", 50257, 50256), ("cl100k_base", 100277, 100257),
                                              ("o200k_base", 200019, 199999)])
def test_tiktoken_files(name, vocab, eos):
    path = shared_path(f"tokenizers/{name}.tiktoken")
    tok = load_tokenizer(str(path))
    assert tok.info.vocab_size == vocab and tok.info.eos_id == eos
    # the identity hash equals the file's own sha256 (canonical .tiktoken layout)
    assert tok.info.vocab_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.dtype == np.uint32 and tok.decode(ids) == text
        assert eos not in ids.tolist()  # special-token text is encoded as ordinary text


@pytest.mark.shared
def test_tiktoken_name_honours_cache_dir(tmp_path, monkeypatch):
    """tiktoken:NAME loads through tiktoken's own cache (files named by the sha1 of their URL)."""
    path = shared_path("tokenizers/r50k_base.tiktoken")
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    shutil.copy(path, tmp_path / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    by_name = load_tokenizer("tiktoken:r50k_base")
    by_file = load_tokenizer(str(path))
    assert by_name.info.name == "tiktoken:r50k_base"
    assert by_name.info.vocab_sha256 == by_file.info.vocab_sha256
    assert by_name.encode(TEXTS[1]).tolist() == by_file.encode(TEXTS[1]).tolist()


@pytest.mark.shared
def test_gpt2_hf_matches_tiktoken_on_real_text():
    import zstandard
    hf = load_tokenizer(str(shared_path("tokenizers/gpt2_hf_tokenizer.json")))
    tk = load_tokenizer(str(shared_path("tokenizers/r50k_base.tiktoken")))
    assert hf.info.eos_id == tk.info.eos_id == 50256
    with zstandard.ZstdDecompressor().stream_reader(open(shared_path("corpora/prose.jsonl.zst"), "rb")) as reader:
        head = reader.read(400_000).split(b"\n")[:-1]
    texts = [json.loads(line)["text"][:20000] for line in head][:10]
    for a, b in zip(hf.encode_batch(texts), tk.encode_batch(texts)):
        assert a.tolist() == b.tolist()


# -- long documents are encoded in bounded pieces with the whole document's ids (#10 item 8) ----------
TRICKY = ["a", "Zeta", "é", "ß", "ǅ", "字", "😀", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "1", "23", "456", ".",
          ",", "!?", "<|endoftext|>", "\u00a0", "\u3000", "e\u0301", "_", "-", "ʼ"]


def real_prose(chars: int) -> str:
    import zstandard

    with zstandard.ZstdDecompressor().stream_reader(open(shared_path("corpora/prose.jsonl.zst"), "rb")) as reader:
        head = reader.read(3 * chars).split(b"\n")[:-1]
    return "\n\n".join(json.loads(line)["text"] for line in head)[:chars]


def encoded_in_pieces(tokenizer, text: str, piece_chars: int) -> tuple[np.ndarray, int]:
    """`tokenizer.encode(text)` with pieces of `piece_chars`, and the longest text the tokenizer itself saw."""
    seen = []
    encode_many = tokenizer._encode_many

    def recording(texts):
        seen.extend(len(t) for t in texts)
        return encode_many(texts)

    tokenizer._encode_many, tokenizer.piece_chars = recording, piece_chars
    try:
        return tokenizer.encode(text), max(seen)
    finally:
        del tokenizer._encode_many, tokenizer.piece_chars


@pytest.mark.shared
@pytest.mark.parametrize("spec", ["tokenizers/gpt2_hf_tokenizer.json", "tokenizers/cl100k_base.tiktoken",
                                  "tokenizers/o200k_base.tiktoken", "byte"])
def test_long_documents_are_encoded_in_pieces_with_the_whole_documents_ids(spec):
    tokenizer = load_tokenizer(spec if spec == "byte" else str(shared_path(spec)))
    assert tokenizer.splits_safely
    text = real_prose(300_000)
    whole = tokenizer._encode_many([text])[0]
    pieced, longest = encoded_in_pieces(tokenizer, text, 997)
    assert np.array_equal(pieced, whole) and len(whole) > 50_000
    assert longest < 997 + 200  # the tokenizer never saw more than a piece (a cut waits for a safe point)
    # Hostile mixtures: runs of spaces, newlines, contractions, digits, marks, emoji, CJK, specials' text.
    import random

    rng = random.Random(7)
    for _ in range(60):
        text = "".join(rng.choice(TRICKY) for _ in range(rng.randint(100, 400)))
        pieced, _ = encoded_in_pieces(tokenizer, text, rng.randint(3, 50))
        assert np.array_equal(pieced, tokenizer._encode_many([text])[0]), repr(text)


def test_tokenizers_that_may_not_split_encode_whole(tmp_path, trained):
    """A normalizer (or any pre-tokenizer but the byte-level regex) may join text across a cut: whole."""
    assert load_tokenizer(str(trained)).splits_safely  # byte-level BPE, as `shardkit tokenizer train` writes
    definition = json.loads(trained.read_text())
    definition["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "lower.json").write_text(json.dumps(definition))
    lower = load_tokenizer(str(tmp_path / "lower.json"))
    assert not lower.splits_safely
    text = "The Cat sat " * 50_000
    lower.piece_chars = 100
    assert lower.encode(text).tolist() == lower._encode_many([text])[0].tolist()

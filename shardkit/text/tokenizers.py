"""Tokenizers for the build and the loaders, behind one small contract: `load_tokenizer(spec) -> Tokenizer`.

A spec names the tokenizer so that it can be reloaded later (it is recorded in the manifest):

- ``byte``: UTF-8 bytes (ids 0-255), ``<|endoftext|>`` = 256, ``<|bos|>`` = 257; no dependencies.
- a path to an HF ``tokenizer.json`` or to a directory holding one (``tokenizers`` package).
- a ``.tiktoken`` file (ranks loaded with ``tiktoken.load.load_tiktoken_bpe``; the split pattern and
  special tokens of r50k/gpt2, cl100k or o200k are chosen from the file name, else from the vocabulary
  size), or ``tiktoken:NAME`` (``tiktoken.get_encoding``, which honours ``TIKTOKEN_CACHE_DIR``).
- a sentencepiece ``.model`` file.

Every tokenizer encodes to numpy arrays and never adds special tokens itself: the build decides
where EOS/BOS go (between documents), so all kinds behave the same way.

Long documents are encoded in pieces of about `PIECE_CHARS` characters, cut only at a space that follows
a non-space and precedes a letter. Byte-level BPE tokenizers (GPT-2 / tiktoken patterns, HF ByteLevel)
split text into pre-tokens with a regex before merging, and that regex always starts a pre-token at such
a space and never lets one cross it, so the pieces' ids concatenate to exactly the whole document's
(tested on real tokenizers). Memory then stays bounded by a piece, not the document: HF `tokenizers`
keeps ~100 bytes of offsets and strings per token, ~1 GB for a 10 MB document. Tokenizers for which
this does not hold (sentencepiece, HF tokenizers with normalizers or other pre-tokenizers) encode
documents whole.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from shardkit.errors import MissingExtraError, optional_module
from shardkit.hashing import file_sha256
from shardkit.manifest import TokenizerInfo
from shardkit.storage import atomic_path
from shardkit.wording import option

logger = logging.getLogger(__name__)

# Names an EOS / BOS / PAD token commonly has in HF and sentencepiece vocabularies, most specific first.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
# tiktoken encodings whose split pattern a bare .tiktoken file can use, by rank count.
_TIKTOKEN_BY_VOCAB = {50256: "r50k_base", 100256: "cl100k_base", 199998: "o200k_base"}
_TIKTOKEN_NAME_HINTS = (("o200k", "o200k_base"), ("cl100k", "cl100k_base"), ("p50k", "p50k_base"),
                        ("r50k", "r50k_base"), ("gpt2", "gpt2"))


PIECE_CHARS = 1 << 18  # ~30 MB of HF encoding state per piece; larger pieces are no faster
# A space after a non-space and before a letter: every byte-level BPE pre-tokenizer regex starts a
# pre-token there (" word") and has no pattern that ends with or crosses it.
_SAFE_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")


def safe_pieces(text: str, piece_chars: int = PIECE_CHARS) -> list[tuple[int, int]]:
    """(start, end) of consecutive pieces of `text`, each at least `piece_chars` long (but the last),
    cut at the first safe cut at or after every `piece_chars`; a text without one is a single piece."""
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        cut = _SAFE_CUT.search(text, start + piece_chars)
        if cut is None:
            break
        pieces.append((start, cut.start()))
        start = cut.start()
    pieces.append((start, len(text)))
    return pieces


class Tokenizer:
    """A loaded tokenizer. Subclasses implement `_encode_many` and `decode`.

    Attributes:
        info: identity recorded in the manifest (`name` is the spec that reloads it).
        splits_safely: encoding a text gives the same ids as encoding its `safe_pieces` one by one.
        piece_chars: texts longer than this are encoded in pieces (when `splits_safely`).
    """

    info: TokenizerInfo
    splits_safely: bool = False
    piece_chars: int = PIECE_CHARS

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no special tokens added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, as integer numpy arrays; long texts are encoded piece by piece."""
        texts = list(texts)
        long = [i for i, text in enumerate(texts) if len(text) > self.piece_chars] if self.splits_safely else []
        if not long:
            return self._encode_many(texts)
        out: list[np.ndarray | None] = [None] * len(texts)
        short = [i for i, text in enumerate(texts) if len(text) <= self.piece_chars]
        for i, ids in zip(short, self._encode_many([texts[i] for i in short])):
            out[i] = ids
        for i in long:
            text = texts[i]
            pieces = [self._encode_many([text[a:b]])[0] for a, b in safe_pieces(text, self.piece_chars)]
            out[i] = np.concatenate(pieces)
        return out

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, plus EOS (256) and BOS (257)."""

    EOS = 256
    BOS = 257
    splits_safely = True  # any cut is safe for bytes

    def __init__(self) -> None:
        self.info = TokenizerInfo(kind="byte", name="byte", vocab_size=258, eos_id=self.EOS, bos_id=self.BOS,
                                  special_ids={"<|endoftext|>": self.EOS, "<|bos|>": self.BOS})

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint16) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")


class TiktokenTokenizer(Tokenizer):
    """A `tiktoken.Encoding`; encodes with the Rust core straight into numpy buffers."""

    splits_safely = True  # regex pre-tokenization, then BPE within each pre-token

    def __init__(self, encoding, *, name: str, vocab_sha256: str | None):
        self.encoding = encoding
        specials = dict(encoding._special_tokens)
        eos = specials.get("<|endoftext|>")
        self.info = TokenizerInfo(kind="tiktoken", name=name, vocab_size=encoding.n_vocab, eos_id=eos,
                                  special_ids=specials, vocab_sha256=vocab_sha256)

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        # disallowed_special=() encodes special-token text as ordinary text, like encode_ordinary,
        # without the regex scan that the default "raise on special text" costs.
        encode = self.encoding.encode_to_numpy
        return [encode(t, disallowed_special=()) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])


def _tiktoken_ranks_sha256(ranks: dict[bytes, int]) -> str:
    """SHA-256 of the ranks in .tiktoken file layout, so `tiktoken:NAME` and its file agree."""
    digest = hashlib.sha256()
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        digest.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return digest.hexdigest()


_PATCH_LOCK = threading.Lock()


def _openai_definition(encoding_name: str, ranks: dict[bytes, int]) -> dict:
    """tiktoken's own definition (split pattern, special tokens) of an OpenAI encoding, with our ranks.

    The constructors in `tiktoken_ext.openai_public` download their ranks; we run them with the
    loader swapped for one that returns the ranks already read from the local file, so the pattern
    and the specials are exactly tiktoken's and never copied here.
    """
    from tiktoken_ext import openai_public

    constructor = getattr(openai_public, encoding_name)
    with _PATCH_LOCK:
        original = openai_public.load_tiktoken_bpe
        openai_public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
        try:
            definition = constructor()
        finally:
            openai_public.load_tiktoken_bpe = original
    return definition


def _load_tiktoken_file(path: Path) -> TiktokenTokenizer:
    tiktoken = optional_module("tiktoken", what=f"the tokenizer {path}", extra="tokenizers")
    from tiktoken.load import load_tiktoken_bpe

    ranks = _read_tokenizer_file(path, str(path), "a .tiktoken ranks file",
                                 lambda file: load_tiktoken_bpe(str(file)))
    stem = path.name.lower()
    encoding_name = next((name for hint, name in _TIKTOKEN_NAME_HINTS if hint in stem), None)
    if encoding_name is None:
        encoding_name = _TIKTOKEN_BY_VOCAB.get(len(ranks))
    if encoding_name is None:
        raise ValueError(f"{option('tokenizer')} {path}: cannot tell which split pattern this .tiktoken file needs "
                         f"({len(ranks)} ranks; known: r50k/gpt2, p50k, cl100k, o200k). Name the file after "
                         "its encoding (e.g. cl100k_base.tiktoken) or use tiktoken:NAME")
    definition = _openai_definition(encoding_name, ranks)
    definition["name"] = path.stem
    encoding = tiktoken.Encoding(**definition)
    return TiktokenTokenizer(encoding, name=str(path), vocab_sha256=_tiktoken_ranks_sha256(ranks))


def _load_tiktoken_name(name: str) -> TiktokenTokenizer:
    tiktoken = optional_module("tiktoken", what=f"the tokenizer tiktoken:{name}", extra="tokenizers")

    try:
        encoding = tiktoken.get_encoding(name)
    except ValueError as err:
        raise ValueError(f"{option('tokenizer')} tiktoken:{name}: {err}") from err
    except Exception as err:  # noqa: BLE001 - a failed download names the network, not tiktoken
        raise OSError(f"{option('tokenizer')} tiktoken:{name}: tiktoken could not load its files "
                      f"({type(err).__name__}: "
                      f"{err}); offline, point TIKTOKEN_CACHE_DIR at a cache holding them, or pass the "
                      ".tiktoken file path instead") from err
    return TiktokenTokenizer(encoding, name=f"tiktoken:{name}",
                             vocab_sha256=_tiktoken_ranks_sha256(encoding._mergeable_ranks))


def _special_from_config(directory: Path) -> dict[str, str]:
    """eos/bos/pad token strings from an HF directory's tokenizer_config.json or special_tokens_map.json."""
    found: dict[str, str] = {}
    for file_name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / file_name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            logger.warning("ignoring %s: %s", path, err)
            continue
        for role in ("eos_token", "bos_token", "pad_token"):
            value = data.get(role)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and role not in found:
                found[role] = value
    return found


def _hf_from_file(path: Path):
    tokenizers = optional_module("tokenizers", what=f"the tokenizer {path}", extra="tokenizers")
    return tokenizers.Tokenizer.from_file(str(path))


def _byte_level_only(tokenizer) -> bool:
    """Whether an HF tokenizer cuts text into pre-tokens with the byte-level regex alone (no normalizer,
    no added token holding whitespace), so pieces cut by `safe_pieces` encode like the whole text. Read from the
    tokenizer's parts, not its whole JSON (serializing and parsing the vocabulary cost 0.24 s per load)."""
    try:
        pre_tokenizer = tokenizer.pre_tokenizer
        pre = json.loads(pre_tokenizer.__getstate__()) if pre_tokenizer is not None else {}
        normalizer = tokenizer.normalizer
        added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
    except Exception:  # noqa: BLE001 - an exotic tokenizer: encode whole, never guess
        return False
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = [step for step in steps if step.get("type") == "ByteLevel"]
    if normalizer is not None or len(steps) != 1 or not byte_level or not byte_level[0].get("use_regex", True):
        return False
    return not any(any(c.isspace() for c in content) for content in added)


def _read_tokenizer_file(path: Path, spec: str, what: str, read):
    """`read(path)`, with whatever the tokenizer library raises on a file it cannot use (a JSON file
    that is not a tokenizer, a truncated model, ...) turned into one line naming the file."""
    try:
        return read(path)
    except MissingExtraError:
        raise  # the library is not installed: the error names the extra that installs it
    except OSError as err:
        raise OSError(f"{option('tokenizer')} {spec}: cannot read it: {err.strerror or err}") from err
    except Exception as err:  # noqa: BLE001 - the libraries raise bare Exception / RuntimeError on bad files
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ValueError(f"{option('tokenizer')} {spec}: not {what} ({reason}); expected 'byte', 'tiktoken:NAME', or a "
                         "tokenizer.json, an HF tokenizer directory, a .tiktoken or a .model file") from err


class HFTokenizer(Tokenizer):
    """An HF `tokenizers.Tokenizer` loaded from tokenizer.json."""

    def __init__(self, path: Path, *, spec: str, config_dir: Path | None = None):
        self.tokenizer = _read_tokenizer_file(path, spec, "an HF tokenizer.json", _hf_from_file)
        self._encode_batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        added = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        configured = _special_from_config(config_dir) if config_dir else {}

        def pick(role: str, names: tuple[str, ...]) -> int | None:
            if role in configured:
                token_id = self.tokenizer.token_to_id(configured[role])
                if token_id is not None:
                    return token_id
            for name in names:
                token_id = added.get(name, self.tokenizer.token_to_id(name))
                if token_id is not None:
                    return token_id
            return None

        self.info = TokenizerInfo(kind="hf", name=spec, vocab_size=vocab_size, eos_id=pick("eos_token", _EOS_NAMES),
                                  bos_id=pick("bos_token", _BOS_NAMES), pad_id=pick("pad_token", _PAD_NAMES),
                                  special_ids=added, vocab_sha256=file_sha256(path))
        self._dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
        self.splits_safely = _byte_level_only(self.tokenizer)

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._encode_batch(texts, add_special_tokens=False)
        return [np.array(e.ids, dtype=self._dtype) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model` file."""

    def __init__(self, path: Path, *, spec: str):
        sentencepiece = optional_module("sentencepiece", what=f"the tokenizer {spec}", extra="tokenizers")

        self.processor = _read_tokenizer_file(
            path, spec, "a sentencepiece .model file",
            lambda file: sentencepiece.SentencePieceProcessor(model_file=str(file)))
        size = self.processor.get_piece_size()

        def known(token_id: int) -> int | None:
            return token_id if 0 <= token_id < size else None

        self.info = TokenizerInfo(kind="sentencepiece", name=spec, vocab_size=size,
                                  eos_id=known(self.processor.eos_id()), bos_id=known(self.processor.bos_id()),
                                  pad_id=known(self.processor.pad_id()), vocab_sha256=file_sha256(path))
        self._dtype = np.uint16 if size <= 2**16 else np.uint32

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [np.array(ids, dtype=self._dtype) for ids in self.processor.encode(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode([int(i) for i in ids])


def _special_id(value: int | str | None, tokenizer_value: int | None, option: str, vocab_size: int) -> int | None:
    """A special token id as an option gives it: 'auto' (the tokenizer's own, `tokenizer_value`), None or 'none'
    (no such token), or an integer inside the vocabulary.

    Raises:
        ValueError: naming `option`.
    """
    if value == "auto":
        return tokenizer_value
    if value is None or value == "none":
        return None
    try:
        token_id = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{option} must be an integer id, 'auto' or 'none', got {value!r}") from None
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"{option} {token_id} is outside the tokenizer's vocabulary [0, {vocab_size})")
    return token_id


def with_special_ids(info: TokenizerInfo, *, eos_id: int | str | None = "auto", bos_id: int | str | None = None,
                     options: tuple[str, str] = ("--eos-id", "--bos-id")) -> TokenizerInfo:
    """`info` with the EOS and BOS ids the options give (`_special_id`, named by `options` in errors) and the id
    samples are padded with: the tokenizer's own pad, else EOS, else 0. What `shardkit build` records and the
    raw-text loader packs with, so both give a document the same tokens.

    Raises:
        ValueError: an id outside the vocabulary or not an id, naming its option.
    """
    eos = _special_id(eos_id, info.eos_id, options[0], info.vocab_size)
    bos = _special_id(bos_id, info.bos_id, options[1], info.vocab_size)
    pad = info.pad_id if info.pad_id is not None else (eos if eos is not None else 0)
    return dataclasses.replace(info, eos_id=eos, bos_id=bos, pad_id=pad)


def load_tokenizer(spec: str) -> Tokenizer:
    """Load the tokenizer a spec names (see the module docstring for the accepted forms).

    Raises:
        ValueError: the spec names no known kind of tokenizer.
        FileNotFoundError: the spec is a path that does not exist.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{option('tokenizer')} must be a non-empty spec, got {spec!r}")
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("tiktoken:"):
        return _load_tiktoken_name(spec.split(":", 1)[1])
    path = Path(os.path.expanduser(spec))
    if not path.exists():
        raise FileNotFoundError(f"{option('tokenizer')} {spec}: no such file or directory (expected 'byte', "
                                "'tiktoken:NAME', "
                                "or a path to tokenizer.json, an HF tokenizer directory, a .tiktoken or a .model file)")
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{option('tokenizer')} {spec}: directory has no tokenizer.json (only HF 'fast' tokenizer "
                             "directories are supported)")
        return HFTokenizer(path / "tokenizer.json", spec=spec, config_dir=path)
    if path.suffix == ".tiktoken":
        return _load_tiktoken_file(path)
    if path.suffix == ".model":
        return SentencePieceTokenizer(path, spec=spec)
    if path.suffix == ".json":
        return HFTokenizer(path, spec=spec)
    raise ValueError(f"{option('tokenizer')} {spec}: unrecognised file type {path.suffix!r} "
                     "(expected tokenizer.json, .tiktoken or .model)")


def train_bpe(texts: Iterable[str], *, vocab_size: int, output: str | Path | None = None,
              special_tokens: Sequence[str] = ("<|endoftext|>",), min_frequency: int = 2):
    """Train a byte-level BPE (HF `tokenizers`) on `texts`; save it as tokenizer.json when `output` is set.

    Args:
        texts: training documents.
        vocab_size: final vocabulary size, specials and the 256 byte symbols included.
        output: path of the tokenizer.json to write (parent directories are created).
        special_tokens: added first, so `<|endoftext|>` gets id 0.
        min_frequency: pairs seen fewer times are never merged.

    Returns:
        The trained `tokenizers.Tokenizer`.
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    minimum = 256 + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(f"{option('vocab_size')} must be at least {minimum} (256 bytes + {len(special_tokens)} "
                         f"specials), got {vocab_size}")
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if output is not None:
        output = Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(str(output)) as temporary:
            tokenizer.save(temporary)
    return tokenizer

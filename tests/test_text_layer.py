"""`shardkit.text` is the one implementation of text handling (issue 33, item 5): a tokenizer spec loaded through it
gives each real document the tokens `shardkit build` writes for it, and its `none` packer cuts them into the
samples the build writes. A loader that reads raw text through the same layer therefore agrees with the build.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
import zstandard

from conftest import shared_path
from shardkit.text.packing import make_packer
from shardkit.text.tokenizers import load_tokenizer
from shardkit.tools.build import run_build
from test_build import config, documents_from_samples, read_samples

SEQ_LEN = 512  # the longer documents span several samples under pack="none"


def first_documents(corpus: str, count: int) -> list[str]:
    """The texts of the first `count` documents of a shared corpus (JSONL, zstd)."""
    with open(shared_path(f"corpora/{corpus}"), "rb") as handle:
        lines = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(handle), encoding="utf-8")
        return [json.loads(lines.readline())["text"] for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(path of a JSONL holding real documents, their texts): dictionary entries, fortunes and a Moby-Dick chapter
    from the mix corpus, then Brown corpus texts and State of the Union addresses (up to 38,000 characters)."""
    texts = first_documents("mix.jsonl.zst", 40) + first_documents("prose.jsonl.zst", 10)
    path = tmp_path_factory.mktemp("text") / "real.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path, texts


@pytest.mark.shared
@pytest.mark.parametrize("tokenizer", ["gpt2_hf_tokenizer.json", "cl100k_base.tiktoken"])
def test_the_shared_layer_gives_each_document_the_tokens_and_samples_the_build_writes(tmp_path, corpus, tokenizer):
    path, texts = corpus
    spec = str(shared_path(f"tokenizers/{tokenizer}"))
    output = tmp_path / "ds"
    run_build(config([path], output, tokenizer=spec, packing="none", seq_len=SEQ_LEN, shard_size=200_000,
                     unit_bytes=16_384))
    manifest, samples = read_samples(str(output))
    shared = load_tokenizer(spec)
    assert manifest.tokenizer.vocab_sha256 == shared.info.vocab_sha256 is not None

    # Each document's tokens: the build's, reassembled from its samples, against the shared layer's encoding with
    # the special ids the manifest records around it.
    bos = [] if manifest.tokenizer.bos_id is None else [manifest.tokenizer.bos_id]
    eos = [] if manifest.tokenizer.eos_id is None else [manifest.tokenizer.eos_id]
    expected = [bos + shared.encode(text).tolist() + eos for text in texts]
    built = documents_from_samples(samples)
    assert sorted(built) == [(0, i) for i in range(len(texts))], "the build rejected or lost a real document"
    different = [i for i, tokens in enumerate(expected) if built[(0, i)] != tokens]
    assert not different, f"documents {different} got other tokens from the build than from shardkit.text"

    # The same documents through the shared `none` packer: the build's samples, in order.
    packer = make_packer("none", seq_len=SEQ_LEN, pad_id=manifest.tokenizer.pad_id, token_dtype=manifest.token_dtype)
    packed = packer.feed(np.concatenate([np.asarray(t) for t in expected]), np.array([len(t) for t in expected]),
                         source=0, doc_index=np.arange(len(expected)))
    assert packed.num_samples == len(samples) > len(texts)  # the longer documents were split
    for mine, theirs in zip(packed, samples):
        assert mine.tokens.tolist() == theirs.tokens.tolist() and mine.doc_index.tolist() == theirs.doc_index.tolist()


def test_importing_the_text_layer_loads_no_tokenizer_package():
    """Tokenizer packages load when a spec needs them, not with the layer (the CLI and `import shardkit` stay light)."""
    heavy = ["tokenizers", "tiktoken", "sentencepiece", "torch"]
    code = ("import sys, shardkit.text.inputs, shardkit.text.documents, shardkit.text.packing, "
            f"shardkit.text.tokenizers; print([m for m in {heavy!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

"""`shardkit tokenizer train`: a BPE trained on build inputs loads as a build tokenizer."""

from __future__ import annotations

import json

from shardkit.cli import main
from shardkit.text.tokenizers import load_tokenizer


def test_train_cli_reads_inputs_like_build(tmp_path, capsys):
    lines = [json.dumps({"text": f"the {w} sat on the mat number {i}"}) for i, w in
             enumerate(["cat", "dog", "bird"] * 100)] + ["not json"]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "tok" / "tokenizer.json"
    assert main(["tokenizer", "train", str(tmp_path / "c.jsonl"), "--vocab-size", "300", "--output", str(out)]) == 0
    assert "trained on 300 documents (1 rejected)" in capsys.readouterr().err
    tok = load_tokenizer(str(out))
    assert tok.info.eos_id == 0 and tok.decode(tok.encode("the cat sat")) == "the cat sat"
    assert len(tok.encode("the cat sat on the mat")) < len("the cat sat on the mat")

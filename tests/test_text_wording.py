"""Errors speak the caller's language (issue 46, item 3): the text layer shared by `shardkit build` and the raw-text
`StreamingDataset` names `--tokenizer` / `INPUT` to a command line and `tokenizer=` / `inputs` to Python, and the
empty-lane error names `lanes` and `unit_bytes` with values to try."""

from __future__ import annotations

import pytest

from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.cli.main import main
from shardkit.wording import WORDING_ENV


def _python_error(**options):
    with pytest.raises((ValueError, OSError)) as raised:
        StreamingDataset(**{"tokenizer": "byte", "seq_len": 16, **options})
    return str(raised.value)


def test_the_python_api_names_keywords(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    missing = _python_error(source=str(tmp_path / "nothing.jsonl"))
    assert missing.startswith("inputs ") and "INPUT" not in missing, missing
    tokenizer = _python_error(source=str(tmp_path), tokenizer=str(tmp_path / "no-such-tokenizer.json"))
    assert tokenizer.startswith("tokenizer= ") and "--tokenizer" not in tokenizer, tokenizer
    txt_mode = _python_error(source=str(tmp_path), txt_mode="sentences")
    assert "txt_mode" in txt_mode and "--txt-mode" not in txt_mode, txt_mode


def _cli_error(args, capsys):
    try:
        code = main(args)
    except SystemExit as exit_:  # a user's mistake: argparse's one-line error
        code = exit_.code
    return code, capsys.readouterr().err


def test_the_command_line_names_options_and_leaves_python_callers_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(WORDING_ENV, raising=False)
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    out = str(tmp_path / "out")
    code, err = _cli_error(["build", str(tmp_path / "nothing.jsonl"), "--output", out, "--tokenizer", "byte"], capsys)
    assert code != 0 and "INPUT " in err and "Traceback" not in err, err
    code, err = _cli_error(["build", str(tmp_path), "--output", out, "--tokenizer", str(tmp_path / "no.json")], capsys)
    assert code != 0 and "--tokenizer " in err, err
    assert _python_error(source=str(tmp_path / "nothing.jsonl")).startswith("inputs ")  # the mark is not left behind


def test_an_empty_lane_names_the_settings_to_change(tmp_path):
    (tmp_path / "good.jsonl").write_text("\n".join(f'{{"text": "document {i} {"x" * 50}"}}' for i in range(40)))
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": ""}\nnot json\n')
    # Rank 1 of 2 without a process group reads the empty lane and cannot agree on leaving it out: the lane's error
    # (one rank, or ranks with a group, leave it out: tests/test_raw_dry_lanes.py).
    loader = StreamingDataLoader(StreamingDataset(str(tmp_path), tokenizer="byte", seq_len=64, lanes=2, rank=1,
                                                  world_size=2), batch_size=4)
    with pytest.raises(ValueError, match=r"lanes=1, now 2: .* \(unit_bytes=4194304, now 2097152\)"):
        next(iter(loader))

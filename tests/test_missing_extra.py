"""A tokenizer whose package is not installed says which extra installs it, in one line, from the Python API and
from `shardkit build` (issue 46, item 3). The package is hidden from a fresh interpreter (a `sys.modules` entry of
None makes `import` raise ModuleNotFoundError, as for a package that is not installed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HIDE = "import sys; sys.modules[{package!r}] = None\n"


@pytest.mark.parametrize("package, spec", [("tiktoken", "tiktoken:cl100k_base"), ("tokenizers", "TOKENIZER_JSON")])
def test_the_python_api_names_the_extra(tmp_path, package, spec):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "hello"}) + "\n")
    if spec == "TOKENIZER_JSON":
        spec = str(tmp_path / "tokenizer.json")
        (tmp_path / "tokenizer.json").write_text("{}")
    code = HIDE.format(package=package) + (
        "from shardkit import StreamingDataset\n"
        "try:\n"
        f"    StreamingDataset({str(corpus)!r}, tokenizer={spec!r}, seq_len=8)\n"
        "except ImportError as err:\n"
        "    print('CAUGHT', type(err).__name__, isinstance(err, ValueError), err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert f"CAUGHT MissingExtraError True the tokenizer {spec} needs the '{package}' package" in out, out
    assert "pip install 'shardkit[tokenizers]'" in out


def test_shardkit_build_prints_the_extra_in_one_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "hello"}) + "\n")
    code = HIDE.format(package="tiktoken") + "from shardkit.cli import main\nsys.exit(main())\n"
    run = subprocess.run([sys.executable, "-c", code, "build", str(corpus), "--output", str(tmp_path / "out"),
                          "--tokenizer", "tiktoken:cl100k_base", "--seq-len", "8", "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert "needs the 'tiktoken' package, which is not installed: pip install 'shardkit[tokenizers]'" in run.stderr

"""Every fenced shell command in README.md and docs/*.md runs as written, with small sizes.

The commands of each file run in order in one temporary directory (the README's build makes the dataset
its later commands read), against:
- a moto S3 server that `s3://bucket/...` reaches through `AWS_ENDPOINT_URL` (so the URLs stay as written),
- `tiktoken:cl100k_base` from ../shared/tokenizers through `TIKTOKEN_CACHE_DIR` (offline),
- a corpus at `corpus/web.jsonl.zst` and two small byte-level datasets for the placeholders.

The only changes made to a command are these (`shrink`), so a misspelled or removed option still fails:

| in the docs | run as |
| --- | --- |
| `shardkit`, `python3`, `torchrun` | this interpreter: `python -m shardkit`, `python`, `python -m torch.distributed.run --standalone` |
| placeholders `DATA`, `DATA_URL`, `URL`, `EVAL`, `EVAL_URL`, `INPUT...`, `SPEC`, `N`, `[options]` | the small datasets, the corpus, `byte`, `300`, nothing |
| `--nproc_per_node 8`, `--tp 4` | 2 processes, `--tp 2` |
| build: `--seq-len 2048`, `--workers 16`; `--output URL` (placeholder) | `--seq-len 32`, `--workers 1`; `--output built` |
| trainer: `--steps S` (or none), `--resume .../step_00001000`, `--skip-steps 1200-1260`; trace `--step 1200` | `--steps 4` and `--checkpoint-every 2`, `step_00000002`, `3-3`; `--step 3` |
| trainer from raw text (`--tokenizer`): `--seq-len 2048` | `--seq-len 32` |
| trainer: the model's size (any preset) | `--n-layer 2 --n-head 2 --n-kv-head 2 --d-model 32 --d-ff 64` where the command gives none of them |
| trainer: the batch (a preset's: 32 a rank for `gpt2-124m`, whose steps with cl100k's 100k-token vocabulary cost a CPU-second each) | `--batch-size 4` where the command gives none |
| tune: `--steps`, `--eval-every`, `--trials`, `--population`, `--perturb-every`; `warmup_steps=int:0:200` | 4, 2, 2, 2, 2; `warmup_steps=int:0:1` |
| `shardkit demo` | `--steps 2 --corpus-mb 0.1` |

Commands that are not run are listed in `SKIPPED` with the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from conftest import REPO, S3_TEST_CREDENTIALS, free_port, shared_path
from conftest_warm import cold_environment

pytestmark = pytest.mark.slow

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND_WORDS = ("shardkit", "torchrun", "python", "python3")
SKIPPED = {  # a pattern in the command -> why it is not run here
    "-m pip install": "installs packages (tests/test_wheel.py installs shardkit from its wheel)",
    " pip install ": "installs packages (tests/test_wheel.py installs shardkit from its wheel)",
    "-m pytest": "the test suite itself",
    "-m venv ": "makes the virtual environment the install commands run in (tests/test_wheel.py installs shardkit "
                "into one)",
    "/bin/activate": "activates a virtual environment in the shell (each command here runs in a process of its own)",
    " ... ": "a two-node launch: '...' stands for the rendezvous options of each node",
    "--rdzv-endpoint": "an elastic launch on several nodes (tests/test_elastic.py runs one on two simulated nodes)",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "sets the environment of the elastic agents launched next (on several nodes)",
    " createuser ": "needs a PostgreSQL server (tests/test_tune_postgres.py starts one)",
    " createdb ": "needs a PostgreSQL server (tests/test_tune_postgres.py starts one)",
    "SHARDKIT_STUDY_URL": "needs a PostgreSQL server (tests/test_tune_postgres.py and test_tune_pbt_shared.py "
                          "start one)",
}
# Whole documents whose blocks are not commands to run here, and the test that checks them instead.
CHECKED_ELSEWHERE = {"CLUSTERS.md": "Slurm and Kubernetes recipes: tests/test_cluster_recipes.py parses them"}
PLACEHOLDERS = {"DATA": "data/train", "DATA_URL": "data/train", "URL": "data/train", "EVAL": "data/eval",
                "EVAL_URL": "data/eval", "INPUT...": "corpus/web.jsonl.zst", "SPEC": "byte", "N": "300"}
TINY_MODEL = {"--n-layer": "2", "--n-head": "2", "--n-kv-head": "2", "--d-model": "32", "--d-ff": "64"}
TRAIN_BATCH = "4"  # divides --pp-microbatches 4 (PARALLELISM.md) and every data-parallel size here
TUNE_SIZES = {"--steps": "4", "--eval-every": "2", "--trials": "2", "--population": "2", "--perturb-every": "2"}


def shell_commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) of every command in the file's fenced shell blocks: blocks marked bash/sh/shell,
    or unmarked blocks whose first line starts with a command; `\\` continuations joined, `&&` split."""
    text = path.read_text(encoding="utf-8")
    found = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        kind, body = block.group(1), block.group(2)
        first = body.lstrip().split(None, 1)[0] if body.strip() else ""
        if kind not in ("bash", "sh", "shell") and not (kind == "" and first in COMMAND_WORDS):
            continue
        line = text[:block.start(2)].count("\n") + 1
        for offset, logical in _logical_lines(body):
            for command in _split_and(logical):
                found.append((line + offset, command))
    return found


def _logical_lines(body: str) -> list[tuple[int, str]]:
    lines, start, current = [], 0, ""
    for number, raw in enumerate(body.splitlines()):
        if not current:
            start = number
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            lines.append((start, current))
        current = ""
    return lines


def _split_and(logical: str) -> list[str]:
    """The commands of a line joined by `&&`, each as the shell's words joined by single spaces."""
    commands, current = [], []
    for word in shlex.split(logical, comments=True):
        if word == "&&":
            commands.append(" ".join(current))
            current = []
        else:
            current.append(word)
    return [*commands, " ".join(current)] if current else commands


def _set(argv: list[str], option: str, value: str, *, add: bool = False) -> None:
    if option in argv:
        argv[argv.index(option) + 1] = value
    elif add:
        argv += [option, value]


def shrink(command: str, cwd: Path | None = None) -> list[str]:
    """The command (words joined by spaces) with the small sizes of the module's table, its globs expanded
    in `cwd` as the shell would."""
    argv = [PLACEHOLDERS.get(word, word) for word in command.split(" ") if word != "[options]"]
    if cwd is not None:
        argv = [match for word in argv for match in (sorted(str(p.relative_to(cwd)) for p in cwd.glob(word))
                                                      if "*" in word else [word]) or [word]]
    if argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        if int(argv[argv.index("--nproc_per_node") + 1]) > 4:
            argv[argv.index("--nproc_per_node") + 1] = "2"
            _set(argv, "--tp", "2")
    elif argv[0] == "shardkit":
        argv[:1] = [sys.executable, "-m", "shardkit"]
    elif argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    words = " ".join(argv)
    if "shardkit.train" in words or " shardkit train" in words:
        _set(argv, "--steps", "4", add=True)
        _set(argv, "--checkpoint-every", "2", add=True)
        if not any(word in argv for word in TINY_MODEL):
            argv += [word for option, value in TINY_MODEL.items() for word in (option, value)]
        if "--batch-size" not in argv:
            argv += ["--batch-size", TRAIN_BATCH]
        if "--tokenizer" in argv:  # raw text: the loader tokenizes, at the build's small size
            _set(argv, "--seq-len", "32")
        argv = [re.sub(r"step_\d{8}$", "step_00000002", word) for word in argv]
        _set(argv, "--skip-steps", "3-3")
    if " tune " in f"{words} ":
        for option, value in TUNE_SIZES.items():
            _set(argv, option, value)
        argv = [word.replace("warmup_steps=int:0:200", "warmup_steps=int:0:1") for word in argv]
    if " trace " in f"{words} ":
        _set(argv, "--step", "3")
    if " build " in f"{words} ":
        if argv[argv.index("--output") + 1].startswith("data/"):  # a placeholder: not over the shared datasets
            _set(argv, "--output", "built")
        _set(argv, "--seq-len", "32")
        _set(argv, "--workers", "1")
    if " demo" in f"{words} ":
        argv += ["--steps", "2", "--corpus-mb", "0.1"]
    return argv


def _corpus(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"text": f"Document {i}. " + "Shards carry tokens from corpus to trainer. " * 8}) + "\n"
                    for i in range(48))
    path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> tuple[int, str]:
    """Exit status and output tail of a command; on timeout its whole process group (torchrun's workers) dies."""
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return -9, f"timed out after {timeout}s\n{output[-6000:]}"
    return process.returncode, output[-6000:]


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    """(environment variables, a fresh working directory per doc file) with S3, the tokenizer and the data."""
    server_module = pytest.importorskip("moto.server")
    import boto3

    cl100k = shared_path("tokenizers/cl100k_base.tiktoken")
    root = tmp_path_factory.mktemp("doc-commands")
    cache = root / "tiktoken"
    cache.mkdir()
    # tiktoken's cache names a file by the sha1 of the URL it downloads it from
    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    shutil.copy(cl100k, cache / hashlib.sha1(url.encode()).hexdigest())
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request
    port = free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # a new user's machine: no AWS settings, no warm-start server
    env = {k: v for k, v in cold_environment(os.environ).items() if not k.startswith("AWS_")}
    env.update(S3_TEST_CREDENTIALS, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", TIKTOKEN_CACHE_DIR=str(cache),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket="bucket")
    data = root / "data"
    _corpus(data / "corpus.jsonl.zst")
    for name in ("train", "eval"):
        subprocess.run([sys.executable, "-m", "shardkit", "build", str(data / "corpus.jsonl.zst"), "--output",
                        str(data / name), "--tokenizer", "byte", "--seq-len", "32", "--workers", "1",
                        "--no-progress"], env=env, check=True, capture_output=True)
    try:
        yield env, root
    finally:
        server.stop()


def test_extraction_finds_the_documented_commands():
    commands = {path.name: [c for _, c in shell_commands(path)] for path in DOCS}
    readme = commands["README.md"]
    assert any(c.startswith("shardkit build corpus/") for c in readme) and any("shardkit tune" in c for c in readme)
    assert [c for c in readme if c.startswith("torchrun")] and "shardkit demo" in readme
    assert commands["FORMAT.md"] == []  # its unmarked blocks are byte layouts, not commands
    assert any(c.startswith("shardkit tune") and "pbt" in c for c in commands["TUNING.md"])


def test_ci_runs_the_readme_test_command():
    """.ci/run's header says it runs the README's test command: it names that command, and runs each of its steps."""
    readme = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    (tests,) = [line for line in readme if line.startswith("python3 ") and "-m pytest" in line]
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert f"#   {tests}" in ci[:4], (tests, ci[:4])
    assert set(tests.split(" && ")) <= {line.strip() for line in ci}, (tests, ci)


def test_shrink_changes_sizes_only():
    argv = shrink("torchrun --nproc_per_node 8 -m shardkit.train --data s3://b/d --preset llama-1b --tp 4 "
                  "--dp-shard -1 --eval_every 50")  # respell: keep
    assert argv[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert argv[argv.index("--nproc_per_node") + 1] == "2" and argv[argv.index("--tp") + 1] == "2"
    assert "--eval_every" in argv and argv[argv.index("--steps") + 1] == "4"  # kept as written; respell: keep
    assert argv[argv.index("--batch-size") + 1] == TRAIN_BATCH  # not the preset's 8 a rank
    assert shrink("python -m shardkit.train --data d --batch-size 16").count("--batch-size") == 1  # one given: kept


@pytest.mark.parametrize("doc", [path.relative_to(REPO).as_posix() for path in DOCS])
def test_documented_commands_run(doc, environment):
    if Path(doc).name in CHECKED_ELSEWHERE:
        pytest.skip(CHECKED_ELSEWHERE[Path(doc).name])
    env, root = environment
    work = root / doc.replace("/", "_")
    work.mkdir()
    (work / "data").symlink_to(root / "data")
    _corpus(work / "corpus" / "web.jsonl.zst")
    ran = 0
    for line, command in shell_commands(REPO / doc):
        skip = [reason for pattern, reason in SKIPPED.items() if pattern in f" {command} "]
        if skip:
            print(f"{doc}:{line}: skipped ({skip[0]}): {command}")
            continue
        argv = shrink(command, work)
        began = time.monotonic()
        returncode, output = _run(argv, work, env)
        print(f"{doc}:{line}: exit {returncode} in {time.monotonic() - began:.1f}s: {command}")
        assert returncode == 0, f"{doc}:{line}: {command}\nran as: {shlex.join(argv)}\n{output}"
        ran += 1
    print(f"{doc}: {ran} commands ran")

"""The accelerate script of docs/INTEGRATIONS.md ("accelerate without the Trainer"), run as a user runs it (started
by tests/test_integrations_accelerate.py, alone or under torchrun): the document's own code, with its constants set
from the command line and the sample ids of every step recorded.

    python accelerate_runs.py DATASET FOLDER IDS_JSON --steps N [--stop-at K] [--resume S] [--save-every E]
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from integration_procs import run_parser, write_ids  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "INTEGRATIONS.md"
RECORD_AFTER = "        step += 1\n"  # the line of the document's loop after which the step's ids are recorded


def doc_script() -> str:
    """The first Python block of the document's "accelerate without the Trainer" section."""
    section = DOC.read_text().split("## accelerate without the Trainer\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def with_values(script: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        script, found = re.subn(rf"^{re.escape(name)} = .*$", f"{name} = {value}", script, flags=re.M)
        if found != 1:
            raise SystemExit(f"{DOC}: the accelerate script has no line '{name} = ...' (the test sets it)")
    if script.count(RECORD_AFTER) != 1:
        raise SystemExit(f"{DOC}: the accelerate script has no line {RECORD_AFTER.strip()!r} (the test records there)")
    return script.replace(RECORD_AFTER, RECORD_AFTER + '        SEEN.append([step, batch["sample_id"].tolist()])\n')


def main() -> None:
    parser = run_parser()
    parser.add_argument("--resume", type=int, help="the checkpoint the script must find as its latest")
    parser.add_argument("--save-every", type=int, default=5)
    opts = parser.parse_args()
    if opts.resume is not None:  # the script resumes from the latest step-N folder by itself
        assert os.path.isdir(os.path.join(opts.folder, f"step-{opts.resume}")), opts.resume
    os.environ["SHARDKIT_CACHE_DIR"] = os.path.join(opts.folder, "cache")
    # What `accelerate launch --cpu` sets: without it, accelerate under torchrun on a machine without GPUs runs
    # each process on its own (DistributedType.NO: no gradient all-reduce, every process its own main process).
    os.environ["ACCELERATE_USE_CPU"] = "true"
    script = with_values(doc_script(), {"DATASET": repr(opts.dataset), "RUN_DIR": repr(opts.folder), "BATCH_SIZE": "4",
                                        "MAX_STEPS, SAVE_EVERY": f"{opts.stop_at or opts.steps}, {opts.save_every}"})
    namespace = {"__name__": "__main__", "SEEN": []}
    exec(compile(script, str(DOC), "exec"), namespace)
    expected = int(os.environ.get("WORLD_SIZE", 1))
    if namespace["accelerator"].num_processes != expected:  # the run must be the distributed one it claims to be
        raise SystemExit(f"accelerate runs {namespace['accelerator'].num_processes} processes, torchrun {expected}")
    write_ids(opts.ids, namespace["SEEN"])


if __name__ == "__main__":
    main()

"""A recipe of docs/INTEGRATIONS.md run as a user runs it (started by tests/test_doc_recipes.py and
tests/test_integrations_accelerate.py, alone or under torchrun): the document's own code (tests/doc_recipes.py),
run in FOLDER so that its relative paths land there, with the sample ids of every step recorded. A recipe resumes
from its latest checkpoint in FOLDER by itself.

    python recipe_runs.py DATASET FOLDER IDS_JSON --recipe NAME --steps N [--stop-at K] [--resume K]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from doc_recipes import DOC, RECIPES, runnable  # noqa: E402
from integration_procs import run_parser, write_ids  # noqa: E402


def main() -> None:
    parser = run_parser()
    parser.add_argument("--recipe", required=True, choices=sorted(RECIPES))
    parser.add_argument("--resume", type=int, help="the step of the checkpoint the recipe must find as its latest")
    opts = parser.parse_args()
    os.chdir(opts.folder)
    os.environ["SHARDKIT_CACHE_DIR"] = os.path.join(opts.folder, "cache")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        os.environ.update(RECIPES[opts.recipe].multi_rank_env)
    script = runnable(opts.recipe, dataset=opts.dataset, steps=opts.stop_at or opts.steps)
    namespace = {"__name__": "__main__", "SEEN": []}
    exec(compile(script, f"{DOC} ({opts.recipe})", "exec"), namespace)
    write_ids(opts.ids, namespace["SEEN"])


if __name__ == "__main__":
    main()

"""Every Python recipe of docs/INTEGRATIONS.md runs as written (what a run changes: tests/doc_recipes.py), with the
real framework, each run a new process (tests/recipe_runs.py; CPU, gloo): a first run stopped after a checkpoint,
its resume in a new process, and the documented launch on 2 processes. Every step trains on the samples that
shardkit's own StreamingDataLoader reads at that step."""

from __future__ import annotations

import importlib.util

import pytest

from doc_recipes import BATCH_SIZE, CONFIG_BLOCKS, RECIPES, all_python_blocks, python_blocks
from integration_procs import dataset_url  # noqa: F401 - a fixture: the module's dataset
from integration_procs import own_loader_steps, run_script

FRAMEWORK = {"huggingface": "transformers", "accelerate": "accelerate",
             "torchtitan": "torchtitan.components.checkpoint", "torchdata": "torchdata.stateful_dataloader", "lightning": "lightning"}


def needs_framework(name: str) -> None:
    if importlib.util.find_spec(FRAMEWORK[name].split(".")[0]) is None:
        pytest.skip(f"{FRAMEWORK[name]} is not installed (pyproject [integrations])")
    pytest.importorskip(FRAMEWORK[name])


def run(name, dataset_url, folder, label, *options, ranks=1):
    return run_script("recipe_runs.py", dataset_url, folder, label, "--recipe", name, *options, ranks=ranks,
                      torchrun=RECIPES[name].launcher == "torchrun")


def own_loader(name, dataset_url, tmp_path, *, steps, ranks=1):
    return own_loader_steps(dataset_url, str(tmp_path / "own-cache"), steps=steps, ranks=ranks,
                            batch_size=BATCH_SIZE, **RECIPES[name].dataset_options)


def test_every_python_block_of_the_document_is_run_here():
    covered = [python_blocks(r.section)[r.block] for r in RECIPES.values()]
    covered += [python_blocks(section)[block] for section, block in CONFIG_BLOCKS.values()]
    assert sorted(covered) == sorted(all_python_blocks())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_stopped_run_resumes_in_a_new_process_on_shardkits_samples(dataset_url, tmp_path, name):
    needs_framework(name)
    head = run(name, dataset_url, tmp_path / "run", "head", "--steps", 20, "--stop-at", 10)
    tail = run(name, dataset_url, tmp_path / "run", "tail", "--steps", 20, "--resume", 10)
    # 15 steps an epoch: the resumed run crosses the end of epoch 0, and no step is trained twice or skipped.
    assert head[0] + tail[0] == own_loader(name, dataset_url, tmp_path, steps=20)[0]


# accelerate's documented launch on 2 processes is the stopped run of tests/test_integrations_accelerate.py's
# two-rank test, which checks its steps against shardkit's own loader the same way (one launch fewer here).
TWO_PROCESS_ELSEWHERE = {"accelerate"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(RECIPES) - TWO_PROCESS_ELSEWHERE))
def test_the_documented_two_process_launch_reads_shardkits_shares(dataset_url, tmp_path, name):
    needs_framework(name)
    two = run(name, dataset_url, tmp_path / "run", "two", "--steps", 9, ranks=2)  # 7 steps an epoch on 2 ranks
    assert two == own_loader(name, dataset_url, tmp_path, steps=9, ranks=2)


def test_the_torchtitan_config_function_builds_shardkits_loader(dataset_url, tmp_path):
    """The config function as torchtitan's Trainer uses it (which needs CUDA, and its model configs triton): it is
    called, and its dataloader built with the arguments the Trainer passes. `llama3_debugmodel` stands for the
    model's config function, which returns a Trainer.Config (here its dataloader field only)."""
    needs_framework("torchtitan")
    import types

    section, block = CONFIG_BLOCKS["torchtitan-config"]
    script = python_blocks(section)[block]
    for written, value in (('"s3://bucket/dataset"', repr(dataset_url)),
                           ('"/local/nvme/shardkit"', repr(str(tmp_path / "cache")))):
        assert script.count(written) == 1, written
        script = script.replace(written, value)
    namespace = {"llama3_debugmodel": lambda: types.SimpleNamespace(dataloader=None)}
    exec(compile(script, "docs/INTEGRATIONS.md (torchtitan config)", "exec"), namespace)
    config = namespace["llama3_debug_shardkit"]()
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=16,
                                     local_batch_size=BATCH_SIZE)
    seen = []
    loader.on_sample_ids = lambda step, ids: seen.append([step, ids.tolist()])
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    assert seen == own_loader_steps(dataset_url, str(tmp_path / "own"), steps=3)[0]

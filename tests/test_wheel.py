"""What users install is what we test: build the wheel, install it into a fresh virtual environment and
run every command from a temporary directory, with the source tree off `sys.path`.

The environment sees the packages of the interpreter running the tests (torch, optuna, ... are not
reinstalled), whether that interpreter is the system's or a virtual environment's, but shardkit itself
comes only from the wheel: the test checks `shardkit.__file__` and that no path of the checkout is
importable. A module the wheel lacks (the hand-listed packages once left out
`shardkit.train.parallel`) fails here with the ModuleNotFoundError a user would see.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest_warm import cold_environment

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (f"{' '.join(command)} failed ({result.returncode}):\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result.stdout + result.stderr


def _see_site_packages_of_this_interpreter(python: Path) -> None:
    """Let the environment of `python` import what this interpreter imports, after its own packages.

    Not `system_site_packages=True`: a virtual environment is always made from the base interpreter, so
    when the tests run in a virtual environment, that flag would show the base's packages and not this
    environment's (torch, pyarrow, ... installed in it would be missing). A .pth line that starts with
    `import` runs when the environment starts; `site.addsitedir` appends each directory behind the
    environment's own site-packages (the wheel's shardkit comes first) and runs its .pth files, as the
    interpreter does for its own, so packages installed there in any way import the same.
    """
    directories = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    directories = [d for d in [*directories, *site.getsitepackages()] if os.path.isdir(d)]
    target = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    # map, not a comprehension: site exec()s the line inside a function, and a comprehension's own scope
    # would not see the `site` it imports
    Path(target, "zz_tests_interpreter_site.pth").write_text(
        f"import site; list(map(site.addsitedir, {directories!r}))\n")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin directory, environment, working directory) with shardkit installed from its wheel only."""
    root = tmp_path_factory.mktemp("wheel")
    # the wheel's trainer starts cold: the suite's warm-start server runs the checkout's shardkit
    env = {k: v for k, v in cold_environment(os.environ).items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONNOUSERSITE="1")
    # From a copy without build outputs: setuptools would put a stale build/lib into the wheel.
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "runs",
        "bench_out", "bench_data"))
    wheels = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
          str(source)], cwd=root, env=env)
    (wheel,) = wheels.glob("shardkit-*.whl")
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    bin_dir = root / "venv" / "bin"
    # pip of this interpreter installs into the new environment (with_pip would download nothing but is slow)
    _run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "-q", "--no-deps",
          "--no-index", str(wheel)], cwd=root, env=env)
    _see_site_packages_of_this_interpreter(bin_dir / "python")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    work = root / "work"
    work.mkdir()
    return bin_dir, env, work


def test_the_installed_package_comes_from_the_wheel_alone(installed):
    bin_dir, env, work = installed
    out = _run([str(bin_dir / "python"), "-c", "import json, sys, shardkit, shardkit.train.parallel, "
                "shardkit.loaders.dataset, shardkit.tools.build, shardkit.text.documents; print(json.dumps([shardkit.__file__, sys.path]))"],
               cwd=work, env=env)
    location, path = json.loads(out.splitlines()[-1])
    assert Path(location).is_relative_to(bin_dir.parent), location
    # The README's virtual environment, .venv, lies inside the checkout: its packages are this interpreter's,
    # not the checkout's sources.
    interpreter = Path(sys.prefix).resolve()
    assert not [p for p in path if p and Path(p).resolve().is_relative_to(REPO)
                and not Path(p).resolve().is_relative_to(interpreter)], path


def test_every_command_runs_from_the_installed_wheel(installed):
    bin_dir, env, work = installed
    shardkit, python = str(bin_dir / "shardkit"), str(bin_dir / "python")
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "the wheel holds every module. " * 6}) + "\n"
                              for i in range(40)))
    _run([shardkit, "build", str(corpus), "--output", "ds", "--tokenizer", "byte", "--seq-len", "32",
          "--shard-size", "2KB", "--workers", "1", "--no-progress"], cwd=work, env=env)
    _run([shardkit, "inspect", "ds"], cwd=work, env=env)
    train = [python, "-m", "shardkit.train", "--data", "ds", "--batch-size", "4", "--device", "cpu",
             "--warmup-steps", "1", "--tensorboard", "false", "--run-dir", "run", "--log-sample-ids", "true",
             "--checkpoint-every", "2"]
    _run([*train, "--steps", "2"], cwd=work, env=env)
    assert (work / "run" / "checkpoints" / "step_00000002").is_dir()
    resumed = _run([*train, "--steps", "4"], cwd=work, env=env)
    assert "resum" in resumed.lower() and (work / "run" / "checkpoints" / "step_00000004").is_dir(), resumed[-2000:]
    assert "document" in _run([shardkit, "trace", "run", "--step", "3", "--text"], cwd=work, env=env)
    tuned = _run([shardkit, "tune", "--data", "ds", "--steps", "2", "--batch-size", "4", "--device", "cpu",
                  "--warmup-steps", "1", "--tensorboard", "false", "--space", "lr=loguniform:1e-4:1e-2",
                  "--trials", "2", "--pruner", "none", "--objective", "loss", "--output", "tune"], cwd=work, env=env)
    assert (work / "tune" / "best.toml").is_file(), tuned[-2000:]
    assert "--corpus-mb" in _run([shardkit, "demo", "--help"], cwd=work, env=env)

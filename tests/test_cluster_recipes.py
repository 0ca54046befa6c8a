"""The cluster recipes of docs/CLUSTERS.md hold together: the Slurm script passes `bash -n`, the Kubernetes
manifest is valid YAML of the expected objects, and in each the `torchrun` options parse with torchrun's own
parser and the trainer options with the trainer's parser (a renamed or misspelt option fails here)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "CLUSTERS.md"


def _block(section: str, language: str) -> str:
    text = DOC.read_text()
    body = text.split(f"## {section}", 1)[1]
    match = re.search(rf"```{language}\n(.*?)```", body, re.S)
    assert match, f"no ```{language} block under '## {section}' in {DOC}"
    return match.group(1)


def _check_launch(argv: list[str]):
    """Parse a `torchrun ... -m shardkit.train ...` argument list with the real parsers."""
    from torch.distributed.run import get_args_parser

    from shardkit.train.options import parse_train_args

    launch = get_args_parser().parse_args(argv)
    assert launch.module and launch.training_script == "shardkit.train", argv
    config = parse_train_args(launch.training_script_args)
    return launch, config


def test_slurm_script_is_valid_bash_and_its_launch_parses(tmp_path):
    script = _block("Slurm", "bash")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", script, re.M))
    nodes = int(sbatch["nodes"])
    assert sbatch["ntasks-per-node"] == "1", "one torchrun agent per node"

    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script
    command = re.search(r"srun [^']*'(torchrun .*?)'", script, re.S).group(1)
    values = {"HEAD_NODE": "node0", "SLURM_JOB_ID": "1234"}
    command = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], command.replace("\\\n", " "))
    launch, config = _check_launch(shlex.split(command)[1:])
    low, high = (int(n) for n in launch.nnodes.split(":"))
    assert 1 <= low <= high == nodes
    assert launch.rdzv_backend == "c10d" and launch.rdzv_endpoint == "node0:29400" and launch.max_restarts > 0
    assert config.checkpoint.resume == "auto" and config.data.cache_dir.startswith("/local/")


def test_kubernetes_job_is_valid_yaml_and_its_launch_parses():
    yaml = pytest.importorskip("yaml")
    service, job = yaml.safe_load_all(_block("Kubernetes", "yaml"))
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    env = {item["name"]: item for item in container["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"
    assert "valueFrom" in env["AWS_SECRET_ACCESS_KEY"], "credentials come from a Secret"
    assert not any("AWS" in arg or "secret" in arg.lower() for arg in container["command"])

    assert container["command"][0] == "torchrun"
    launch, config = _check_launch(container["command"][1:])
    low, high = (int(n) for n in launch.nnodes.split(":"))
    assert high == job["spec"]["completions"] == job["spec"]["parallelism"]
    host = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert launch.rdzv_endpoint == f"{host}:{service['spec']['ports'][0]['port']}"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert config.data.cache_dir.startswith(tuple(mounts)) and config.logging.run_dir.startswith(tuple(mounts))

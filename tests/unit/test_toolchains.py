"""Toolchain environments (pipeline.toolchains) without the toolchains themselves and without processes: how a
toolchain job is resolved before a place is chosen, each toolchain's definition, the job's folders in its
arguments. The rank wrapper, a build into the cache and the job's MLflow server run in
tests/integration/test_toolchain_envs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import toolchains
from pipeline.errors import ConfigError
from pipeline.job.spec import Attempt, JobSpec, launch_config, resolve
from pipeline.job.supervisor import Job
from pipeline.job_files import JobFiles


def test_an_unknown_or_unbuilt_toolchain_fails_before_any_process_starts(tmp_path, monkeypatch):
    # What runs is resolved before a place is chosen (the supervisor's Job and the operator resolve every spec).
    monkeypatch.setenv(toolchains.CACHE_ENV, str(tmp_path / "empty-cache"))
    assert {"unsloth", "axolotl", "llm_foundry"} <= set(toolchains.names())
    with pytest.raises(ConfigError, match=r"toolchain 'axolotI' is not defined: expected one of \['axolotl'"):
        resolve(JobSpec(entry=["t.py"], job_dir=tmp_path, toolchain="axolotI"))
    with pytest.raises(ConfigError, match=r"run `make toolchain NAME=axolotl`"):
        Job(JobSpec(entry=["t.py"], job_dir=tmp_path, toolchain="axolotl"))
    with pytest.raises(ConfigError, match="launch.kind=ray"):
        resolve(JobSpec(entry=["t.py"], job_dir=tmp_path, toolchain="axolotl", launch=launch_config({"kind": "ray"})))
    assert not (tmp_path / "empty-cache").exists()


def test_a_built_toolchain_runs_the_agent_and_ranks_with_its_interpreter_and_environment(tmp_path, monkeypatch):
    axolotl = toolchains.get("axolotl")
    monkeypatch.setattr(type(axolotl), "built", lambda self: {"seconds": 1})
    spec = resolve(JobSpec(entry=["-m", "axolotl.cli.main", "train"], job_dir=tmp_path, toolchain="axolotl",
                           env={"PATH": "/usr/bin"}))
    assert spec.toolchain is None and spec.no_python and spec.python == str(axolotl.python)
    assert spec.entry[:3] == ["python", "-m", "pipeline.toolchains.rank"] and spec.entry[-3:] == ["-m", "axolotl.cli.main", "train"]
    assert spec.env["PATH"] == f"{axolotl.env_dir / 'bin'}:/usr/bin" and spec.env["VIRTUAL_ENV"] == str(axolotl.env_dir)
    assert resolve(spec) == spec  # resolved once: the supervisor and the operator may both ask


def test_a_toolchains_pods_run_its_image_its_agent_and_the_rank_wrapper():
    from pipeline.job.kubernetes.place import manifests_for

    axolotl = toolchains.get("axolotl")
    spec = JobSpec(entry=["-m", "axolotl.cli.main", "train", "sft.yaml"], job_dir="/mnt/p/runs/d/r/train",
                   toolchain="axolotl", env={"MLFLOW_TRACKING_URI": "http://mlflow:5000"},
                   launch=launch_config({"kind": "kubernetes", "nproc_per_node": 8,
                                         "kubernetes": {"volumes": ["home:/mnt/p"]}}))
    container = manifests_for(Attempt(resolve(spec), 0)).job.spec.template.spec.containers[0]
    assert container.image == axolotl.image and axolotl.key in container.image
    command = container.command
    assert command[:3] == ["python", "-m", "torch.distributed.run"] and "--no-python" in command
    wrapped = command[command.index("--no-python") + 1:]
    assert wrapped == ["python", "-m", "pipeline.toolchains.rank",
                       *(f"--config-error={e}" for e in axolotl.config_errors), "--", *spec.entry]
    chosen = JobSpec(entry=spec.entry, job_dir=spec.job_dir, toolchain="axolotl", launch=launch_config(
        {"kind": "kubernetes", "kubernetes": {"image": "registry.example.com/axolotl:mine", "volumes": ["home:/mnt/p"]}}))
    assert manifests_for(Attempt(resolve(chosen), 0)).job.spec.template.spec.containers[0].image == \
        "registry.example.com/axolotl:mine"


def test_each_toolchain_defines_a_hashed_lock_an_image_and_a_python():
    dockerfile = (toolchains.TOOLCHAINS_DIR / "Dockerfile").read_text()
    assert "FROM python:${PYTHON}-slim" in dockerfile and "ARG TOOLCHAIN" in dockerfile
    assert 'pip install --no-deps --require-hashes -r "toolchains/$TOOLCHAIN/requirements.txt"' in dockerfile
    for name in toolchains.names():
        toolchain = toolchains.get(name)
        pins = [line for line in toolchain.lock.read_text().splitlines() if line and not line.startswith(("#", " "))]
        hashes = [line for line in toolchain.lock.read_text().splitlines() if line.strip().startswith("--hash=sha256:")]
        assert pins and len(pins) == len(hashes) and all("==" in pin for pin in pins), name
        assert toolchain.python_version in ("3.11", "3.12") and toolchain.config_errors
        assert f"--build-arg TOOLCHAIN={name} --build-arg PYTHON={toolchain.python_version} -t {toolchain.image} ." in \
            toolchain.docker_build


def test_entry_arguments_name_the_job_folders():
    files = JobFiles(Path("/runs/d/r/train"))
    assert files.expand("--output_dir=${PIPELINE_JOB_DIR}/model") == "--output_dir=/runs/d/r/train/model"
    assert files.expand("${PIPELINE_CHECKPOINT_DIR}") == "/runs/d/r/train/checkpoints"
    assert files.expand("${PIPELINE_NOT_A_FOLDER} ${HOME} {a}") == "${PIPELINE_NOT_A_FOLDER} ${HOME} {a}"

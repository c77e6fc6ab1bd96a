"""Toolchain environments (pipeline.toolchains) without the toolchains themselves, on real processes: the rank
wrapper that turns a toolchain's configuration errors into user errors, building an environment from a hashed lock
into the cache, and the job's MLflow server for ranks with another MLflow. What needs no process is in
tests/unit/test_toolchains.py."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipeline import deployment, toolchains
from pipeline.errors import ConfigError
from pipeline.job.spec import JobSpec


def _rank(tmp_path, *entry, config_errors=("__main__.Mistake",)):
    errors = tmp_path / "errors"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.toolchains.rank", *(f"--config-error={e}" for e in config_errors), "--", *entry],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(deployment.PROJECT_ROOT), "PIPELINE_ERROR_DIR": str(errors),
             "RANK": "1"})
    reported = [json.loads(p.read_text()) for p in sorted(errors.glob("rank-*.json"))]
    return done, reported


def test_the_rank_wrapper_reports_a_declared_config_error_and_nothing_else(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 'beside the script'\n")
    (tmp_path / "train.py").write_text(
        "import sys\nfrom helper import VALUE\n"
        "class Mistake(ValueError):\n    pass\n"
        "if __name__ == '__main__':\n"
        "    print(VALUE, sys.argv[1:])\n"
        "    if sys.argv[1] == 'bad': raise Mistake('sft.yaml: unknown key max_stepz')\n"
        "    if sys.argv[1] == 'crash': raise RuntimeError('gloo connection reset')\n")

    done, reported = _rank(tmp_path, "train.py", "ok", "--flag")
    assert done.returncode == 0 and "beside the script ['ok', '--flag']" in done.stdout, done.stderr
    assert reported == []

    done, reported = _rank(tmp_path, "train.py", "crash")  # not declared: an ordinary failure, restarted, retried
    assert done.returncode != 0 and "gloo connection reset" in done.stderr and reported == []

    done, reported = _rank(tmp_path, "train.py", "bad")
    assert done.returncode != 0
    assert reported == [{"rank": 1, "type": "ConfigError",
                         "message": "__main__.Mistake: sft.yaml: unknown key max_stepz"}]


def test_the_rank_wrapper_runs_a_module_with_its_arguments(tmp_path):
    (tmp_path / "in.json").write_text('{"b": 1, "a": 2}')
    done, reported = _rank(tmp_path, "-m", "json.tool", "--sort-keys", "in.json", "out.json")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out.json").read_text()) == {"a": 2, "b": 1}

    (tmp_path / "tinytrain.py").write_text("import json, sys\nif __name__ == '__main__':\n    json.loads(sys.argv[1])\n")
    done, reported = _rank(tmp_path, "-m", "tinytrain", "{not json", config_errors=("builtins.ValueError",))
    assert [r["message"].split(":")[0] for r in reported] == ["builtins.ValueError"]  # found through the type's bases


def _wheel(folder: Path, name: str = "tinypkg", version: str = "1.0") -> Path:
    """A pure-Python wheel built by hand: one module that says its version."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},{len(t)}"
              for n, t in files.items()]
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join(record + [f"{name}-{version}.dist-info/RECORD,,"]) + "\n"
    with zipfile.ZipFile(path, "w") as archive:
        for n, t in files.items():
            archive.writestr(n, t)
    return path


@pytest.fixture
def tiny_toolchain(tmp_path, monkeypatch):
    folder = tmp_path / "toolchains" / "tiny"
    folder.mkdir(parents=True)
    (folder / "toolchain.json").write_text(json.dumps({"python": "%d.%d" % sys.version_info[:2], "import": "tinypkg",
                                                       "config_errors": ["tinypkg.Mistake"]}))
    wheel = _wheel(tmp_path)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (folder / "requirements.txt").write_text(f"tinypkg @ {wheel.as_uri()} \\\n    --hash=sha256:{digest}\n")
    monkeypatch.setattr(toolchains, "TOOLCHAINS_DIR", tmp_path / "toolchains")
    monkeypatch.setenv(toolchains.CACHE_ENV, str(tmp_path / "cache"))
    return toolchains.get("tiny")


def test_a_toolchain_is_built_once_per_lock_into_the_cache_and_a_failed_build_leaves_nothing(tiny_toolchain):
    from pipeline.toolchains.__main__ import build

    with pytest.raises(ConfigError, match=r"toolchain 'tiny' is not built .* run `make toolchain NAME=tiny`"):
        tiny_toolchain.require()
    record = build(tiny_toolchain)
    assert tiny_toolchain.env_dir.parent == Path(toolchains.cache_root())
    assert tiny_toolchain.env_dir.name == f"tiny-{tiny_toolchain.key}"
    assert record["disk_mb"] > 0 and record["key"] == tiny_toolchain.key
    assert tiny_toolchain.require().built() == record
    version = subprocess.run([tiny_toolchain.python, "-c", "import tinypkg, sys; print(tinypkg.VERSION, sys.prefix)"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert version == ["1.0", str(tiny_toolchain.env_dir)]  # its own interpreter, not the project's
    marker = tiny_toolchain.env_dir / toolchains.BUILT_MARKER
    stamp = marker.stat().st_mtime_ns
    assert build(tiny_toolchain) == record and marker.stat().st_mtime_ns == stamp  # reused, not rebuilt

    lock = tiny_toolchain.lock.read_text()
    tiny_toolchain.lock.write_text(lock.replace(lock.split("sha256:")[1][:8], "00000000"))  # a new key, a bad hash
    with pytest.raises(subprocess.CalledProcessError):
        build(tiny_toolchain)
    assert not tiny_toolchain.env_dir.exists() and tiny_toolchain.built() is None
    with pytest.raises(ConfigError, match="not built"):
        tiny_toolchain.require()


def test_ranks_with_another_mlflow_get_a_server_over_the_jobs_store(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from pipeline.registry import tracking_server

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("PIPELINE_MLFLOW_ARTIFACTS", (tmp_path / "artifacts").as_uri())
    # As pipeline.job.spec.resolve leaves a local toolchain's job: its own interpreter set, the toolchain settled.
    spec = JobSpec(entry=["t.py"], job_dir=tmp_path / "job", python=sys.executable, env={"MLFLOW_TRACKING_URI": store})
    with tracking_server.for_ranks(spec) as served:
        url = served.env["MLFLOW_TRACKING_URI"]
        assert url.startswith("http://127.0.0.1:")
        remote = MlflowClient(url)
        run = remote.create_run(remote.create_experiment("toolchain"))
        remote.log_metric(run.info.run_id, "loss", 1.5, step=3)
    assert MlflowClient(store).get_metric_history(run.info.run_id, "loss")[0].value == 1.5  # in the job's store
    from pipeline.network import http_ok

    assert not http_ok(f"{url}/health")  # stopped with the job
    for unchanged in (JobSpec(entry=["t.py"], job_dir=tmp_path, env={"MLFLOW_TRACKING_URI": store}),  # no toolchain
                      JobSpec(entry=["t.py"], job_dir=tmp_path, python=sys.executable,
                              env={"MLFLOW_TRACKING_URI": "http://mlflow:5000"})):
        with tracking_server.for_ranks(unchanged) as same:
            assert same is unchanged

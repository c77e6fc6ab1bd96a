"""docker-compose.yml checked without a Docker engine (none runs on these machines): the Compose tool
itself validates it with a generated env file (Debian's ``docker-compose``, ``config``), and the
references between its services, volumes, env file and the Dockerfile are checked on its resolved form."""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline import deployment
from pipeline.dev.stack import secrets

ROOT = deployment.PROJECT_ROOT
COMPOSE = ROOT / "docker-compose.yml"
AIRFLOW_SERVICES = {"airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer",
                    "airflow-worker", "airflow-gpu-worker"}
ONE_SHOT = {"airflow-init", "minio-init"}
RAY_SERVICES = {"ray-head", "ray-worker"}


def _compose(*args: str, env_file: Path) -> subprocess.CompletedProcess:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose is not installed: apt-get install -y docker-compose (.ci/run does it)")
    return subprocess.run([tool, "--env-file", str(env_file), "-f", str(COMPOSE), *args],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def env_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("compose") / ".env"
    assert secrets.write_env_file(path)
    return path


@pytest.fixture(scope="module")
def resolved(env_file) -> dict:
    out = _compose("config", env_file=env_file)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_the_compose_tool_accepts_the_file_with_a_generated_env_file(env_file):
    out = _compose("config", "-q", env_file=env_file)
    assert out.returncode == 0, out.stderr


def test_without_the_env_file_the_compose_tool_names_the_missing_secret(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    out = _compose("config", "-q", env_file=empty)
    assert out.returncode != 0
    assert "run make stack-env" in out.stderr and "POSTGRES_PASSWORD" in out.stderr, out.stderr


def test_generated_env_file_is_private_complete_and_strong(env_file):
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    values = secrets.read_env_file(env_file)
    required = set(re.findall(r"\$\{(\w+):\?", COMPOSE.read_text()))
    assert required and required <= set(values), required - set(values)
    assert len(values["AIRFLOW_JWT_SECRET"].encode()) >= 64
    from cryptography.fernet import Fernet

    Fernet(values["AIRFLOW_FERNET_KEY"].encode())  # a valid key, or this raises
    assert not secrets.write_env_file(env_file)  # kept: its keys already encrypt data
    other = env_file.with_name("other.env")
    secrets.write_env_file(other)
    assert secrets.read_env_file(other)["AIRFLOW_JWT_SECRET"] != values["AIRFLOW_JWT_SECRET"]


def test_an_env_file_from_before_a_variable_gets_it_and_keeps_its_values(env_file, tmp_path):
    old = tmp_path / ".env"
    kept = {k: v for k, v in secrets.read_env_file(env_file).items() if k != "RAY_AUTH_TOKEN"}
    old.write_text("".join(f"{k}={v}\n" for k, v in kept.items()))
    old.chmod(0o600)
    assert secrets.main([str(old)]) == 0
    values = secrets.read_env_file(old)
    assert {k: values[k] for k in kept} == kept  # the keys that encrypt data are untouched
    assert len(values["RAY_AUTH_TOKEN"]) == 64 and stat.S_IMODE(old.stat().st_mode) == 0o600
    out = _compose("config", "-q", env_file=old)
    assert out.returncode == 0, out.stderr


def test_no_secret_in_committed_files():
    text = COMPOSE.read_text()
    settings_with_secrets = re.findall(r"^\s*(\w*(?:PASSWORD|SECRET|TOKEN|FERNET_KEY|ACCESS_KEY\w*))\s*:\s*(.*)$",
                                       text, re.M)
    assert len(settings_with_secrets) >= 9
    for name, value in settings_with_secrets:
        assert value.startswith("${") and ":?" in value, f"{name}: {value} (a secret must come from the env file)"
    for name, value in re.findall(r"^\s*(AIRFLOW_CONN_\w+)\s*:\s*'(.*)'$", text, re.M):
        password = json.loads(value).get("password")
        assert password is None or re.fullmatch(r"\$\{\w+:\?[^}]*\}", password), f"{name}: a password from the env file"
    for line in re.findall(r"^\s*AIRFLOW__\w+:\s*(.*)$", text, re.M):
        assert not re.search(r"://\w+:[^$@]+@", line), line  # no password inside a URL either
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert ".env" in ignored
    dockerignore = ROOT / ".dockerignore"
    assert dockerignore.exists() and ".env" in dockerignore.read_text().split()


def test_service_references_resolve(resolved):
    services, volumes = resolved["services"], set(resolved.get("volumes") or {})
    assert AIRFLOW_SERVICES | ONE_SHOT | RAY_SERVICES | {"postgres", "redis", "minio", "mlflow"} <= set(services)
    for name, service in services.items():
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            expected = "service_completed_successfully" if dependency in ONE_SHOT else "service_healthy"
            assert condition["condition"] == expected, (name, dependency, condition)
            if expected == "service_healthy":
                assert "healthcheck" in services[dependency], dependency
        if name not in ONE_SHOT:
            assert "healthcheck" in service, f"{name} has no health check"
        for mount in service.get("volumes") or []:
            source = mount.split(":")[0]
            if source.startswith("/"):
                assert Path(source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in volumes, f"{name}: volume {source} is not declared"


def test_only_the_two_uis_publish_ports_on_loopback(resolved):
    published = {name: s["ports"] for name, s in resolved["services"].items() if s.get("ports")}
    assert set(published) == {"airflow-apiserver", "mlflow"}
    for ports in published.values():
        assert all(p.startswith("127.0.0.1:") for p in ports), ports


def test_airflow_services_share_one_configuration_and_reach_each_other(resolved):
    services = resolved["services"]
    envs = [services[name]["environment"] for name in AIRFLOW_SERVICES | {"airflow-init"}]
    for key in ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
        assert len({env[key] for env in envs}) == 1, key
    env = envs[0]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert len(env["AIRFLOW__API_AUTH__JWT_SECRET"].encode()) >= 64
    api = re.match(r"http://([\w-]+):(\d+)/execution/$", env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
    assert api and api.group(1) in services and api.group(2) == "8080"
    assert "--port" in services[api.group(1)]["command"] and "8080" in services[api.group(1)]["command"]
    # MLflow: the host the tasks use passes its Host check; artifacts proxied to the bucket minio-init makes.
    conn = json.loads(env["AIRFLOW_CONN_MLFLOW_DEFAULT"])
    mlflow = services["mlflow"]["command"]
    assert conn["host"] in services
    allowed = mlflow[mlflow.index("--allowed-hosts") + 1].split(",")
    assert f"{conn['host']}:{conn['port']}" in allowed
    assert "--serve-artifacts" in mlflow
    bucket = re.match(r"s3://([\w-]+)/", mlflow[mlflow.index("--artifacts-destination") + 1]).group(1)
    assert f"store/{bucket}" in " ".join(services["minio-init"]["command"])
    assert services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"].startswith("http://minio:")


def test_the_gpu_worker_reserves_gpus_and_serves_the_training_queue(resolved):
    services = resolved["services"]
    gpu = services["airflow-gpu-worker"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert int(gpu["shm_size"]) >= 1 << 30 if str(gpu["shm_size"]).isdigit() else gpu["shm_size"].endswith("gb")
    queue = gpu["environment"]["PIPELINE_TRAIN_QUEUE"]
    command = gpu["command"]
    assert command[command.index("--queues") + 1] == queue
    default = services["airflow-worker"]["command"]
    assert queue not in default[default.index("--queues") + 1].split(",")
    assert gpu["environment"]["PIPELINE_TRAIN_POOL"] in " ".join(services["airflow-init"]["command"])


def test_the_image_is_built_from_the_dockerfile_and_has_what_the_services_use(resolved):
    services = resolved["services"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    images = {services[name]["image"] for name in AIRFLOW_SERVICES | RAY_SERVICES | {"airflow-init", "mlflow"}}
    assert len(images) == 1, images  # one image for Airflow, the training (on Ray too) and MLflow
    built = [s for s in services.values() if s.get("build")]
    assert built and all(Path(s["build"]["context"], s["build"].get("dockerfile", "Dockerfile")).exists() for s in built)
    workdir = re.findall(r"^WORKDIR\s+(\S+)", dockerfile, re.M)[-1]
    env = services["airflow-scheduler"]["environment"]
    for key in ("AIRFLOW__CORE__DAGS_FOLDER", "AIRFLOW__CORE__PLUGINS_FOLDER"):
        folder = env[key]
        assert folder.startswith(workdir + "/"), (key, folder, workdir)
        assert re.search(rf"^COPY\s+{Path(folder).name}\s", dockerfile, re.M), f"the image has no {folder}"
    assert env["PYTHONPATH"] == workdir
    # Folders the services mount volumes on exist in the image (so volumes take its owner, not root).
    mounts = {m.split(":")[1] for name in AIRFLOW_SERVICES for m in services[name].get("volumes") or []}
    for target in mounts:
        assert target in dockerfile or target == env["PIPELINE_HOME"], target
    assert f"PIPELINE_HOME={env['PIPELINE_HOME']}" in dockerfile
    assert re.search(r"^USER\s+(?!root|0\b)\S+", dockerfile, re.M)
    for name in AIRFLOW_SERVICES:  # not root, even when the env file was made by root
        assert not services[name]["user"].startswith("0:"), (name, services[name]["user"])


def _bytes(size) -> int:
    """A compose size (bytes, or a number with b, k, m or g and an optional b) in bytes."""
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower()).groups()
    return int(number) << {"": 0, "k": 10, "m": 20, "g": 30}[unit]


def _flag(command: list[str], name: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}=")]
    return value


def test_the_ray_cluster_shares_the_image_and_the_job_folder_and_airflow_reaches_it(resolved, env_file, monkeypatch):
    from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT

    from pipeline.airflow.connections import ray_connection

    services = resolved["services"]
    head, worker = services["ray-head"], services["ray-worker"]
    assert head["command"][:4] == ["ray", "start", "--head", "--block"] and "--block" in worker["command"]
    assert _flag(worker["command"], "--address") == f"ray-head:{_flag(head['command'], '--port')}"
    assert _flag(head["command"], "--num-cpus") == "0"  # training goes to the worker node
    # The dashboard (the Jobs API) listens on the compose network, and no port is published on the host.
    assert _flag(head["command"], "--dashboard-host") == "0.0.0.0" and not head.get("ports") and not worker.get("ports")
    dashboard = _flag(head["command"], "--dashboard-port")
    assert f"localhost:{dashboard}/" in " ".join(head["healthcheck"]["test"])
    assert f"localhost:{DEFAULT_DASHBOARD_AGENT_LISTEN_PORT}/" in " ".join(worker["healthcheck"]["test"])
    assert _bytes(head["shm_size"]) >= 1 << 30 and _bytes(worker["shm_size"]) >= 8 << 30
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]

    # The job folder: the volume every Airflow worker mounts at PIPELINE_HOME, at the same path on each node.
    airflow = services["airflow-gpu-worker"]
    home = airflow["environment"]["PIPELINE_HOME"]
    (job_volume,) = [m.split(":")[0] for m in airflow["volumes"] if m.split(":")[1] == home]
    for name in RAY_SERVICES:
        assert f"{job_volume}:{home}" in [":".join(m.split(":")[:2]) for m in services[name]["volumes"]], name
        assert not services[name]["user"].startswith("0:"), name
        assert services[name]["user"] == airflow["user"], name  # files in the job folder: one owner

    # Token authentication on both nodes; the Airflow services hold the same token in ray_default.
    token = secrets.read_env_file(env_file)["RAY_AUTH_TOKEN"]
    for name in RAY_SERVICES:
        env = services[name]["environment"]
        assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN"]) == ("token", token), name
    connections = {services[name]["environment"]["AIRFLOW_CONN_RAY_DEFAULT"] for name in AIRFLOW_SERVICES}
    assert len(connections) == 1
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", connections.pop())
    assert ray_connection("ray_default") == (f"http://ray-head:{dashboard}", token)

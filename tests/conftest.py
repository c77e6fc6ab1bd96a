"""Every test session writes under its own temporary PIPELINE_HOME (data, MLflow, Airflow)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before anything imports airflow or reads the settings: the session's own home and Airflow DB.
_HOME = Path(tempfile.mkdtemp(prefix="pipeline-tests-"))
os.environ["PIPELINE_HOME"] = str(_HOME)
# Every variable by which botocore (s3fs, boto3) could find an endpoint, a region or credentials other than a test's.
_AWS_SETTINGS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION",
                 "AWS_DEFAULT_REGION", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_CA_BUNDLE")
for key in ("PIPELINE_DATA_DIR", "PIPELINE_RUNS_DIR", "PIPELINE_MLFLOW_ARTIFACTS", "MLFLOW_TRACKING_URI",
            "AIRFLOW_HOME", "PIPELINE_SWEEP_DB", "PIPELINE_STAGING_DIR", *_AWS_SETTINGS):
    os.environ.pop(key, None)
for key in [k for k in os.environ if k.startswith("AIRFLOW__")]:
    os.environ.pop(key)

from pipeline import deployment  # noqa: E402

deployment.apply_airflow_env()


@pytest.fixture(scope="session")
def pipeline_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def demo_parquet(pipeline_home: Path) -> Path:
    """A small demo dataset (6,000 rows) shared by the tests that only read it."""
    from pipeline.data import demo

    return demo.write_parquet(pipeline_home / "inputs" / "demo.parquet", 6_000, seed=1)


@pytest.fixture(scope="session")
def airflow_db(pipeline_home: Path) -> Path:
    """The session's Airflow metadata DB (SQLite under PIPELINE_HOME), migrated once."""
    from pipeline.dev.demo import migrate_airflow_db

    migrate_airflow_db()
    return pipeline_home / "airflow" / "airflow.db"


def _forget_s3_clients() -> None:
    """Drop fsspec's cached S3 file systems. One is made per endpoint and process, and takes the credentials in the
    environment when it first connects: a test on a reused endpoint would otherwise get another test's client."""
    if "s3fs" in sys.modules:
        sys.modules["s3fs"].S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def s3_server(pipeline_home: Path):
    """An S3 API server for the module (``pipeline.dev.s3_server``): a child process of the test's, only while the
    module that uses it runs (a test elsewhere may count this process's children)."""
    from pipeline.dev.s3_server import S3Server

    server = S3Server(pipeline_home / "logs")
    server.start()
    yield server
    server.stop()
    _forget_s3_clients()


@pytest.fixture
def s3(s3_server, monkeypatch) -> Iterator[str]:
    """A new, empty bucket on the module's S3 server, and this process's environment (inherited by the ranks it
    starts) pointed at it and at nothing else, with no S3 client made before the test: the bucket's URI."""
    import uuid

    for key in _AWS_SETTINGS:
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    _forget_s3_clients()
    yield s3_server.bucket(f"test-{uuid.uuid4().hex[:12]}")
    _forget_s3_clients()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: a file system that really fills up (tests/integration/: ``mount`` is a process)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the injected-failure tests cover the same code")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"could not mount a tmpfs ({done.stderr.strip()}); the injected-failure tests cover the same code")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(autouse=True, scope="module")
def _release_streaming_shared_memory():
    """After each test module, close the shared memory its StreamingDatasets left open. streaming registers
    every block with ``atexit``, so in this long-lived process none is ever freed, and each new dataset
    attaches to every live prefix's block to pick its own: about 36 descriptors per data test early in a
    run, hundreds late, and a whole run reached the 20,000 allowed. (A task runs in a process of its own.)"""
    import atexit
    import gc

    yield
    memory = sys.modules.get("streaming.base.shared.memory")
    if memory is None:
        return
    for obj in gc.get_objects():
        if isinstance(obj, memory.SharedMemory):
            try:
                obj.cleanup()
            except (BufferError, OSError):  # still mapped by a live array: left to the exit handler
                continue
            atexit.unregister(obj.cleanup)


# make test runs the suite in lanes (pytest-xdist workers, ``--dist loadgroup``). What shares a lane:
_LANE_ORDER = ("ray", "e2e", "toolchains", "distributed")
# Then, of the tests none of those markers names, the layer whose tests start processes (tests/unit/ starts none),
# and the few slow ones of the fast layers: a minute-long test last in a lane is a minute the other lane sits idle.
_PROCESS_LAYER = "tests/integration/"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a lane, each module runs whole on one worker (its module fixtures are made once), and every Ray test
    on one worker between them: a Ray test checks that nothing of Ray outlives its cluster (processes, sockets,
    ``/dev/shm`` entries), which another lane's Ray cluster would break. The slower layers go first, so that
    the lanes end together rather than one of them running the slowest module last."""
    if not getattr(config.option, "loadgroup", False):  # what pytest-xdist sets in a worker of --dist loadgroup
        return
    for item in items:
        group = "ray" if item.get_closest_marker("ray") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))

    def lane_rank(item: pytest.Item) -> int:
        early = item.nodeid.startswith(_PROCESS_LAYER) or item.get_closest_marker("slow") is not None
        unmarked = len(_LANE_ORDER) + (0 if early else 1)
        return next((rank for rank, name in enumerate(_LANE_ORDER) if item.get_closest_marker(name)), unmarked)

    items.sort(key=lane_rank)  # stable: collection order within a rank

"""Checkpoints on an object store (``train.checkpoint_uri = s3://...``), against a real S3 API server (moto's, on
127.0.0.1), reached through a relay the tests can take down: kept, pruned and resumed from a download on another
node's staging folder; an upload cut before its marker never resumed and pruned; a damaged newest one skipped; an
outage waited out, or past the store's patience a failed save that leaves nothing complete. Then real torchrun jobs
with their data and checkpoints on the bucket: a rank killed mid-epoch resumes from the bucket, and a store down for
30 s mid-training is waited out, and a preempted job's agreed step is saved there and resumed; all end with the parameters of an uninterrupted run, with nothing of their
checkpoints in the job folder."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import pytest
import torch

from pipeline import stages, storage
from pipeline.recipes import tabular_mlp
from pipeline.train import checkpoint_remote
from pipeline.train.checkpoint import MARKER, STATE_FILE, CheckpointStore
from tests.faults import sigkill_rank, when_checkpoint
from tests.jobs import run_torchrun
from tests.outage import Relay

CHECKPOINT_EVERY = 10


@contextlib.contextmanager
def environ(env: dict[str, str]):
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield


@pytest.fixture
def relay(s3_server, s3, monkeypatch, tmp_path):
    """The S3 server behind a relay that a test can take down; this process and the ranks it starts reach the store
    through it. Staging (the node-local folder of checkpoints) under the test's folder."""
    relay = Relay(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
    monkeypatch.setenv("PIPELINE_STAGING_DIR", str(tmp_path / "staging"))
    yield relay
    relay.down()


def _state(step: int) -> dict:
    return {"step": step, "weights": torch.full((4,), float(step))}


def _steps(uri: str) -> list[str]:
    return sorted({key.split("/")[0] for key in storage.sizes(uri)})


def test_checkpoints_on_a_bucket_keep_the_last_k_and_resume_from_a_download_on_another_node(s3, relay, tmp_path):
    uri = f"{s3}/ckpt/job"
    store = CheckpointStore(uri, keep=2, cache=tmp_path / "node-0")
    written = [store.save(step, _state(step)) for step in (10, 20, 30)]
    assert written == [f"{uri}/step-000000010", f"{uri}/step-000000020", f"{uri}/step-000000030"]
    assert [step for step, _ in store.complete()] == [30, 20]
    assert _steps(uri) == ["step-000000020", "step-000000030"]  # the oldest is gone from the bucket
    assert list((tmp_path / "node-0").iterdir()) == []  # written copies leave the staging folder once uploaded

    other = CheckpointStore(uri, keep=2, cache=tmp_path / "node-1")  # a node that shares no folder with the first
    latest = other.load_latest()
    assert latest.step == 30 and latest.location == f"{uri}/step-000000030"
    assert latest.path == tmp_path / "node-1" / "step-000000030"
    assert torch.equal(latest.state["weights"], torch.full((4,), 30.0))


def test_an_upload_cut_before_its_marker_is_never_resumed_and_the_next_save_removes_it(s3, relay, tmp_path, capsys):
    uri = f"{s3}/ckpt/job"
    store = CheckpointStore(uri, keep=3, cache=tmp_path / "node-0")
    store.save(10, _state(10))
    # A writer killed between its state file and its marker: the state is whole, the marker never landed.
    store.save(20, _state(20))
    storage.remove(f"{uri}/step-000000020/{MARKER}")
    assert list(storage.sizes(f"{uri}/step-000000020")) == [STATE_FILE]

    assert CheckpointStore(uri, cache=tmp_path / "node-1").load_latest().step == 10
    store.save(30, _state(30))
    assert _steps(uri) == ["step-000000010", "step-000000030"]
    assert "step-000000020: a checkpoint whose upload never finished" in capsys.readouterr().out


def test_a_damaged_newest_checkpoint_on_the_bucket_falls_back_to_the_previous(s3, relay, tmp_path, capsys):
    uri = f"{s3}/ckpt/job"
    store = CheckpointStore(uri, cache=tmp_path / "node-0")
    for step in (10, 20):
        store.save(step, _state(step))
    newest = f"{uri}/step-000000020/{STATE_FILE}"
    storage.write_bytes(newest, storage.read_bytes(newest)[:100])  # replaced by a cut-short copy
    latest = CheckpointStore(uri, cache=tmp_path / "node-1").load_latest()
    assert latest.step == 10
    assert f"checkpoint {uri}/step-000000020 is damaged" in capsys.readouterr().out


def test_a_background_upload_waits_out_an_outage_of_the_store(s3, relay, tmp_path, capsys):
    uri = f"{s3}/ckpt/job"
    store = CheckpointStore(uri, cache=tmp_path / "node-0")
    relay.down()
    store.save_in_background(10, _state(10))
    back = threading.Timer(15, relay.up)  # longer than the client's own retries of one request (about 9 s)
    back.start()
    store.wait()  # the write backs off while the store is away and lands once it is back
    back.join()
    assert [step for step, _ in store.complete()] == [10]
    assert "the store did not answer" in capsys.readouterr().out


def test_an_outage_longer_than_the_patience_fails_the_save_and_leaves_nothing_complete(s3, relay, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setattr(checkpoint_remote, "UPLOAD_PATIENCE_S", 0.5)
    uri = f"{s3}/ckpt/job"
    store = CheckpointStore(uri, cache=tmp_path / "node-0")
    store.save(10, _state(10))
    relay.down()
    store.save_in_background(20, _state(20))
    with pytest.raises(Exception) as failed:
        store.wait()
    assert not isinstance(failed.value, (FileNotFoundError, PermissionError))  # a fault of the store, retried
    relay.up()
    assert [step for step, _ in store.complete()] == [10]
    assert not (tmp_path / "node-0" / "step-000000020").exists()


# Real torchrun jobs (2 ranks, gloo), data and checkpoints on the bucket.

@pytest.fixture(scope="module")
def s3_job(s3_server, demo_parquet, tmp_path_factory):
    """A tiny config (about 150 steps per epoch on each of 2 ranks) whose version is published to a bucket of its
    own and whose checkpoints go there too; the environment a job needs to reach the store."""
    import uuid

    bucket = s3_server.bucket(f"jobs-{uuid.uuid4().hex[:12]}")
    folder = tmp_path_factory.mktemp("s3-job")
    env = s3_server.env() | {"PIPELINE_DATA_DIR": f"{bucket}/data", "PIPELINE_STAGING_DIR": str(folder / "staging")}
    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(demo_parquet), "train.epochs": 2, "train.batch_size": 16,
        "train.checkpoint_every_steps": CHECKPOINT_EVERY, "train.log_every_steps": 1,
        "train.lr_schedule": "cosine", "train.warmup_steps": 5, "train.checkpoint_uri": f"{bucket}/checkpoints",
    })
    with environ(env):
        dataset = stages.prepare_data(cfg, stages.RunInfo("s3-faults", "prep"))
    assert dataset.uri.startswith(f"{bucket}/data/")
    config_path = folder / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    return cfg, dataset, config_path, env


def _train(s3_job, out: Path, lines: list[str], env: dict[str, str] | None = None, **options) -> dict:
    cfg, dataset, config_path, job_env = s3_job
    run_torchrun(
        ["-m", "pipeline.rank", "--recipe", "tabular_mlp", "--config", str(config_path), "--dataset", dataset.uri,
         "--out", str(out)],
        job_dir=out, nproc_per_node=2, emit=lines.append, grace_period_s=3, env=job_env | (env or {}), **options,
    )
    return json.loads((out / "result.json").read_text())


def _checkpoints(cfg, out: Path) -> str:
    from pipeline.train.context import checkpoint_location

    return checkpoint_location(cfg.train.checkpoint_uri, out)


def _complete_steps(s3_job, out: Path, env: dict[str, str]):
    def steps() -> list[int]:
        with environ(env):
            return [step for step, _ in CheckpointStore(_checkpoints(s3_job[0], out)).complete()]

    return steps


@pytest.fixture(scope="module")
def s3_reference(s3_job, tmp_path_factory):
    out = tmp_path_factory.mktemp("s3-reference") / "out"
    return _train(s3_job, out, [])


def _assert_only_complete_checkpoints_on_the_bucket(s3_job, out: Path, env: dict[str, str]) -> None:
    with environ(env):
        uri = _checkpoints(s3_job[0], out)
        assert storage.is_remote(uri)
        folders = _steps(uri)
        complete = [storage.join(uri, name) for name in folders]
        assert [location for _, location in CheckpointStore(uri).complete()] == complete[::-1]
        assert len(folders) == s3_job[0].train.keep_checkpoints
    assert not (out / "checkpoints").exists()  # nothing of them in the job folder


@pytest.mark.distributed
def test_a_rank_killed_mid_epoch_resumes_from_the_bucket_to_identical_parameters(s3_job, s3_reference, tmp_path):
    out, killed, lines = tmp_path / "out", {}, []
    env = s3_job[3]
    watcher = when_checkpoint(out, sigkill_rank(1, killed), CHECKPOINT_EVERY, steps=_complete_steps(s3_job, out, env))
    result = _train(s3_job, out, lines, max_restarts=1)
    watcher.join(timeout=5)
    assert killed, "the rank was never killed"
    assert 0 < result["start_step"] < result["steps"]
    assert result["resumed_from"].startswith(_checkpoints(s3_job[0], out) + "/step-")
    assert result["param_digests"] == s3_reference["param_digests"], "the resumed run ended with other parameters"
    _assert_only_complete_checkpoints_on_the_bucket(s3_job, out, env)


@pytest.mark.distributed
def test_a_preempted_job_saves_its_agreed_step_to_the_bucket_and_the_restart_resumes_there(s3_job, s3_reference,
                                                                                          tmp_path):
    """SIGTERM mid-epoch: every rank stops at one step, whose checkpoint is on the bucket (uploaded, marker last)
    before the ranks exit; the restarted attempt downloads it and ends as an uninterrupted run."""
    from tests.integration.test_preemption import preempt_when_training, preempted_step

    out, seen, lines = tmp_path / "out", {}, []
    watcher = preempt_when_training(out / "progress", seen, lines)
    result = _train(s3_job, out, lines, max_restarts=1)
    watcher.join(timeout=5)
    stopped = preempted_step(lines, seen)
    assert result["start_step"] == stopped
    assert result["resumed_from"] == storage.join(_checkpoints(s3_job[0], out), f"step-{stopped:09d}")
    assert result["param_digests"] == s3_reference["param_digests"], "the resumed run ended with other parameters"
    _assert_only_complete_checkpoints_on_the_bucket(s3_job, out, s3_job[3])


@pytest.mark.distributed
def test_a_store_down_for_30_s_mid_training_is_waited_out_to_identical_parameters(s3_job, s3_server, s3_reference,
                                                                                  tmp_path):
    relay = Relay(s3_server.port)
    env = s3_job[3] | {"AWS_ENDPOINT_URL": relay.endpoint}
    out, lines, outages = tmp_path / "out", [], []

    def outage(_beats) -> None:
        outages.append(threading.Thread(target=relay.outage, args=(30,)))
        outages[0].start()

    try:
        watcher = when_checkpoint(out, outage, CHECKPOINT_EVERY, steps=_complete_steps(s3_job, out, env))
        result = _train(s3_job, out, lines, env={"AWS_ENDPOINT_URL": relay.endpoint})
        watcher.join(timeout=5)
        outages[0].join()
    finally:
        relay.down()
    assert outages, "the store was never taken down"
    waited = [line for line in lines if "the store did not answer" in line]
    assert waited, "no upload met the outage"
    assert result["start_step"] == 0  # one attempt: the outage was waited out, not restarted
    assert result["param_digests"] == s3_reference["param_digests"]
    _assert_only_complete_checkpoints_on_the_bucket(s3_job, out, s3_job[3])


@pytest.mark.distributed
def test_sharded_checkpoints_go_to_the_bucket_from_every_rank_and_resume_to_identical_parameters(s3_job, tmp_path):
    """FSDP: each rank uploads its own shard files, rank 0 the state and the marker once all are in; a resume
    downloads the shards and reshards them as from a folder."""
    cfg, dataset, _, env = s3_job
    cfg = cfg.with_overrides({"train.parallelism": "fsdp", "train.keep_checkpoints": 100})
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    out, lines = tmp_path / "out", []
    job = (cfg, dataset, config_path, env)
    whole = _train(job, out, lines)
    with environ(env):
        uri = _checkpoints(cfg, out)
        saved = CheckpointStore(uri).complete()
        assert len(saved) > 2
        step, location = saved[len(saved) // 2]
        files = storage.sizes(location)
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {k.split("/", 1)[1] for k in files if "/" in k}
        assert json.loads(storage.read_bytes(f"{location}/{MARKER}"))["shards"] == {
            k.split("/", 1)[1]: size for k, size in files.items() if k.startswith("shards/")}
        for _, newer in saved[:len(saved) // 2]:
            storage.remove(newer)  # as if the job had stopped at ``step``
    resumed = _train(job, out, lines)
    assert resumed["start_step"] == step and resumed["resumed_from"] == location
    assert resumed["param_digests"] == whole["param_digests"]


# A store that refuses these credentials (moto with its IAM checks on and no user made: every request is a 403).

@pytest.fixture(scope="module")
def refusing_server(pipeline_home):
    from pipeline.dev.s3_server import S3Server

    server = S3Server(pipeline_home / "logs", deny_all=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def refused(refusing_server, monkeypatch, tmp_path):
    for key, value in refusing_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PIPELINE_STAGING_DIR", str(tmp_path / "staging"))
    return refusing_server


def test_a_checkpoint_the_store_refuses_is_a_user_error_naming_bucket_and_key_at_once(refused, tmp_path, capsys):
    from pipeline.errors import ConfigError

    store = CheckpointStore("s3://team-bucket/ckpt/job", cache=tmp_path / "node-0")
    store.save_in_background(10, _state(10))
    with pytest.raises(ConfigError, match=r"access denied to bucket 'team-bucket', key 'ckpt/job/step-000000010"):
        store.wait()
    assert "did not answer" not in capsys.readouterr().out  # not tried again
    assert [p for p in (tmp_path / "node-0").rglob("*") if p.is_file()] == []


def test_a_version_the_store_refuses_is_a_user_error_and_leaves_no_staged_files(refused, demo_parquet, tmp_path):
    from pipeline.errors import ConfigError

    cfg = tabular_mlp.config("tiny").with_overrides({"data.input_path": str(demo_parquet)})
    with environ({"PIPELINE_DATA_DIR": "s3://team-bucket/data"}):
        with pytest.raises(ConfigError, match=r"access denied to bucket 'team-bucket', key 'data/"):
            stages.prepare_data(cfg, stages.RunInfo("refused", "prep"))
    assert [p for p in (tmp_path / "staging").rglob("*") if p.is_file()] == []


@pytest.mark.distributed
def test_a_job_whose_store_refuses_its_credentials_fails_once_as_a_user_error(s3_job, refused, tmp_path):
    """The ranks meet the refusal (their dataset's manifest); the supervisor fails the task without a restart."""
    from pipeline.errors import RankUserError

    cfg, dataset, config_path, env = s3_job
    lines: list[str] = []
    with pytest.raises(RankUserError) as failed:
        _train(s3_job, tmp_path / "out", lines, env=refused.env(), max_restarts=2)
    bucket, key = storage.bucket_and_key(dataset.uri)
    assert f"access denied to bucket '{bucket}', key '{key}" in str(failed.value)
    assert not any("restarting" in line.lower() for line in lines), lines[-20:]

"""A full disk (ENOSPC, EDQUOT) or a read-only one (EROFS) while writing checkpoints, results, shards or model
files is ``OutOfSpace``: it names the path, the bytes needed and the bytes free, is a user error (failed at
once, never retried: a retry writes to the same disk), leaves no partial file, and keeps the previous
checkpoint. Each write is tested on a real full file system (a small tmpfs, mounted when the tests run as
root) and with an injected failure (everywhere)."""

import errno
import os

import pytest
import torch

from pipeline.data.prepare.version import prepare
from pipeline.diskspace import free_bytes, write_atomically
from pipeline.errors import OutOfSpace, UserError
from pipeline.job_files import reported_user_error, user_errors_reported
from pipeline.train.checkpoint import CheckpointStore, state_bytes
from pipeline.train.export import saved_model_files
from tests.datafiles import cfg, published, table, write_parquet


def _state(megabytes: float) -> dict:
    return {"model": {"w": torch.zeros(int(megabytes * (1 << 20)) // 4)}, "step": 1}


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _assert_previous_kept_and_nothing_partial(store: CheckpointStore, step: int) -> None:
    assert [s for s, _ in store.complete()] == [step]
    assert store.load_latest().step == step
    assert sorted(p.name for p in store.root.iterdir()) == [f"step-{step:09d}"]


def test_a_checkpoint_that_does_not_fit_fails_keeping_the_previous_one(small_disk):
    store = CheckpointStore(small_disk / "checkpoints")
    store.save(1, _state(0.5))
    with pytest.raises(OutOfSpace) as raised:
        store.save(2, _state(4))
    message = str(raised.value)
    assert f"{small_disk / 'checkpoints' / 'step-000000002'}: the write failed: no space left on the device" in message
    assert f"it needed {state_bytes(_state(4)):,} bytes, " in message and " bytes are free there" in message
    assert isinstance(raised.value, UserError)
    _assert_previous_kept_and_nothing_partial(store, 1)


def test_a_checkpoint_write_failing_for_space_is_out_of_space_injected(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save(1, _state(0.1))
    real_save = torch.save

    def save_then_fail(obj, f):  # as a full disk does: some bytes written, then ENOSPC (torch wraps it)
        real_save({"part": torch.zeros(1000)}, f)
        try:
            _enospc()
        except OSError:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(OutOfSpace, match=rf"step-000000002: the write failed: no space left on the device .*it "
                                         rf"needed {state_bytes(_state(0.2)):,} bytes, [\d,]+ bytes are free there"):
        store.save(2, _state(0.2))
    _assert_previous_kept_and_nothing_partial(store, 1)


def test_other_write_errors_are_not_out_of_space(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "checkpoints")
    monkeypatch.setattr(torch, "save", lambda obj, f: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError) as raised:
        store.save(1, _state(0.1))
    assert not isinstance(raised.value, OutOfSpace)


def test_a_result_on_a_full_disk_leaves_no_file(small_disk):
    (small_disk / "filler").write_bytes(bytes(free_bytes(small_disk) - 1024))
    with pytest.raises(OutOfSpace, match=r"result.json: the write failed: no space left .* it needed 100,000 bytes"):
        write_atomically(small_disk / "result.json", bytes(100_000))
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_a_read_only_file_system_is_out_of_space_too_injected(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")))
    with pytest.raises(OutOfSpace, match=r"result.json: the write failed: the file system is read-only"):
        write_atomically(tmp_path / "result.json", b"{}")
    assert list(tmp_path.iterdir()) == []


def _prepare_bigger_than(root, tmp_path):
    write_parquet(tmp_path / "in.parquet", table(60_000), row_group_size=20_000)
    return prepare(cfg(tmp_path / "in.parquet", shard_size_limit_bytes=1 << 20, unit_bytes=1 << 30,
                            compression="none"), name="t", out_root=root)


def test_shards_that_do_not_fit_publish_nothing(small_disk, tmp_path):
    with pytest.raises(OutOfSpace, match=r"part-00000/shard\.\d+\.mds: the write failed: no space left .* it needed "
                                         r"[\d,]+ bytes, [\d,]+ bytes are free there"):
        _prepare_bigger_than(small_disk, tmp_path)
    assert published(small_disk) == [] and list((small_disk / "t").iterdir()) == []


def test_a_shard_write_failing_for_space_publishes_nothing_injected(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.setattr(Path, "write_bytes", _enospc)
    with pytest.raises(OutOfSpace, match=r"shard\.00000\.mds: the write failed: no space left .* it needed [\d,]+ bytes"):
        _prepare_bigger_than(tmp_path / "out", tmp_path)
    assert published(tmp_path / "out") == [] and list((tmp_path / "out" / "t").iterdir()) == []


def test_model_files_are_written_whole_or_not_at_all_injected(tmp_path):
    model = torch.nn.Linear(100, 10)
    (tmp_path / "checkpoints").mkdir()

    def write(folder):
        (folder / "network.pt2").write_bytes(b"half a network")
        _enospc()

    with pytest.raises(OutOfSpace, match=rf"the write failed: no space left .* it needed {4 * (100 * 10 + 10):,} bytes"):
        saved_model_files(tmp_path, model, write)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]

    def write_whole(folder):
        (folder / "n.pt2").write_bytes(b"net")
        return {"network": str(folder / "n.pt2")}

    assert saved_model_files(tmp_path, model, write_whole) == {"network": str(tmp_path / "n.pt2")}
    assert (tmp_path / "n.pt2").read_bytes() == b"net"


def test_out_of_space_in_a_rank_reaches_the_task_as_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_ERROR_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(OutOfSpace):
        with user_errors_reported():
            raise OutOfSpace("/runs/x/checkpoints/step-000000002: the write failed: no space left on the device")
    reported = reported_user_error(tmp_path)
    assert isinstance(reported, UserError)  # the supervisor fails the task at once; Airflow does not retry
    assert str(reported).startswith("rank 0: OutOfSpace: /runs/x/checkpoints/step-000000002: the write failed")

"""``tests.streaming_shm.registering`` without processes: its rounds (the leader tries the lock, every rank of the job
answers, all let go and try again until every rank says yes) with a stand-in lock and stand-in ranks, and the real
lock of a process outside a job. Real 2-rank jobs: tests/integration/test_shm_registration.py."""

from __future__ import annotations

import fcntl
import os
import types

import pytest
from streaming.base.world import World

from tests import streaming_shm as shm


@pytest.fixture
def events(monkeypatch) -> list:
    """What the registration did, in order; its pause between rounds is recorded, not slept."""
    events: list = []
    monkeypatch.setattr(shm, "time", types.SimpleNamespace(sleep=lambda s: events.append(("pause", 0.05 <= s <= 0.25))))
    return events


def _as(monkeypatch, *, leader: bool, distributed: bool) -> None:
    monkeypatch.setattr(World, "detect", classmethod(lambda cls: types.SimpleNamespace(is_local_leader=leader)))
    monkeypatch.setattr(shm, "_distributed", lambda: distributed)


def _can_lock(path) -> bool:
    """Whether another open file of ``path`` could take its lock now (then it is given back)."""
    probe = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(probe)


def test_a_leader_in_a_job_tries_without_waiting_and_lets_go_until_every_rank_says_yes(monkeypatch, tmp_path, events):
    _as(monkeypatch, leader=True, distributed=True)
    tries = iter([False, True, True])  # the lock taken in the second round, but another node's leader failed then
    job = iter([False, True])  # what the other ranks answer, round by round

    def try_lock(lock, *, wait):
        events.append(("try", wait))
        return next(tries)

    def every_rank_says(mine, distributed):
        events.append(("says", mine, distributed))
        return mine and next(job)

    monkeypatch.setattr(shm, "_try_lock", try_lock)
    monkeypatch.setattr(shm, "_every_rank_says", every_rank_says)
    with shm.registering(tmp_path / "lock"):
        events.append("block")
    assert events == [("try", False), ("says", False, True), ("pause", True),
                      ("try", False), ("says", True, True), ("pause", True),
                      ("try", False), ("says", True, True), "block"]


def test_a_rank_that_is_not_a_leader_never_opens_the_lock_and_follows_the_job(monkeypatch, tmp_path, events):
    _as(monkeypatch, leader=False, distributed=True)
    job = iter([False, False, True])

    def every_rank_says(mine, distributed):
        events.append(("says", mine, distributed))
        return next(job)

    monkeypatch.setattr(shm, "_try_lock", lambda lock, *, wait: pytest.fail("a rank that is not a leader locked"))
    monkeypatch.setattr(shm, "_every_rank_says", every_rank_says)
    with shm.registering(tmp_path / "lock"):
        events.append("block")
    assert events == [("says", True, True), ("pause", True), ("says", True, True), ("pause", True),
                      ("says", True, True), "block"]
    assert not (tmp_path / "lock").exists()


def test_outside_a_job_the_process_waits_for_the_lock_holds_it_in_the_block_and_gives_it_back(monkeypatch, tmp_path,
                                                                                             events):
    _as(monkeypatch, leader=True, distributed=False)
    waits = []
    real_try_lock = shm._try_lock
    monkeypatch.setattr(shm, "_try_lock", lambda lock, *, wait: waits.append(wait) or real_try_lock(lock, wait=wait))
    lock = tmp_path / "lock"
    with shm.registering(lock):
        assert not _can_lock(lock)
    assert waits == [True] and events == []  # one blocking try: nobody else to agree with
    assert _can_lock(lock)


def test_every_rank_says_is_this_processs_answer_outside_a_job():
    assert shm._every_rank_says(True, distributed=False) is True
    assert shm._every_rank_says(False, distributed=False) is False


def test_the_lock_lives_beside_the_prefixes_it_guards(tmp_path):
    assert shm.registration_lock_path(tmp_path) == tmp_path / "pipeline_streaming_prefix.lock"

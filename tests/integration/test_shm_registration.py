"""StreamingDataset prefixes registered one job at a time on a machine (``tests.streaming_shm.registering``), on real
processes: two jobs opening datasets at the same moments, and the ranks of a 2-rank gloo job that enter the
registration only once another job's lock is free. The retry loop without processes is in tests/unit/test_shm.py."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline import deployment
from tests.datafiles import numbered_rows, open_datasets_in_step
from tests.services import wait_for


@pytest.fixture(scope="module")
def tabular(tmp_path_factory) -> dict:
    return numbered_rows(tmp_path_factory.mktemp("tabular"))


def test_jobs_opening_datasets_at_the_same_moments_each_get_a_prefix_of_their_own(tabular, tmp_path):
    """streaming's ranks look for the first free shared-memory prefix, then their leader creates it: two jobs
    doing so at once picked the same one, and one failed with FileExistsError (13 of 30 openings here without
    ``tests.streaming_shm.registering``)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    jobs = [context.Process(target=open_datasets_in_step, args=(tabular["uri"], str(tmp_path / f"job{i}"), barrier,
                                                                 10, results)) for i in range(2)]
    for job in jobs:
        job.start()
    reports = [results.get(timeout=300) for _ in jobs]
    for job in jobs:
        job.join(timeout=60)
    assert [errors for errors, _ in reports] == [[], []]
    prefixes = [set(p) for _, p in reports]
    assert len(prefixes[0]) == len(prefixes[1]) == 10 and not prefixes[0] & prefixes[1]


# A rank of the job: it enters registering() on the test's lock, and writes down each round of the ranks' agreement
# (its own answer, the job's) and, inside the block, whether its node's lock is held (the leader's check).
RANK = textwrap.dedent(
    """
    import fcntl, os, sys
    from pathlib import Path

    import torch.distributed as dist

    from tests import streaming_shm as shm

    out, lock_path = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agreement = shm._every_rank_says


    def written_down(mine, distributed):
        agreed = agreement(mine, distributed)
        with open(out / f"rounds-{rank}", "a") as rounds:
            rounds.write(f"{int(mine)} {int(agreed)}\\n")
        return agreed


    shm._every_rank_says = written_down
    with shm.registering(lock_path):
        held = None
        if rank == 0:  # the local leader holds the lock throughout the block: another open file cannot take it
            probe = os.open(lock_path, os.O_RDONLY)
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except BlockingIOError:
                held = True
            finally:
                os.close(probe)
        (out / f"entered-{rank}").write_text(str(held))
    dist.destroy_process_group()
    """
)


def _rounds(out: Path, rank: int) -> list[tuple[int, int]]:
    """The rounds rank ``rank`` has written down so far (whole lines only: the rank may be writing one)."""
    try:
        text = (out / f"rounds-{rank}").read_text()
    except FileNotFoundError:
        return []
    return [tuple(map(int, line.split())) for line in text.splitlines(keepends=True) if line.endswith("\n")]


@pytest.mark.distributed
def test_the_ranks_of_a_job_enter_the_registration_only_once_the_lock_is_free(tmp_path):
    """While another job holds the machine's registration lock, the leader (rank 0) cannot take it, the ranks agree
    that not every rank may go on, and neither enters the block, however many rounds they try. Once the lock is
    free both enter, in the same round, with the leader holding the lock."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    lock_path = tmp_path / "registration.lock"
    other_job = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o666)
    fcntl.flock(other_job, fcntl.LOCK_EX)
    log = tmp_path / "job.log"
    with open(log, "w") as output:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                str(script), str(tmp_path), str(lock_path)],
                               env={**os.environ, "PYTHONPATH": str(deployment.PROJECT_ROOT)}, stdout=output,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: job.poll() is not None or all(len(_rounds(tmp_path, rank)) >= 3 for rank in (0, 1)),
                 "both ranks to have tried three rounds", timeout_s=300, poll_s=0.05)
        assert not list(tmp_path.glob("entered-*")), "a rank entered while another job held the lock"
        assert job.poll() is None, log.read_text()
        # Every round so far: the leader could not take the lock, rank 1 could go, and the job may not.
        assert set(_rounds(tmp_path, 0)) == {(0, 0)} and set(_rounds(tmp_path, 1)) == {(1, 0)}

        os.close(other_job)
        other_job = None
        assert job.wait(timeout=300) == 0, log.read_text()
    finally:
        if other_job is not None:
            os.close(other_job)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()

    leader, other = _rounds(tmp_path, 0), _rounds(tmp_path, 1)
    assert len(leader) == len(other) >= 4  # the same rounds on both ranks: each one is a collective
    assert leader[-1] == (1, 1) and other[-1] == (1, 1), (leader, other)
    assert set(leader[:-1]) == {(0, 0)} and set(other[:-1]) == {(1, 0)}  # only the last round agreed
    assert (tmp_path / "entered-0").read_text() == "True" and (tmp_path / "entered-1").read_text() == "None"

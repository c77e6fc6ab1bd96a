"""The rank side of a preemption on real processes: a SIGTERM to a rank's process group (what the torchrun agent
forwards) that leaves its data loader workers running, and 2 ranks agreeing on the step to stop at. What needs no
process (the marker, a request without a process group) is in tests/unit/test_preemption.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from pipeline.job_files import PREEMPTED_EXIT_CODE, read_preemption

RANK = textwrap.dedent(
    """
    import sys, time
    import torch

    from pipeline.train import preemption


    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 30

        def __getitem__(self, i):
            time.sleep(0.02)
            return torch.tensor([i])


    if sys.argv[1] == "installed":
        stop = preemption.install()
        signalled = lambda: stop.requested
    else:  # the rank survives SIGTERM as before, but its workers are not shielded
        import signal

        stop, got = None, []
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
        signalled = lambda: bool(got)
    rows = 0
    for i, batch in enumerate(torch.utils.data.DataLoader(Slow(), batch_size=2, num_workers=1)):
        if i == 0:
            print("started", flush=True)
            while not signalled():  # the test signals the whole process group now
                time.sleep(0.005)
        rows += len(batch)
    print(f"rows {rows} stop {stop.should_stop() if stop else None}", flush=True)
    if stop and stop.should_stop():
        stop.stop(rank=0, step=rows)
    """
)


def _run_rank(tmp_path, mode: str) -> tuple[int, str]:
    """A one-process 'rank' with a loader worker, its process group sent SIGTERM mid-epoch."""
    progress = tmp_path / "progress"
    env = {**os.environ, "PIPELINE_PROGRESS_DIR": str(progress),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", RANK, mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        first = proc.stdout.readline()
        assert first.strip() == "started", first + proc.stdout.read()
        os.killpg(proc.pid, signal.SIGTERM)  # the rank and its loader worker, as the torchrun agent does
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output


def test_a_sigterm_to_the_process_group_leaves_the_loader_worker_running_until_the_step_boundary(tmp_path):
    returncode, output = _run_rank(tmp_path, "installed")
    assert "rows 30 stop True" in output, output  # every batch arrived, then the stop was acted on
    assert returncode == PREEMPTED_EXIT_CODE, output
    assert read_preemption(tmp_path / "progress")["step"] == 30


def test_without_the_shield_the_same_signal_kills_the_loader_worker(tmp_path):
    """The control: what the shield prevents (torch's worker dies on a SIGTERM not sent by its rank, and the
    rank fails on its next batch although it survived the signal)."""
    returncode, output = _run_rank(tmp_path, "unshielded")
    assert returncode == 1 and "rows 30" not in output, output
    # The rank fails fetching its next batch from the dead worker: torch reports the worker's signal, or, when the
    # worker died while handing a batch over, the lost connection to it. Either way inside the loader's fetch.
    assert "_next_data" in output, output
    assert ("DataLoader worker" in output and "Terminated" in output) or "ConnectionResetError" in output, output
    assert read_preemption(tmp_path / "progress") is None


AGREEMENT = textwrap.dedent(
    """
    import os, random, time
    import torch.distributed as dist
    from pipeline.train.preemption import Preemption

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    request = Preemption(None)
    random.seed(rank)
    for step in range(1, 2000):
        time.sleep(random.uniform(0.0, 0.004))  # uneven steps: the ranks drift within a step of each other
        if rank == 1 and step == 120:
            request.handle(15, None)  # only rank 1 is signalled
        if request.should_stop():
            break
    final = request.should_stop(overlap=False)  # an epoch-end check: answered at once, on every rank
    print(f"rank {rank} stopped at step {step} final {final}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.distributed
def test_ranks_agree_on_the_stop_step_when_only_one_rank_is_signalled(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(AGREEMENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], check=False, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    # Two processes print into one pipe: their lines may interleave without a line break between them.
    stops = sorted(re.findall(r"rank (\d) stopped at step (\d+) final (True|False)", done.stdout))
    assert [rank for rank, _, _ in stops] == ["0", "1"], done.stdout
    assert stops[0][1:] == stops[1][1:], done.stdout
    step = int(stops[0][1])
    assert 120 <= step < 1999 and stops[0][2] == "True", done.stdout

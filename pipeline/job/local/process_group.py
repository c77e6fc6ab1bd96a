"""Leader of a training job's process group: whatever happens to the task, no rank outlives it.

``python -m pipeline.job.local.process_group --grace-period-s G -- torchrun ...`` runs in a session of its own
and starts the command. torchrun starts every rank in a session of its own, so a signal to one
process group cannot reach them all: the guard makes itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so that every descendant, even one whose parent died, stays in its
tree, and stops the job by signalling each descendant. When the task process that launched it dies,
even by SIGKILL, the kernel sends the guard SIGTERM (``PR_SET_PDEATHSIG``); on SIGTERM or SIGINT
the guard sends SIGTERM to every descendant (the torchrun agent, every rank, their data loader
workers), waits the grace period, then SIGKILLs what is left. It exits with the command's exit code.

Signalling them all at once is safe for a training job: a rank finishes its step, checkpoints and exits
with ``PREEMPTED_EXIT_CODE`` (``pipeline.train.preemption``; the grace period must cover a step and a
checkpoint), and its loader workers block SIGTERM, so none dies under its rank before the step boundary
(the torchrun agent, on SIGTERM, signals each rank's whole process group, workers included, anyway).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

from pipeline.process_table import descendants

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the supervisor's own stop path still applies
        return False


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def stop_descendants(grace_period_s: float) -> None:
    """SIGTERM every descendant, wait for them up to the grace period, then SIGKILL the rest."""
    me = os.getpid()
    tree = descendants(me)
    _signal_all(tree, signal.SIGTERM)
    _signal_all(tree, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    deadline = time.monotonic() + grace_period_s
    while time.monotonic() < deadline and descendants(me):
        _reap()
        time.sleep(0.1)
    left = descendants(me)
    if left:
        print(f"guard: {len(left)} process(es) still alive {grace_period_s:.0f}s after SIGTERM: SIGKILL",
              file=sys.stderr, flush=True)
        _signal_all(left, signal.SIGKILL)
        while descendants(me):
            _reap()
            time.sleep(0.05)
    _reap()


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.job.local.process_group", description=__doc__.splitlines()[0])
    parser.add_argument("--grace-period-s", type=float, default=10.0)
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    parser.add_argument("--remove-after", action="append", default=[], metavar="DIR",
                        help="a folder of the command's own (a local Ray cluster's sessions) removed when the guard stops it")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_descendants(args.grace_period_s)
        _remove(args.remove_after)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) and os.getppid() != args.parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)  # the parent died before prctl took effect
    child = subprocess.Popen(command)
    returncode = child.wait()
    if descendants(os.getpid()):
        # A rank or loader worker that outlived torchrun (its agent was killed): no leftovers.
        stop_descendants(args.grace_period_s)
    return returncode  # a command that ended by itself keeps its folders: its caller reads them (a start-up log)


def _remove(folders: list[str]) -> None:
    import shutil

    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

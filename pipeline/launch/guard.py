"""Leader of a training job's process group: whatever happens to the task, no rank outlives it.

``python -m pipeline.launch.guard --grace-period-s G -- torchrun ...`` runs in a session of its own
and starts the command in it. When the task process that launched it dies, even by SIGKILL, the
kernel sends the guard SIGTERM (``PR_SET_PDEATHSIG``); on SIGTERM or SIGINT the guard sends SIGTERM
to the whole group (the torchrun agent, every rank, their data loader workers), waits the grace
period, then SIGKILLs the group, itself last. It exits with the command's exit code.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the launcher's own stop path still applies
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def stop_own_group(grace_period_s: float) -> None:
    """SIGTERM every other process of this group, wait for them up to the grace period, then SIGKILL."""
    pgid = os.getpgid(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal reaches the guard too
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_period_s
    while time.monotonic() < deadline and _others_alive(pgid):
        _reap()
        time.sleep(0.1)
    if _others_alive(pgid):
        print(f"guard: processes of group {pgid} still alive {grace_period_s:.0f}s after SIGTERM: SIGKILL",
              file=sys.stderr, flush=True)
        os.killpg(pgid, signal.SIGKILL)  # ends the guard as well


def _others_alive(pgid: int) -> bool:
    me = os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            return True
    return False


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.launch.guard", description=__doc__.splitlines()[0])
    parser.add_argument("--grace-period-s", type=float, default=10.0)
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")

    def stop(signum, frame):
        stop_own_group(args.grace_period_s)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    _die_with_parent(args.parent_pid)
    child = subprocess.Popen(command)  # same process group as the guard
    returncode = child.wait()
    if _others_alive(os.getpgid(0)):
        # A rank or loader worker that outlived torchrun (it was killed, or exited early): no leftovers.
        stop_own_group(args.grace_period_s)
    return returncode


if __name__ == "__main__":
    sys.exit(main())

"""The stack's processes: each started in a session of its own, ended with its descendants."""

from __future__ import annotations

import os
import signal
import time


def stop_processes(roots: list[int], grace_s: float) -> list[int]:
    """SIGTERM every root and each of its descendants, wait up to ``grace_s``, SIGKILL the rest."""
    from pipeline.process_table import alive, descendants

    everyone = list(dict.fromkeys(pid for root in roots if alive(root) for pid in [root, *descendants(root)]))
    for pid in everyone:
        signal_quietly(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(pid) for pid in everyone):
        # Children started while stopping (a task's cleanup) are found and signalled too.
        for pid in [d for root in everyone if alive(root) for d in descendants(root)]:
            if pid not in everyone:
                everyone.append(pid)
                signal_quietly(pid, signal.SIGTERM)
        reap(everyone)
        time.sleep(0.2)
    killed = [pid for pid in everyone if alive(pid)]
    for pid in killed:
        signal_quietly(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in everyone):
        reap(everyone)
        time.sleep(0.1)
    return killed


def signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(pids: list[int]) -> None:
    """Collect exit statuses of our own children (``make ui`` is their parent) so they do not linger."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def ended(pid: int) -> bool:
    from pipeline.process_table import alive

    reap([pid])
    return not alive(pid)

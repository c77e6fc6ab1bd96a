"""Preemption-safe stop on the rank side: SIGTERM asks for a stop, all ranks agree on the step, then exit.

A Kubernetes eviction or a spot reclaim sends SIGTERM to every rank, then SIGKILL after the grace period.
The handler only notes the request; the rank finishes its optimizer step. ``should_stop`` is a
collective that every rank calls once per step, so that ranks signalled at slightly different moments
stop at the same step. The caller then saves its normal checkpoint of that step and calls ``stop``:
rank 0 writes the marker (``pipeline.job_files.mark_preempted``) and every rank exits with
``PREEMPTED_EXIT_CODE``. The generic loop and the framework callbacks (Lightning, Hugging Face) share it:

    preemption = install()           # main thread, before the loaders start their workers
    ...                              # after each optimizer step, on every rank:
    if preemption.should_stop():
        save_checkpoint(step)
        preemption.stop(rank=rank, step=step)

The flags are compared by a non-blocking all-reduce that runs during the following steps' compute, about
every ``CHECK_EVERY_S`` of rank 0's time rather than at every step: on the tabular recipe's small CPU
steps, an all-reduce at every step cost about 10% of the step time on 2 cores.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from pipeline.job_files import PREEMPTED_EXIT_CODE, PROGRESS_DIR_ENV, mark_preempted

STOP_SIGNAL = signal.SIGTERM
# How often the ranks compare their flags, in rank 0's wall time: a stop comes at most about two of these
# (and two steps) after the signal, a small share of any grace period.
CHECK_EVERY_S = 0.1
MAX_CHECK_EVERY_STEPS = 1000


class Preemption:
    """One process's stop request: the flag the signal handler sets and the agreement on it."""

    def __init__(self, progress_dir: Path | None):
        self.progress_dir = progress_dir
        self.requested = False  # set by the signal handler, read only at step boundaries
        self.restart()

    def restart(self) -> None:
        """Forget the agreement's state (not a request): a new training run may use a new process group."""
        self._pending: tuple[Any, Any] | None = None  # (work, [flag, calls to the next check]) in flight
        self._calls = 0
        self._next_check = 1  # the call that compares flags next: the same on every rank
        self._launched = (0.0, 0)  # rank 0: (time, call) of the last all-reduce started, to pace the next
        self._group: Any = None
        self._group_ready = False

    def handle(self, signum: int, frame) -> None:
        # Nothing else happens inside the handler: no collective, no I/O (it interrupts arbitrary code).
        self.requested = True

    def take_signal(self) -> bool:
        """Make SIGTERM set this flag (again). Lightning installs its own handler when ``fit`` starts,
        which broadcasts from inside the handler; its callback takes the signal back. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            return False
        signal.signal(STOP_SIGNAL, self.handle)
        return True

    def should_stop(self, *, overlap: bool = True) -> bool:
        """Collective: every rank calls it at the same points (after each optimizer step). True on every
        rank at the same call once any rank has received SIGTERM.

        With ``overlap`` the all-reduce of the flags is only started at a check and waited for at the next
        one, so that it runs during the steps' compute; the calls in between only count. Rank 0 sets the
        distance to the next check (carried in the all-reduce, so every rank checks at the same call)
        from its step time. ``overlap=False`` compares the flags as they are now, at once (at a boundary
        that has its checkpoint already)."""
        dist = _process_group()
        if dist is None:
            return self.requested
        self._calls += 1
        if overlap and self._calls < self._next_check:
            return False
        agreed, every = self._settle()
        self._launch(dist, pace=overlap)
        if not overlap:
            agreed, every = self._settle()
        self._next_check = self._calls + every
        return agreed

    def stop(self, *, rank: int, step: int) -> NoReturn:
        """Every rank, once its part of the checkpoint of ``step`` is written: rank 0 writes the marker,
        then every rank exits with ``PREEMPTED_EXIT_CODE``."""
        self.conclude(rank=rank, step=step)
        exit_preempted()

    def conclude(self, *, rank: int, step: int) -> None:
        """``stop`` without the exit, for a caller with more to do before it (flush metrics)."""
        self._settle()
        self._barrier()  # every rank's share of the checkpoint is on disk before the marker says so
        if rank == 0:
            if self.progress_dir is not None:
                mark_preempted(self.progress_dir, rank=rank, step=step)
            print(f"preempted: every rank stops at step {step}, its checkpoint saved; exit code "
                  f"{PREEMPTED_EXIT_CODE}", flush=True)
        self._barrier()  # no rank exits before the marker exists: the supervisor reads both together

    def finish(self) -> None:
        """Wait for the all-reduce still in flight (every rank started it), before the group goes away."""
        self._settle()

    def _launch(self, dist, *, pace: bool) -> None:
        import torch

        every = self._pace() if pace and dist.get_rank() == 0 else 0  # MAX: rank 0's proposal wins
        values = torch.tensor([1 if self.requested else 0, every], dtype=torch.int64)
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._flag_group(), async_op=True)
        self._pending = (work, values)

    def _pace(self) -> int:
        """Rank 0: how many calls from the next check to the one after it: ``CHECK_EVERY_S`` of steps at
        the pace since the last check."""
        import time

        now = time.perf_counter()
        (then, call), self._launched = self._launched, (now, self._calls)
        if call == 0:
            return 1
        step_s = (now - then) / max(self._calls - call, 1)
        return max(1, min(MAX_CHECK_EVERY_STEPS, int(CHECK_EVERY_S / max(step_s, 1e-9))))

    def _settle(self) -> tuple[bool, int]:
        """(any rank asked to stop, calls to the next check) of the all-reduce in flight, once done."""
        if self._pending is None:
            return False, 1
        work, values = self._pending
        self._pending = None
        work.wait()
        requested, every = values.tolist()
        return bool(requested), max(1, every)

    def _flag_group(self):
        """The default group on gloo; otherwise a gloo group of all ranks, created at the first call (on
        every rank at the same step): a CPU flag needs no copy from the GPU, which would make the CPU wait
        for the step's kernels."""
        import torch.distributed as dist

        if not self._group_ready:
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self._group_ready = True
        return self._group

    def _barrier(self) -> None:
        dist = _process_group()
        if dist is not None:
            dist.barrier(group=self._flag_group())


_INSTALLED: Preemption | None = None


def install() -> Preemption:
    """This process's ``Preemption`` (one per process: the signal is the process's): SIGTERM sets its
    flag, and processes forked from here on (loader workers) are shielded from SIGTERM. Call it in the
    main thread before the training loop; elsewhere the signal is left alone."""
    global _INSTALLED
    if _INSTALLED is None:
        directory = os.environ.get(PROGRESS_DIR_ENV)
        _INSTALLED = Preemption(Path(directory) if directory else None)
        os.register_at_fork(after_in_child=_shield_forked_child)
        atexit.register(_kill_shielded_children)  # runs before multiprocessing's own exit handler (LIFO)
    _INSTALLED.restart()
    _INSTALLED.take_signal()
    return _INSTALLED


def exit_preempted() -> NoReturn:
    """Leave with ``PREEMPTED_EXIT_CODE``; ``finally`` blocks (process-group teardown) still run."""
    _ignore_stop_signal()
    # Again at exit: on the way out a framework's teardown may restore the handler it found (Lightning does).
    atexit.register(_ignore_stop_signal)
    sys.stdout.flush()
    raise SystemExit(PREEMPTED_EXIT_CODE)


def _ignore_stop_signal() -> None:
    # Once one rank has exited, the torchrun agent SIGTERMs the others. The interpreter restores the
    # default action of a Python handler while it shuts down, so a rank still on its way out would die
    # of that signal and lose its exit code; an ignored signal stays ignored (SIGKILL still works).
    if threading.current_thread() is threading.main_thread():
        signal.signal(STOP_SIGNAL, signal.SIG_IGN)


def _shield_forked_child() -> None:
    # torchrun forwards SIGTERM to each rank's whole process group, loader workers included, and a
    # torch DataLoader worker dies on a SIGTERM that is not from its rank: the rank's next batch would
    # then fail before it reaches the step boundary. Blocked, the signal stays pending; the worker
    # still ends with its rank (the loader's shutdown, or its watchdog when the rank is gone) or by the
    # SIGKILL at the end of the grace period. Only fork-started workers inherit this (the default on
    # Linux up to Python 3.13); spawn and forkserver workers do not.
    signal.pthread_sigmask(signal.SIG_BLOCK, {STOP_SIGNAL})


def _kill_shielded_children() -> None:
    # A rank that leaves on an exception (a peer's death seen by gloo, a bug) may still have loader workers:
    # their iterator was never shut down. multiprocessing's exit handler would SIGTERM them, which they
    # block, and then wait for them forever: the rank would hang until the stall watchdog, and a failure
    # the supervisor restarts on would end as a stall, which it does not. They get SIGKILL instead.
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=5)


def _process_group():
    """``torch.distributed`` when a process group of more than one rank is up, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None

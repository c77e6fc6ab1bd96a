"""A process's exit with a cheap teardown: the ranks' and the torchrun agent's, once their work is done.

Python's finalization collects the object graph that torch and ``torch._dynamo`` build (scanned whole by the
garbage collector's last collections) and frees every module: about 2 s of CPU in a rank, 3 s in a process that
has Airflow and MLflow loaded too, and the task waits for the ranks and the torchrun agent before it goes on.
``exit_now`` stops automatic collections and moves every object the process holds to the collector's permanent
generation (``gc.freeze``), which no collection scans, then exits as usual: the interpreter still runs the
threading module's exit hooks (thread pools told to stop), joins non-daemon threads, runs every ``atexit``
handler (shared-memory cleanup, ``logging.shutdown``, ``weakref.finalize``) and flushes the standard streams, in
its own order. What is left of the teardown (freeing what only the modules hold, the C++ libraries' static
destructors) is a fraction of it (docs/performance.md). ``exit_main`` does so only in a process started for its
module (``python -m``), never in one that runs the module inside itself (a Ray Train worker), which goes on and
must keep collecting its garbage. Standard library only: a toolchain's own Python runs it too.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_main(module: str, code: int) -> NoReturn:
    """End ``python -m module`` with ``exit_now``, but only where the interpreter was started for that module: a
    Ray Train worker runs the same entry with ``runpy`` inside its own long-lived process, which must go on."""
    argv = sys.orig_argv
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] == module:
        exit_now(code)
    sys.exit(code)


def exit_now(code: int) -> NoReturn:
    gc.disable()  # no collection of the whole heap while the exit hooks and atexit handlers run
    gc.freeze()  # nor in finalization's own collections, which run even when disabled
    sys.exit(code)

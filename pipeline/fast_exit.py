"""A process's exit without the interpreter's teardown: the ranks' and the torchrun agent's, once their work is done.

Python's own finalization (freeing every module and collecting the object graph that torch and ``torch._dynamo``
build) takes 1.3 to 1.4 s in a rank and about 1 s in the torchrun agent on 2 cores, and the task waits for both
before it can go on. ``exit_now`` does what the interpreter does at exit up to that point, in its order: the
threading module's exit hooks (thread pools told to stop), non-daemon threads joined, ``atexit`` handlers
(shared-memory cleanup, ``logging.shutdown``, ``weakref.finalize``), the standard streams flushed; then
``os._exit``, as ``multiprocessing`` ends its child processes. ``exit_main`` does so only in a process started for
its module (``python -m``), never in one that runs the module inside itself (a Ray Train worker). Standard
library only: a toolchain's own Python runs it too.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_main(module: str, code: int) -> NoReturn:
    """End ``python -m module`` with ``exit_now``, but only where the interpreter was started for that module: a
    Ray Train worker runs the same entry with ``runpy`` inside its own long-lived process, which must go on."""
    argv = sys.orig_argv
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] == module:
        exit_now(code)
    sys.exit(code)


def exit_now(code: int) -> NoReturn:
    threading._shutdown()  # what Py_FinalizeEx calls first: _register_atexit hooks, then non-daemon threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to save
            pass
    os._exit(code)

"""``python -m pipeline.job.local.torchrun ARGS``: ``torchrun ARGS``, ended by ``pipeline.fast_exit.exit_now``.

The agent imports torch, and its interpreter's teardown took about 1 s after its ranks had finished. Standard
library only before torch's own module runs: a toolchain's Python (``pipeline.toolchains``) runs it too, with
the project root on its path.
"""

from __future__ import annotations

import runpy
import sys

from pipeline.fast_exit import exit_main

if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # as the interpreter maps it: None is 0, a message is printed and is 1
        code = exc.code or 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    exit_main("pipeline.job.local.torchrun", code)

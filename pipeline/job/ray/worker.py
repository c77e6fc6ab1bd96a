"""What runs inside the Ray job: each Ray Train worker runs the job's entry as a torchrun rank would.

Ray Train has set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR/PORT`` and
initialised the process group before ``run_rank`` is called (``pipeline.train.distributed.setup`` joins it
rather than initialising a second one); the job folder's variables, and which try and restart this is
(``PIPELINE_RESTART_COUNT``: the supervisor's, one count per run on every place), come with the job's
``runtime_env``. Every line a worker prints carries ``[rank N]:``, as torchrun's ``--tee`` gives the local place.
"""

from __future__ import annotations

import io
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any


class RankPrefixed(io.TextIOBase):
    """A text stream that starts every line with the rank's prefix."""

    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self._line_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._line_start:
                out.append(self.prefix)
            out.append(piece)
            self._line_start = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return False


def run_rank(config: dict[str, Any]) -> None:
    """One Ray Train worker: the entry (``-m module``, a script, or with ``no_python`` an executable); where the
    nodes share no folder (``config["store"]``), with the job folder fetched from its copy and this rank's files
    pushed there while it runs and after (``pipeline.job.mirror``)."""
    if not config.get("store"):
        return _run_rank(config)
    from pipeline.job.mirror import JobStore, Pushing
    from pipeline.job_files import JobFiles

    store, files, rank = JobStore(config["store"]), JobFiles(Path(config["job_dir"])), int(os.environ.get("RANK", 0))
    store.fetch_inputs(files)
    with Pushing(store, files, rank, rank=rank):
        _run_rank(config)


def _run_rank(config: dict[str, Any]) -> None:
    entry, rank = list(config["entry"]), os.environ.get("RANK", "?")
    prefix = f"[rank {rank}]: "
    if config.get("no_python"):  # an executable (a toolchain's CLI) reading the same environment, its lines live
        with subprocess.Popen(entry, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as proc:
            for line in proc.stdout:
                print(prefix + line.rstrip("\n"), flush=True)
        if proc.returncode:
            raise RuntimeError(f"rank {rank}: {entry[0]} exited with code {proc.returncode}")
        return
    stdout, stderr, argv = sys.stdout, sys.stderr, sys.argv
    sys.stdout, sys.stderr = RankPrefixed(stdout, prefix), RankPrefixed(stderr, prefix)
    try:
        if entry[0] == "-m":
            sys.argv = [entry[1], *entry[2:]]
            runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = entry
            runpy.run_path(entry[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise RuntimeError(f"rank {rank} exited with code {exc.code}") from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr, sys.argv = stdout, stderr, argv

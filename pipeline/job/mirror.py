"""The job folder on an object store, for a job whose nodes share no folder (``PIPELINE_JOB_STORE=s3://bucket/jobs``).

Each job's folder has a copy at ``STORE/KEY/`` (``deployment.job_key``: ``DAG/RUN/TASK``, the same on every try):

- ``in/``: what the ranks read (the job folder's own files: the config), put there by the supervisor before each
  attempt;
- ``nodes/N/``: what node N's ranks wrote (``from_ranks``: heartbeats and the preemption marker, reported user
  errors, rank 0's metrics, model files and result), pushed by the node's agent every ``PUSH_S`` and once more when its ranks
  have exited;
- ``checkpoints/``: the job's checkpoints, unless ``train.checkpoint_uri`` names another place; ``ray/``: a Ray job's
  Train storage path.

On each node the agent (``python -m pipeline.job.mirror --store URI --job-dir DIR --node N -- torchrun ...``, what
the Kubernetes place's pods run) makes the job folder at the same path on the node, fetches ``in/`` into it, runs
torchrun with ``PIPELINE_JOB_STORE_URI`` set, pushes, passes SIGTERM on to torchrun (an eviction: the ranks
checkpoint and mark the preemption) and exits with its code. The supervisor pulls ``nodes/*/`` into its own job
folder as it polls (at most every ``PULL_S``) and once after each attempt, so the stall watchdog, the telemetry,
the metrics relay, the user-error report and the result read the same files as from a shared folder.

A Ray job's workers do the agent's part themselves (``pipeline.job.ray.worker``: each fetches ``in/`` and pushes its
own files under ``nodes/RANK/``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline import deployment, storage
from pipeline.diskspace import space_checked
from pipeline.job_files import JOB_STORE_ENV, JobFiles

PUSH_S = 1.0  # a node's agent pushes what its ranks wrote this often
PULL_S = 2.0  # the supervisor pulls at most this often
FINAL_PATIENCE_S = 120.0  # the last push, once the ranks exited, waits this long for an unreachable store
MIRRORED = ("kubernetes", "ray")  # places whose nodes push (local ranks share this machine's folder)


def from_ranks(files: JobFiles) -> list[Path]:
    """What the ranks write and the supervisor reads: the folders and files of the contract (``pipeline.job_files``),
    with rank 0's model files (those its result names), and the result itself last."""
    found = []
    for path in [files.progress, files.errors, files.metrics, *_model_files(files), files.result]:
        if path.is_dir():
            found += [p for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".")]
        elif path.is_file():
            found.append(path)
    return found


def _written_by(path: Path, files: JobFiles, rank: int) -> bool:
    if path.parent in (files.progress, files.errors) and path.name.startswith("rank-"):
        return path.name == f"rank-{rank}.json"
    return rank == 0


def _model_files(files: JobFiles) -> list[Path]:
    """The files and folders in the job folder that rank 0's result names as its model's (``model_files``)."""
    try:
        named = (files.read_result() or {}).get("model_files") or {}
    except ValueError:
        return []
    return [Path(path) for path in named.values() if Path(path).is_relative_to(files.root)]


def _supervisors(files: JobFiles) -> set[Path]:
    """The job folder's files the supervisor keeps for itself: never sent to the nodes."""
    return {files.result, files.metrics, files.telemetry, files.attempts, files.tracking}


class JobStore:
    """One job folder's copy on the object store (``uri``)."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self._seen: dict[str, object] = {}
        self._last_pull = 0.0

    @classmethod
    def for_job(cls, job_dir: Path | str, kind: str) -> "JobStore | None":
        """The store of the job in ``job_dir`` run on a place of ``kind``, where the deployment has one and the place
        runs nodes of its own (``MIRRORED``); None: the job folder is the nodes' shared folder."""
        store = deployment.job_store()
        return cls(storage.join(store, deployment.job_key(job_dir))) if store and kind in MIRRORED else None

    # The supervisor's side

    def begin_attempt(self, files: JobFiles) -> None:
        """Before an attempt: the last attempt's node files gone, the job folder's own files (its config) in ``in/``."""
        storage.remove(storage.join(self.uri, "nodes"))
        self._seen.clear()
        kept = _supervisors(files)
        for path in sorted(files.root.iterdir()):
            if path.is_file() and path not in kept:
                storage.write_bytes(storage.join(self.uri, "in", path.name), path.read_bytes())

    def pull(self, files: JobFiles, *, now: bool = False) -> None:
        """Every node's files that changed since the last pull, into ``files``' folder (each replaced whole)."""
        if not now and time.monotonic() - self._last_pull < PULL_S:
            return
        self._last_pull = time.monotonic()
        nodes = storage.join(self.uri, "nodes")
        for relative, stamp in storage.stamps(nodes).items():
            _, _, name = relative.partition("/")  # NODE/progress/rank-1.json -> progress/rank-1.json
            if not name or self._seen.get(relative) == stamp:
                continue
            try:
                with space_checked(files.root / name, stamp[0]):  # (size, ETag)
                    storage.download_file(storage.join(nodes, relative), files.root / name)
            except FileNotFoundError:  # removed between the listing and the read
                continue
            self._seen[relative] = stamp

    # A node's side

    def fetch_inputs(self, files: JobFiles) -> None:
        files.root.mkdir(parents=True, exist_ok=True)
        with space_checked(files.root, None):
            storage.download(storage.join(self.uri, "in"), files.root)

    def push(self, files: JobFiles, node: int, *, rank: int | None = None) -> None:
        """What this node's ranks wrote and changed since the last push; with ``rank``, only that rank's files (a Ray
        worker's: its heartbeat and error, and rank 0 the rest), where a node's folder may hold other ranks' too."""
        for path in from_ranks(files):
            if rank is not None and not _written_by(path, files, rank):
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:  # replaced between the listing and here
                continue
            stamp = (stat.st_mtime_ns, stat.st_size)
            relative = path.relative_to(files.root).as_posix()
            if self._seen.get(relative) != stamp:
                storage.upload_file(path, storage.join(self.uri, "nodes", str(node), relative))
                self._seen[relative] = stamp


class Pushing:
    """Push ``files`` every ``PUSH_S`` from a thread while the block runs, and once more after it (waiting up to
    ``FINAL_PATIENCE_S`` for an unreachable store): a node's ranks' files reach the store while they work and
    after they end."""

    def __init__(self, store: JobStore, files: JobFiles, node: int, *, rank: int | None = None):
        self.store, self.files, self.node, self.rank = store, files, node, rank
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-folder-push", daemon=True)

    def __enter__(self) -> "Pushing":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        storage.patiently(self._push, doing=f"pushing the job folder to {self.store.uri}", patience_s=FINAL_PATIENCE_S)

    def _push(self) -> None:
        self.store.push(self.files, self.node, rank=self.rank)

    def _loop(self) -> None:
        while not self._done.wait(PUSH_S):
            try:
                self._push()
            except Exception as exc:  # noqa: BLE001 - the store away for a while: the next push sends it all
                print(f"WARNING: pushing the job folder to {self.store.uri}: {type(exc).__name__}: {exc}", flush=True)


def agent_command(uri: str, job_dir: str, node: str, command: list[str]) -> list[str]:
    """``command`` (a node's torchrun) run by this module's agent: what a pod runs when nodes share no folder."""
    return ["python", "-m", "pipeline.job.mirror", "--store", uri, "--job-dir", job_dir, "--node", node, "--", *command]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--node", required=True, type=int)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    store, files = JobStore(args.store), JobFiles(args.job_dir)
    store.fetch_inputs(files)
    files.progress.mkdir(parents=True, exist_ok=True)
    with Pushing(store, files, args.node):
        child = subprocess.Popen(command, env=os.environ | {JOB_STORE_ENV: store.uri})
        for sig in (signal.SIGTERM, signal.SIGINT):  # an eviction reaches the ranks through torchrun, as without us
            signal.signal(sig, lambda signum, frame: child.send_signal(signum))
        child.wait()
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())

"""Publishing a dataset version to an object store (``PIPELINE_DATA_DIR=s3://bucket/prefix``), where nothing can be
renamed into place.

The version is converted in a local staging folder as on a file system, then uploaded to ``NAME/VERSION/`` with
its ``manifest.json`` last: readers only open versions with a manifest, so a partial upload (a writer killed, the
store unreachable) is never seen as a version. One writer at a time: a writer first takes the version's lease,
``NAME/VERSION/.writer.json``, created only where none is (``If-None-Match: *``), and renews it while it works;
another publisher of the same version waits for the manifest, and takes over a lease not renewed for
``STALE_LEASE_S`` (its writer is gone). A writer that finds its lease taken over stops before its manifest, so two
writers never leave a mixed version.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline import deployment, storage
from pipeline.data.versions.manifest import MANIFEST
from pipeline.errors import InfraError

log = logging.getLogger(__name__)

LEASE = ".writer.json"
RENEW_S = 30.0
STALE_LEASE_S = 300.0  # ten renewals missed: the writer is gone
POLL_S = 2.0


class LeaseLost(InfraError):
    """Another writer took this writer's lease over (it missed its renewals): it publishes nothing more."""


def staging_folder(name: str, version: str) -> Path:
    """A node-local folder to convert a version in before its upload (``deployment.staging_dir``); removed after the
    upload, whatever its end."""
    root = deployment.staging_dir()
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-{version}-", dir=root))


class Lease:
    """One writer's claim on a version's folder on the object store."""

    def __init__(self, final: str):
        self.final, self.uri = final, storage.join(final, LEASE)
        self.token = uuid.uuid4().hex
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                           "renewed": time.time()}).encode()

    def take(self) -> bool:
        """Create the lease where there is none; False when another writer holds it."""
        if not storage.write_bytes(self.uri, self._body(), create=True):
            return False
        self._thread = threading.Thread(target=self._renew, name="version-lease", daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                held = json.loads(storage.read_bytes(self.uri)).get("token")
                if held != self.token:
                    self.lost.set()
                    return
                storage.write_bytes(self.uri, self._body())
            except Exception as exc:  # noqa: BLE001 - a missed renewal; the next one tries again
                log.warning("renewing the lease %s failed (%s); trying again in %.0fs", self.uri, exc, RENEW_S)

    def check(self) -> None:
        if self.lost.is_set():
            raise LeaseLost(f"{self.uri}: another writer took this version over (this one missed its renewals "
                            f"for {STALE_LEASE_S:.0f}s); nothing more is published by this one")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(FileNotFoundError, ValueError):
            if json.loads(storage.read_bytes(self.uri)).get("token") == self.token:  # never another writer's
                storage.remove(self.uri)


@contextlib.contextmanager
def writing(final: str, published: Callable[[str], dict[str, Any] | None]) -> Iterator[tuple[Lease | None, dict | None]]:
    """Hold the version's lease while the body writes it: yields ``(lease, None)``, or ``(None, manifest)`` when
    another writer published the version meanwhile (``published(final)``: its manifest when intact, else None)."""
    waited = False
    while True:
        manifest = published(final)
        if manifest is not None:
            yield None, manifest
            return
        lease = Lease(final)
        if lease.take():
            break
        age = storage.modified_age_s(lease.uri)
        if age is not None and age > STALE_LEASE_S:
            log.warning("%s was last renewed %.0fs ago: its writer is gone, taking the version over", lease.uri, age)
            storage.remove(lease.uri)
            continue
        if not waited:
            log.info("version %s is being written by another process (%s): waiting for it", final, lease.uri)
            waited = True
        time.sleep(POLL_S)
    try:
        manifest = published(final)  # published between the look above and the lease
        yield (None, manifest) if manifest is not None else (lease, None)
    except BaseException:
        if not lease.lost.is_set():
            with contextlib.suppress(Exception):
                _remove_partial(final)
        raise
    finally:
        lease.release()


def wait_for_writers(root: str, timeout_s: float, poll_s: float = POLL_S) -> list[str]:
    """Wait, at most ``timeout_s``, while versions of the dataset at ``root`` are being uploaded (their leases
    renewed within ``STALE_LEASE_S``); returns the versions still being written when the wait ended."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        writing = [name for name in storage.listing(root) if not name.startswith(".")
                   and (age := storage.modified_age_s(storage.join(root, name, LEASE))) is not None
                   and age <= STALE_LEASE_S]
        if not writing or time.monotonic() >= deadline:
            return writing
        if not waited:
            log.info("waiting up to %.0fs for %d version(s) of %s being uploaded: %s", timeout_s, len(writing),
                     root, writing)
            waited = True
        time.sleep(poll_s)


def _remove_partial(final: str) -> None:
    """Delete what a failed writer uploaded (never a published version: it has a manifest)."""
    names = storage.sizes(final)
    if MANIFEST in names:
        return
    for name in names:
        if name != LEASE:
            storage.remove(storage.join(final, name))


def upload(staged: Path, final: str, lease: Lease) -> None:
    """Upload the staged version to ``final``, the manifest last, while the lease is this writer's."""
    started = time.perf_counter()
    total = sum(p.stat().st_size for p in staged.rglob("*") if p.is_file())
    lease.check()
    storage.upload(staged, final, last=MANIFEST, before_last=lease.check)
    log.info("uploaded %d bytes to %s in %.1fs", total, final, time.perf_counter() - started)


def discard(staged: Path) -> None:
    shutil.rmtree(staged, ignore_errors=True)

"""Where a job's attempts run (``launch.kind``): what every place is asked for, the registry of places, and
the cluster access that the layer above hands them.

A place decides *where* only: what runs (the entry, a toolchain's interpreter and image) is resolved into the
``JobSpec`` before a place is chosen (``pipeline.job.spec.resolve``), and the launch settings were checked when
the config was made. What an ending means is ``pipeline.job.policy``'s; what every place guarantees is
``pipeline.job.supervisor``'s.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

from pipeline.errors import ConfigError
from pipeline.job.policy import Ended
from pipeline.job.spec import Attempt, JobSpec

Emit = Callable[[str], None]

# launch.kind -> the place that runs its attempts, imported on use.
PLACES = {"local": "pipeline.job.local.place:LocalPlace", "kubernetes": "pipeline.job.kubernetes.place:KubernetesPlace",
          "ray": "pipeline.job.ray.place:RayPlace"}


class Clusters(Protocol):
    """How places reach the clusters that launch settings name by connection id. The Airflow layer hands in its
    connections (``pipeline.airflow.connections.AirflowClusters``): the job layer never looks them up itself."""

    def kubernetes_client(self, connection_id: str) -> Any:
        """The official client's ``ApiClient``."""

    def kubernetes_async(self, connection_id: str) -> Any:
        """The asyncio client's connection context (``async with ... as api``)."""

    def ray(self, connection_id: str) -> tuple[str | None, str | None]:
        """(dashboard address, bearer token) of a Ray cluster; (None, None) without one."""


class NoClusters:
    """A job started outside Airflow: no connection to look up."""

    def kubernetes_client(self, connection_id: str) -> Any:
        raise ConfigError(f"launch.kind=kubernetes reaches its cluster through the Airflow connection "
                          f"{connection_id!r}: run the job from an Airflow task, or pass the cluster access (clusters=)")

    kubernetes_async = kubernetes_client

    def ray(self, connection_id: str) -> tuple[str | None, str | None]:
        return None, None


class Place(Protocol):
    """Where attempts run: a place starts, polls and stops one attempt at a time. Nothing here decides what an
    ending means (``pipeline.job.policy``)."""

    poll_s: float  # how often the supervisor polls it

    def start(self, attempt: Attempt, emit: Emit) -> None:
        """Start the attempt; its output lines go to ``emit`` (from any thread), prefixed with rank or node."""

    def poll(self) -> Ended | None:
        """How the attempt ended, or None while it runs."""

    def stop(self, grace_period_s: float) -> None:
        """End the attempt for good, from any thread, any number of times: SIGTERM (or the place's
        equivalent), ``grace_period_s``, then a kill; nothing of it is left when this returns."""

    def dump_stacks(self, beats: dict[int, dict[str, Any]], emit: Emit) -> None:
        """Ask the ranks of a stalled attempt for their stack traces, where the place can reach them."""


class DeferrablePlace(Place, Protocol):
    """A place whose attempts outlive the task's process, so that the wait can move to Airflow's triggerer
    (``pipeline.airflow.deferred``): submitted from a worker, watched from the triggerer, torn down by name."""

    watch: str  # "module:Class" of its async watch: ``Watch(**handle, clusters=, created_at=, log=)``

    def submit(self, attempt: Attempt, emit: Emit) -> Any:
        """Create the attempt's objects (replacing what a dead worker of the same attempt left)."""

    def handle(self, attempt: Attempt) -> dict[str, Any]:
        """What the triggerer needs to watch the attempt (JSON, no secrets)."""

    def teardown(self, attempt: Attempt, grace_period_s: float) -> None:
        """Stop and remove the attempt's objects by name, and wait until they are gone."""


class Watch(Protocol):
    """A deferrable place's poll in the triggerer: an async context manager."""

    async def poll(self) -> Ended | None: ...

    async def stop(self) -> None: ...


def place_for(spec: JobSpec, clusters: Clusters | None = None) -> Place:
    """The place of ``launch.kind``."""
    module, _, attr = PLACES[spec.launch.kind].partition(":")
    return getattr(importlib.import_module(module), attr)(spec, clusters or NoClusters())


def deferrable_place(spec: JobSpec, clusters: Clusters | None = None) -> DeferrablePlace:
    place = place_for(spec, clusters)
    if not hasattr(place, "watch"):
        raise ConfigError(f"launch.kind={spec.launch.kind!r} cannot defer: it runs the ranks as children of the "
                          f"task's own process")
    return place


def watch_for(path: str, handle: dict[str, Any], **kwargs: Any) -> Watch:
    """The watch class at ``path`` (a ``DeferrablePlace.watch``), made for one attempt's ``handle``."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)(**handle, **kwargs)

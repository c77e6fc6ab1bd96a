"""``dag.test``'s in-process execution API with the routes of one API version.

``dag.test`` runs each task in the calling process and sends the task SDK's calls (start, heartbeat, XCom,
finish) to an in-process copy of Airflow's execution API, a FastAPI app built on first use. Cadwyn builds that
app's routes once for every API version Airflow serves (nine in Airflow 3.3), each a copy of every route with
its request and response schemas: 2.5 s of the first task's start on 2 idle cores, 5 s on busy ones. The
app's only client is the task SDK of the same installation, which speaks one version (``API_VERSION``, the
newest), so ``make demo`` and the tests build only that version's routes, which are the newest routes as they
are (a Cadwyn version's changes describe the way to the version before it).

Where this Airflow is not as expected (the SDK speaks another version than the newest, the newest version
changes something, the trimmed app fails its first request), Airflow's own app is left to be built as usual.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# Cadwyn's tag on routes that exist only in older versions (``VersionedAPIRouter.only_exists_in_older_versions``).
OLDER_VERSIONS_ONLY = "_CADWYN_DELETED_ROUTE"


def build_for_sdk_version() -> bool:
    """Build this process's in-process execution API (``dag.test``'s, built once per process) with the routes of
    the task SDK's API version only; True when it did (or had), False when Airflow's own app is left to build."""
    from airflow.sdk.execution_time.supervisor import in_process_api_server

    api = in_process_api_server()
    if getattr(api, "_app", None) is not None:
        return bool(getattr(api.app.state, "one_version", False))
    try:
        trimmed = _trimmed()
        if trimmed is None:
            return False
        with _swapped(*trimmed):
            app = api.app
        app.state.one_version = True
        _first_request(api)
    except Exception as exc:  # Airflow's app instead: slower, never wrong
        log.warning("dag.test's execution API with one version failed (%s: %s); building every version",
                    type(exc).__name__, exc)
        in_process_api_server.cache_clear()
        return False
    return True


def _trimmed():
    """The one-version bundle and the router without older versions' routes, or None."""
    from cadwyn import HeadVersion, Version, VersionBundle
    from fastapi import APIRouter

    from airflow.api_fastapi.execution_api import routes, versions
    from airflow.sdk.api.client import API_VERSION

    bundle = versions.bundle
    newest = bundle.versions[0].value if bundle.versions else None
    if newest != API_VERSION or bundle.head_version.changes:
        log.info("dag.test's execution API: every version (the task SDK speaks %s, the newest is %s)",
                 API_VERSION, newest)
        return None
    router = APIRouter()
    router.routes = [route for route in routes.execution_api_router.routes
                     if OLDER_VERSIONS_ONLY not in (getattr(route, "tags", None) or ())]
    return VersionBundle(HeadVersion(), Version(API_VERSION)), router


class _swapped:
    """``create_task_execution_api_app`` reads the bundle and the router from their modules when called."""

    def __init__(self, bundle, router):
        from airflow.api_fastapi.execution_api import routes, versions

        self.targets = [(versions, "bundle", bundle), (routes, "execution_api_router", router)]

    def __enter__(self):
        self.saved = [(module, name, getattr(module, name)) for module, name, _ in self.targets]
        for module, name, value in self.targets:
            setattr(module, name, value)

    def __exit__(self, *exc):
        for module, name, value in self.saved:
            setattr(module, name, value)


def _first_request(api) -> None:
    """Cadwyn generates the routes at the app's first request: make it here, so that a failure falls back."""
    import httpx

    from airflow.sdk.api.client import API_VERSION

    client = httpx.Client(transport=api.transport, base_url="http://in-process.invalid")
    response = client.get("/health", headers={"Airflow-API-Version": API_VERSION})
    if response.status_code != 200:
        raise RuntimeError(f"GET /health answered {response.status_code}: {response.text[:200]}")

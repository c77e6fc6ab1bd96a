"""dag.test's in-process execution API built for the task SDK's API version only (pipeline/dev/execution_api.py).
Each check runs in a fresh interpreter: the in-process API is built once per process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Every route of one version of a Cadwyn app: path, methods, and the JSON schemas of its body and response.
ROUTES = """
def routes(app, version):
    import json
    from fastapi.routing import APIRoute

    found = {}
    for route in app.router.versioned_routers[version].routes:
        if not isinstance(route, APIRoute):
            continue
        body = route.body_field.field_info.annotation if route.body_field else None
        schema = lambda model: json.dumps(model.model_json_schema(), sort_keys=True) if hasattr(
            model, "model_json_schema") else repr(model)
        found[f"{sorted(route.methods)} {route.path}"] = [schema(body), schema(route.response_model)]
    return found
"""


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(ROUTES) + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_sdk_versions_routes_are_airflows_own_for_that_version(airflow_db):
    out = _run("""
        import httpx, json
        from pipeline import deployment
        deployment.apply_airflow_env()
        from airflow.api_fastapi.execution_api.app import create_task_execution_api_app
        from airflow.sdk.api.client import API_VERSION
        from airflow.sdk.execution_time.supervisor import in_process_api_server
        from pipeline.dev.execution_api import build_for_sdk_version

        full = create_task_execution_api_app()
        full._cadwyn_initialize()  # what its first request does
        built = build_for_sdk_version()
        app = in_process_api_server().app
        client = httpx.Client(transport=in_process_api_server().transport, base_url="http://in-process.invalid")
        print(json.dumps({
            "built": built, "again": build_for_sdk_version(), "versions": sorted(app.router.versioned_routers),
            "full_versions": len(full.router.versioned_routers), "sdk": API_VERSION,
            "full": routes(full, API_VERSION), "one": routes(app, API_VERSION),
            "health": client.get("/health", headers={"Airflow-API-Version": API_VERSION}).status_code,
        }))
    """)
    assert out["built"] and out["again"]
    assert out["full_versions"] > 2 and len(out["versions"]) <= 2 and out["sdk"] in out["versions"]
    assert len(out["full"]) > 20 and sum(schemas != ["None", "None"] for schemas in out["full"].values()) > 10
    assert out["one"] == out["full"]  # the same routes, methods and schemas as Airflow's app serves that version
    assert out["health"] == 200


def test_an_sdk_of_another_version_gets_airflows_whole_api(airflow_db):
    out = _run("""
        import json
        from pipeline import deployment
        deployment.apply_airflow_env()
        import airflow.sdk.api.client as sdk_client
        from airflow.sdk.execution_time.supervisor import in_process_api_server
        from pipeline.dev.execution_api import build_for_sdk_version

        sdk_client.API_VERSION = "2025-04-28"  # an older client than the newest version the server knows
        built = build_for_sdk_version()
        app = in_process_api_server().app
        print(json.dumps({"built": built, "one_version": getattr(app.state, "one_version", False)}))
    """)
    assert out == {"built": False, "one_version": False}


def test_a_failure_leaves_airflows_whole_api(airflow_db):
    out = _run("""
        import json
        from pipeline import deployment
        deployment.apply_airflow_env()
        import pipeline.dev.execution_api as one
        from airflow.sdk.execution_time.supervisor import in_process_api_server

        one.OLDER_VERSIONS_ONLY = "not cadwyn's tag"  # the compat routes stay: Cadwyn refuses the one-version app
        built = one.build_for_sdk_version()
        app = in_process_api_server().app
        print(json.dumps({"built": built, "one_version": getattr(app.state, "one_version", False),
                          "versions": len(app.versions.versions)}))
    """)
    assert out["built"] is False and out["one_version"] is False
    assert out["versions"] > 2

"""Airflow connections the pipeline reads: MLflow's (``PIPELINE_MLFLOW_CONN_ID``, default ``mlflow_default``), the
object store's (``PIPELINE_STORAGE_CONN_ID``, default ``aws_default``), and the clusters of the Kubernetes and Ray
places, handed to the job layer as ``AirflowClusters`` (the job layer never looks a connection up itself)."""

from __future__ import annotations

import os

from pipeline.errors import InfraError


def mlflow_connection():
    """The Airflow connection named by ``PIPELINE_MLFLOW_CONN_ID`` (default ``mlflow_default``), if any.

    Only a connection that does not exist falls back to the environment (or the local default); a
    lookup that fails (the API server or a secrets backend unreachable) is a retryable fault: silently
    using the local store instead would log and register into the wrong place."""
    return _connection(os.environ.get("PIPELINE_MLFLOW_CONN_ID", "mlflow_default"), "MLflow")


def mlflow_env_from_connection(conn) -> dict[str, str]:
    """MLflow's own environment variables from an Airflow connection (host, login/password or token).

    They reach the torchrun ranks by inheritance, never on a command line; Airflow masks the
    connection's password in task logs.
    """
    if conn is None or not conn.host:
        return {}
    host = conn.host if "://" in conn.host else f"{conn.schema or conn.conn_type or 'http'}://{conn.host}"
    env = {"MLFLOW_TRACKING_URI": f"{host}:{conn.port}" if conn.port else host}
    if conn.login:
        env["MLFLOW_TRACKING_USERNAME"] = conn.login
    if conn.password:
        env["MLFLOW_TRACKING_PASSWORD"] = conn.password
    token = (conn.extra_dejson or {}).get("token")
    if token:
        env["MLFLOW_TRACKING_TOKEN"] = token
    return env


def storage_connection():
    """The Airflow connection named by ``PIPELINE_STORAGE_CONN_ID`` (default ``aws_default``: the Amazon provider's
    own), if any; a failed lookup is a retryable fault, as for MLflow's."""
    return _connection(os.environ.get("PIPELINE_STORAGE_CONN_ID", "aws_default"), "the object store")


def storage_env_from_connection(conn) -> dict[str, str]:
    """The standard AWS variables from an AWS-type Airflow connection: the key pair (login, password), and from its
    extra ``aws_session_token``, ``endpoint_url`` (MinIO, another S3 API) and ``region_name``, as the Amazon
    provider reads them. Every client of the pipeline reads these (``pipeline.storage``), the torchrun ranks by
    inheritance, never on a command line; the secret parts are masked in task logs."""
    if conn is None:
        return {}
    from airflow.sdk.log import mask_secret

    extra = conn.extra_dejson or {}
    env = {"AWS_ACCESS_KEY_ID": conn.login, "AWS_SECRET_ACCESS_KEY": conn.password,
           "AWS_SESSION_TOKEN": extra.get("aws_session_token"), "AWS_ENDPOINT_URL": extra.get("endpoint_url"),
           "AWS_DEFAULT_REGION": extra.get("region_name")}
    for secret in (conn.password, extra.get("aws_session_token")):
        if secret:
            mask_secret(secret)
    return {key: str(value) for key, value in env.items() if value}


def _connection(conn_id: str, what: str):
    """The Airflow connection ``conn_id``, or None when it does not exist; a lookup that fails is an InfraError."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None
    except Exception as exc:
        raise InfraError(f"looking up the Airflow connection {conn_id!r} for {what} failed: "
                         f"{type(exc).__name__}: {exc}") from exc


def kubernetes_client(connection_id: str):
    """The official client's ``ApiClient`` for the provider's connection (in-cluster or kube config without one)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    return KubernetesHook(conn_id=connection_id).get_conn()


def kubernetes_async_connection(connection_id: str):
    """The asyncio client's connection context for the provider's connection (``async with ... as api``)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

    return AsyncKubernetesHook(conn_id=connection_id).get_conn()


def ray_connection(connection_id: str) -> tuple[str | None, str | None]:
    """(dashboard address, bearer token) of a Ray cluster's Airflow connection; (None, None) without one.

    The address is ``http://host:port`` (the schema or ``https`` in the host is kept; port 8265 by
    default); the token is the password, or ``token`` in the extra."""
    conn = _connection(connection_id, "Ray")
    if conn is None:
        return None, None
    token = conn.password or (conn.extra_dejson or {}).get("token") or None
    if not conn.host:
        return None, token
    host = conn.host if "://" in conn.host else f"{conn.schema or 'http'}://{conn.host}"
    return f"{host}:{conn.port or 8265}", token


class AirflowClusters:
    """The clusters' access for the places (``pipeline.job.places.Clusters``), through Airflow's connections."""

    def kubernetes_client(self, connection_id: str):
        return kubernetes_client(connection_id)

    def kubernetes_async(self, connection_id: str):
        return kubernetes_async_connection(connection_id)

    def ray(self, connection_id: str) -> tuple[str | None, str | None]:
        return ray_connection(connection_id)

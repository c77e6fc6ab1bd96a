"""Credentials for a remote MLflow come from an Airflow connection and stay out of logs."""

from airflow.sdk import Connection

from pipeline.airflow.connections import mlflow_env_from_connection
from pipeline.job.local.place import torchrun_command


def test_connection_becomes_mlflow_environment_without_credentials_in_the_uri():
    conn = Connection(conn_id="mlflow_default", conn_type="http", host="mlflow.internal", port=5000,
                      login="trainer", password="s3cr3t-pass", extra='{"token": "tok-123"}')
    env = mlflow_env_from_connection(conn)
    assert env == {
        "MLFLOW_TRACKING_URI": "http://mlflow.internal:5000",
        "MLFLOW_TRACKING_USERNAME": "trainer",
        "MLFLOW_TRACKING_PASSWORD": "s3cr3t-pass",
        "MLFLOW_TRACKING_TOKEN": "tok-123",
    }


def test_https_scheme_and_no_connection():
    conn = Connection(conn_id="m", conn_type="http", host="https://mlflow.example.com", login=None, password=None)
    assert mlflow_env_from_connection(conn) == {"MLFLOW_TRACKING_URI": "https://mlflow.example.com"}
    assert mlflow_env_from_connection(None) == {}


def test_the_logged_launch_command_carries_no_environment(tmp_path):
    # run_torchrun logs this command line; credentials travel only in the child's environment.
    command = " ".join(torchrun_command(["-m", "pipeline.rank", "--config", "c.json"], nproc_per_node=2, log_dir=tmp_path))
    assert "s3cr3t" not in command and "MLFLOW_TRACKING_PASSWORD" not in command


def test_a_failing_connection_lookup_is_a_retryable_fault_not_a_silent_fallback(monkeypatch):
    import pytest
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    from pipeline.airflow.connections import mlflow_connection as _mlflow_connection
    from pipeline.errors import InfraError

    def unreachable(conn_id):
        raise ConnectionError("api-server at 127.0.0.1:8080 refused the connection")

    monkeypatch.setattr(BaseHook, "get_connection", unreachable)
    with pytest.raises(InfraError, match="looking up the Airflow connection 'mlflow_default'.*refused"):
        _mlflow_connection()

    def missing(conn_id):
        raise AirflowNotFoundException(f"The conn_id `{conn_id}` isn't defined")

    monkeypatch.setattr(BaseHook, "get_connection", missing)
    assert _mlflow_connection() is None  # no such connection: the environment (or the local default) is used


def test_an_aws_connection_becomes_the_standard_aws_environment():
    from pipeline.airflow.connections import storage_env_from_connection

    conn = Connection(conn_id="aws_default", conn_type="aws", login="AKIAEXAMPLE", password="wJalr-secret",
                      extra='{"endpoint_url": "http://minio:9000", "region_name": "eu-west-1", '
                            '"aws_session_token": "session-tok"}')
    assert storage_env_from_connection(conn) == {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "wJalr-secret", "AWS_SESSION_TOKEN": "session-tok",
        "AWS_ENDPOINT_URL": "http://minio:9000", "AWS_DEFAULT_REGION": "eu-west-1"}
    # Only what the connection holds: a role's connection with no keys leaves the environment's (or the role's).
    assert storage_env_from_connection(Connection(conn_id="aws_default", conn_type="aws")) == {}
    assert storage_env_from_connection(None) == {}

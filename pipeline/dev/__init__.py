"""Developer tooling, not used by the DAGs: the demo runner, the airflow CLI on the embedded settings, and
the local services stack."""

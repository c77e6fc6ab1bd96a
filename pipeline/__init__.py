"""Airflow-orchestrated distributed (DDP) training pipelines."""

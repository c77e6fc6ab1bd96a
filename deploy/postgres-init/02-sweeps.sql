-- The sweeps' Optuna studies (PIPELINE_SWEEP_DB), beside Airflow's and MLflow's, on the first start of the volume.
CREATE DATABASE sweeps OWNER airflow;

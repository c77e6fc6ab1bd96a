-- MLflow's tracking database, beside Airflow's (POSTGRES_DB), on the first start of the volume.
CREATE DATABASE mlflow OWNER airflow;

"""The task-to-rank contract and the supervisor: one job spec and job folder (``spec``), one policy for every
place (``supervisor``, and ``deferred`` around Airflow's triggerer); the places in ``local`` and
``kubernetes``. Runs in the Airflow worker; imports no airflow."""

"""Running a training job on N ranks, wherever it runs: the job spec and its attempts (``spec``), the one restart
decision (``policy``), the place interface and registry (``places``), the supervisor that holds every place to the
same guarantees (``supervisor``), the orphan guards' common part (``guard``), and the places: ``local`` (torchrun
under this process), ``kubernetes`` (an indexed Job of torchrun pods) and ``ray`` (Ray Train on a Ray cluster).
Runs in the Airflow worker (the triggerer's watches of ``kubernetes`` and ``ray`` too); imports no airflow: the
Airflow layer hands in the cluster access (``places.Clusters``) and splits an attempt around its triggerer
(``pipeline.airflow.deferred``)."""

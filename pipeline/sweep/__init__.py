"""Hyperparameter sweeps: a search space over a recipe's config (``space``), an Optuna study per sweep run with
its trials bound to the mapped train task's slots (``study``), and the pruner the supervisor asks while a trial
trains (``pruning``). The stages (``pipeline.stages.sweep``) and the DAG factory (``pipeline.airflow.sweep_dag``)
put them to work."""

"""Hyperparameter sweeps: `<recipe>_sweep` for every recipe, each trial a mapped distributed train task.

Trigger one from the Params form (the recipe's Params, `search_space`, `n_trials`, the objective and the pruner);
the best trial's model is registered, evaluated and promoted as the recipe DAG's would be. docs/sweeps.md.
"""

from pipeline.airflow.sweep_dag import sweep_dag
from pipeline.recipes import registry

for _recipe in registry():
    globals()[f"{_recipe}_sweep"] = sweep_dag(_recipe)

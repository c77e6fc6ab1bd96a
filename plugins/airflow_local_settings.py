"""Airflow's local settings for this project's deployments: the cluster policy that admits a recipe DAG's
``train`` task by its own run's ranks (``pipeline.airflow.admission``).

Airflow imports ``airflow_local_settings`` in every component (``airflow.settings.initialize``) after
putting ``$AIRFLOW_HOME/config`` and then the plugins folder on ``sys.path``; every form of this project
(``make airflow``/``ui``/``stack``, docker-compose.yml, the tests) points the plugins folder here. A
deployment with an ``airflow_local_settings.py`` of its own in ``$AIRFLOW_HOME/config`` (found first)
re-exports the hook: ``from pipeline.airflow.admission import task_instance_mutation_hook``.
``.airflowignore`` keeps the plugins manager from importing this file a second time as a plugin.
"""

import logging

__all__ = ["task_instance_mutation_hook"]

try:
    from pipeline.airflow.admission import task_instance_mutation_hook
except ImportError as exc:  # never stop an Airflow component: admission falls back to the DAG's slots
    logging.getLogger(__name__).error("pipeline.airflow.admission not importable (%s): training tasks take the "
                                      "pool slots of their DAG's default config", exc)
    __all__ = []

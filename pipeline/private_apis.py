"""Every private API of another library that pipeline/ calls, in one place, each where no public one does the job.

- ``fsdp_lazy_init``: ``FSDPModule._get_fsdp_state()._lazy_init()`` (torch 2.14.1, FSDP2). FSDP2 sets up its
  root (which units it leads and how they gather) in the root's first forward; a forward that enters below the
  root first (peft's ``generate`` calls the wrapped model's own) would make that module a root of its own.
  Done right after ``fully_shard``, every unit is under the model's root from the start. ``FSDPModule`` has no
  public call for it (its public methods are ``unshard``, ``reshard`` and the ``set_*`` options), and a dummy
  forward through the root would need inputs of each recipe's own shape.
- ``mlflow_modules_to_packages``: ``mlflow.utils.requirements_utils._init_modules_to_packages_map()``
  (mlflow 3.17.2). The first model that MLflow logs in a process maps every installed distribution to its
  modules (``importlib.metadata.packages_distributions``: about 1.2 s) and keeps the map; the task processes'
  preload computes it before they fork. MLflow's public ``infer_pip_requirements`` computes it too, but only
  for a saved model, which the preload has none of.

``tests/unit/test_private_apis.py`` fails, naming the library, its installed version and the version checked
here, when one of these attributes is gone. Imports stay inside the functions: this module is imported by
modules that run in a rank and by the Airflow side alike, and must cost neither of them an import.
"""

from __future__ import annotations

from typing import Any

# The versions the calls below were checked against.
CHECKED = {"torch": "2.14.1", "mlflow": "3.17.2"}

# (library, importable object, attribute) for each private name called here.
REQUIRED = (
    ("torch", "torch.distributed.fsdp.FSDPModule", "_get_fsdp_state"),
    ("torch", "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState", "_lazy_init"),
    ("mlflow", "mlflow.utils.requirements_utils", "_init_modules_to_packages_map"),
)


def fsdp_lazy_init(model: Any) -> None:
    """What FSDP2's root does in its first forward, done now: ``model`` is the root ``fully_shard`` returned."""
    model._get_fsdp_state()._lazy_init()


def mlflow_modules_to_packages() -> None:
    """Compute and keep MLflow's map of installed distributions to their modules, as its first logged model
    would."""
    from mlflow.utils import requirements_utils

    requirements_utils._init_modules_to_packages_map()

"""``ModelPackage``: what a recipe gives registration to log as a self-contained MLflow model.

Light: standard library only (a recipe's ``package`` hook builds one; ``pipeline.registry.models`` logs it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ModelPackage:
    """What registration logs: by default (``flavor="pyfunc"``) a models-from-code pyfunc file that imports
    neither ``pipeline`` nor the recipe and the artifacts it loads; or the keyword arguments of another MLflow
    flavor's ``save_model``/``log_model`` (``flavor="transformers"``, ``flavor_args={"transformers_model": ...,
    "task": ...}``). And an input example, from which the signature is inferred."""

    input_example: Any
    python_model: str = ""
    artifacts: dict[str, str] = field(default_factory=dict)
    pip_requirements: list[str] = field(default_factory=list)
    flavor: str = "pyfunc"  # the module mlflow.<flavor> that saves and logs the model
    flavor_args: dict[str, Any] = field(default_factory=dict)

    def log_args(self) -> dict[str, Any]:
        """The flavor's own keyword arguments of ``save_model`` / ``log_model``."""
        if self.flavor == "pyfunc":
            return {"python_model": self.python_model, "artifacts": self.artifacts}
        return dict(self.flavor_args)

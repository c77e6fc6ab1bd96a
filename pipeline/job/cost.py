"""What a training job cost: each attempt's node-hours and GPU-hours, priced with ``launch.price_per_gpu_hour``
and ``launch.price_per_node_hour``, summed over the run.

Whoever supervises an attempt appends its record to the job folder's ``attempts.jsonl`` when it ends
(``record``): when it started, how long it held its nodes, how many it held (the ranks that reported, in whole
nodes; the nodes asked for when none did) and what that cost. The folder is the run's (kept across task
retries), so ``summarize`` reads the whole run's cost back, whichever worker or triggerer ran each attempt: the
train stage logs it on the MLflow run and tags, the registered version and the evaluation report carry it, and
the demo's JSON line ends with it. A price of 0 (the default) counts hours and no cost.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeline.diskspace import space_checked


def record(path: Path, launch, *, started: float, ended: float, ranks: int, status: str, try_number: int = 1,
           restart: int = 0) -> dict[str, Any]:
    """Append one attempt's record to ``path`` (``JobFiles.attempts``) and return it. ``launch``: the job's
    ``LaunchConfig``; ``started``/``ended``: Unix times; ``ranks``: how many ranks reported (0: none)."""
    nodes = math.ceil(ranks / launch.nproc_per_node) if ranks else launch.nnodes
    hours = max(ended - started, 0.0) / 3600
    gpus = nodes * launch.gpus_per_node
    row = {"try": try_number, "restart": restart, "status": status, "started": round(started, 3),
           "wall_s": round(ended - started, 3), "nodes": nodes, "gpus": gpus, "node_hours": round(nodes * hours, 6),
           "gpu_hours": round(gpus * hours, 6),
           "cost": round(gpus * hours * launch.price_per_gpu_hour + nodes * hours * launch.price_per_node_hour, 6)}
    line = json.dumps(row) + "\n"
    with space_checked(path, len(line)), open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
    return row


def summarize(path: Path) -> dict[str, Any] | None:
    """The run's cost over every attempt recorded in ``path``, or None when none was."""
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # cut short by a killed supervisor
    if not rows:
        return None
    total = {key: round(sum(row[key] for row in rows), 6) for key in ("wall_s", "node_hours", "gpu_hours", "cost")}
    return {"attempts": len(rows)} | total


def tags(cost: dict[str, Any]) -> dict[str, str]:
    """The run's cost as MLflow tags (the training run's and the registered version's)."""
    return {f"cost.{key}": str(cost[key]) for key in ("attempts", "wall_s", "node_hours", "gpu_hours", "cost")}


def describe(cost: dict[str, Any] | None) -> str | None:
    """``summarize``'s figures in a line: the task log's and the evaluation report's."""
    if not cost:
        return None
    return (f"training cost {cost['cost']:.4g} for {cost['gpu_hours']:.4g} GPU-hours and {cost['node_hours']:.4g} "
            f"node-hours over {cost['attempts']} attempt(s), {cost['wall_s']:.0f}s held")

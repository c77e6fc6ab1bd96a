"""A running job as one JSON document, read from its job folder alone: what the job view in the Airflow UI shows
(``pipeline.airflow.job_view``), live while the job runs and as it ended after.

Every rank's position and its last window's figures (the heartbeats), its straggler score in that window, the
ETA from rank 0's pace, each node's last utilisation sample, the stragglers named so far and the cost of the
attempts that have ended (``telemetry.jsonl``, ``attempts.jsonl``), and the job's MLflow run (``mlflow.json``,
written by the train stage). Reads files only: whoever serves it needs the job folder's volume, nothing else.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pipeline.job import cost, telemetry
from pipeline.job_files import JobFiles, read_heartbeats

STALE_S = 60.0  # a heartbeat older than this: the rank is not running (any more)


def live(files: JobFiles, now: float | None = None) -> dict[str, Any]:
    """The job in ``files`` as the view shows it (see the module's description)."""
    now = time.time() if now is None else now
    beats = read_heartbeats(files.progress) if files.progress.is_dir() else {}
    ranks = [_rank(rank, beat, len(beats), now) for rank, beat in sorted(beats.items())]
    _scores(ranks, beats)
    first = ranks[0] if ranks else {}
    eta = None
    if first.get("total") and first.get("step_time_s"):
        eta = max(first["total"] - first["step"], 0) * first["step_time_s"]
    running = any(rank["age_s"] < STALE_S for rank in ranks) and not files.result.exists()
    nodes = sorted((beat["node"] for beat in beats.values() if beat.get("node")), key=lambda node: node["node"])
    summary = telemetry.summarize(files.telemetry)
    return {
        "state": "running" if running else ("finished" if files.result.exists() else "not running"),
        "world_size": len(ranks), "ranks": ranks, "eta_s": eta,
        "stragglers": {str(rank): score for rank, score in summary["stragglers"].items()},
        "nodes": [{k: v for k, v in node.items() if k != "time"} | {"age_s": round(now - node["time"], 1)}
                  for node in nodes],
        "cost": cost.summarize(files.attempts),
        "mlflow": _mlflow(files),
    }


def _rank(rank: int, beat: dict[str, Any], world: int, now: float) -> dict[str, Any]:
    window = (beat.get("windows") or [{}])[-1]
    figures = telemetry.own_figures(window, world)
    return {"rank": rank, "host": beat.get("host"), "step": beat.get("step"), "total": beat.get("total"),
            "epoch": beat.get("epoch"), "phase": beat.get("phase"), "age_s": round(now - beat.get("time", now), 1),
            "window_step": window.get("step")} | figures


def _scores(ranks: list[dict[str, Any]], beats: dict[int, dict[str, Any]]) -> None:
    """Each rank's straggler score in the newest window every rank still keeps in its heartbeat (as
    ``RankTelemetry`` scores it): ranks report the same steps, a moment apart."""
    kept = {rank: {w["step"]: w for w in beat.get("windows", []) if "compute_s" in w} for rank, beat in beats.items()}
    common = set.intersection(*(set(windows) for windows in kept.values())) if kept else set()
    if not common:
        return
    scores = telemetry.straggler_scores({rank: windows[max(common)]["compute_s"] for rank, windows in kept.items()})
    for row in ranks:
        if row["rank"] in scores:
            row["straggler_score"] = round(scores[row["rank"]], 3)


def _mlflow(files: JobFiles) -> dict[str, str] | None:
    try:
        return json.loads(files.tracking.read_text())
    except (OSError, ValueError):
        return None

"""Every rank's figures, and the stragglers among them, read from the ranks' heartbeats by whoever supervises the job.

Each rank reports its own figures over its last window of steps in its heartbeat file (``Heartbeat.report``, every
``train.log_every_steps`` steps, at the same steps on every rank): step time, samples (and tokens) per second,
data-wait share, and compute time, the seconds per step of the rank's own work (its forward passes, timed on the
device's clock). Nothing is exchanged between ranks for it. The supervisor, polling the heartbeats anyway, turns
each window that every rank has reported into:

- per-rank metrics, ``rank_R/<figure>`` at that step, appended to the job folder's ``telemetry.jsonl`` and relayed
  to the job's MLflow run beside rank 0's metrics (``pipeline.registry.metrics_relay``);
- a straggler score per rank: its compute time over the median of the other ranks' (``rank_R/straggler_score``;
  ``rank_R/straggler``, the same score, in the windows where it is named).
  Step times cannot tell: in a synchronous job every rank waits for the slowest in the all-reduce, so every rank's
  step takes as long as the slowest rank's. A rank whose score stays above ``launch.straggler_ratio`` for
  ``launch.straggler_windows`` windows in a row is named in the task log (and again when it recovers);
- each node's utilisation (CPU, memory, GPUs: ``pipeline.node_usage``), sampled by its local rank 0, as
  ``node_N/<figure>``;
- at the end, the run's figures per rank and node and the stragglers named, read back from ``telemetry.jsonl``
  (``summarize``) for the task log; the train stage tags the MLflow run with the stragglers.

With fsdp the forward passes hold the parameters' all-gathers, in which a fast rank waits for a slow one: the
compute times come closer together and a straggler scores lower than it is.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

from pipeline.job_files import MetricsSink

# Throughput's rates are the whole job's (this rank's times the world size); per rank they are divided back.
RATES = ("samples_per_s", "tokens_per_s")
FIGURES = ("step_time_s", "compute_s", "data_wait_fraction", "samples_per_s", "tokens_per_s", "mfu")
KINDS = ("rank", "node")  # telemetry.jsonl's metrics: rank_R/<figure> and node_N/<figure>


class RankTelemetry:
    """Reads one job's windows as its ranks report them; ``new_attempt`` between attempts. Per-rank metrics go to
    ``path`` (``JobFiles.telemetry``), where ``summarize`` reads the run's back."""

    def __init__(self, path: Path | None, *, ratio: float, windows: int):
        self.path, self.ratio, self.windows = (Path(path) if path else None), ratio, windows
        self._sink: MetricsSink | None = None  # opened at the first line: a job whose ranks report none has no file
        self.new_attempt()

    def new_attempt(self) -> None:
        """The next attempt's ranks start afresh (their number may differ: an elastic restart)."""
        self._reported: dict[int, int] = {}  # rank -> the step of its last window read
        self._pending: dict[int, dict[int, dict[str, float]]] = {}  # step -> rank -> figures
        self._scores: dict[int, deque[float]] = {}
        self._slow: set[int] = set()
        self._node_samples: dict[int, float] = {}  # node -> the time of its last sample read

    def update(self, beats: dict[int, dict[str, Any]]) -> list[str]:
        """Take the windows the ranks have reported since the last call (``read_heartbeats``); returns the lines
        for the task log (stragglers named or recovered)."""
        for rank, beat in beats.items():
            for figures in beat.get("windows", []):
                if figures["step"] > self._reported.get(rank, -1):
                    self._reported[rank] = figures["step"]
                    self._pending.setdefault(int(figures["step"]), {})[rank] = figures | {"host": beat.get("host")}
        self._nodes(beats)
        lines = []
        for step in sorted(self._pending):
            window = self._pending[step]
            if set(beats) <= set(window):
                lines += self._take(step, self._pending.pop(step))
            elif all(self._reported.get(rank, -1) > step for rank in set(beats) - set(window)):
                del self._pending[step]  # a rank's window was gone before it was read: skipped, not waited for
            else:
                break
        return lines

    def _take(self, step: int, window: dict[int, dict[str, float]]) -> list[str]:
        scores = straggler_scores({rank: figures.get("compute_s") for rank, figures in window.items()})
        values: dict[str, float] = {}
        lines = []
        for rank, figures in sorted(window.items()):
            own = own_figures(figures, len(window))
            if rank in scores:
                own["straggler_score"] = scores[rank]
                lines += self._judge(rank, step, scores[rank], figures.get("host"))
                if rank in self._slow:  # named: the summary's stragglers are read back from these
                    own["straggler"] = scores[rank]
            values |= {f"rank_{rank}/{key}": round(value, 6) for key, value in own.items()}
        self._append(step, values)
        return lines

    def _nodes(self, beats: dict[int, dict[str, Any]]) -> None:
        """Each node's utilisation sample (its local rank 0's ``node``), once, as ``node_N/<figure>``."""
        for beat in beats.values():
            sample = dict(beat.get("node") or {})
            node, sampled = sample.pop("node", None), sample.pop("time", None)
            if node is None or sampled is None or self._node_samples.get(node) == sampled:
                continue
            self._node_samples[node] = sampled
            self._append(int(beat.get("step") or 0), {f"node_{node}/{key}": value for key, value in sample.items()})

    def _judge(self, rank: int, step: int, score: float, host: str | None) -> list[str]:
        scores = self._scores.setdefault(rank, deque(maxlen=self.windows))
        scores.append(score)
        where = f"rank {rank}" + (f" on {host}" if host else "")
        if len(scores) == self.windows and min(scores) > self.ratio:
            if rank not in self._slow:
                self._slow.add(rank)
                return [f"straggler: {where} computes {score:.2f}x as long per step as the median of the other "
                        f"ranks, above launch.straggler_ratio={self.ratio:g} for {self.windows} windows in a row "
                        f"(at step {step}); every rank's step waits for it"]
        elif rank in self._slow and score <= self.ratio:
            self._slow.discard(rank)
            return [f"{where} is no longer a straggler at step {step} ({score:.2f}x the median of the other ranks)"]
        return []

    def _append(self, step: int, values: dict[str, float]) -> None:
        if self.path is None or not values:
            return
        self._sink = self._sink or MetricsSink(self.path)
        self._sink.log(values, step)


def own_figures(figures: dict[str, float], ranks: int) -> dict[str, float]:
    """A rank's reported window as its own figures: ``FIGURES`` only, the job's rates divided back to this rank's."""
    return {key: figures[key] / ranks if key in RATES else figures[key] for key in FIGURES if key in figures}


def straggler_scores(computes: dict[int, float | None]) -> dict[int, float]:
    """Each rank's compute time in one window over the median of the other ranks' (ranks without one left out)."""
    known = {rank: value for rank, value in computes.items() if value is not None}
    scores = {}
    for rank, value in known.items():
        others = [other for r, other in known.items() if r != rank]
        median = statistics.median(others) if others else 0.0
        if median > 0:
            scores[rank] = value / median
    return scores


def summarize(path: Path) -> dict[str, Any]:
    """The run's figures from its ``telemetry.jsonl`` (every attempt's, whichever process supervised it): each
    rank's mean figures over its windows, the stragglers named (rank -> the highest score it reached while
    named), and each node's mean utilisation."""
    sums: dict[str, dict[int, dict[str, float]]] = {kind: defaultdict(lambda: defaultdict(float)) for kind in KINDS}
    counts: dict[str, dict[int, dict[str, int]]] = {kind: defaultdict(lambda: defaultdict(int)) for kind in KINDS}
    stragglers: dict[int, float] = {}
    path = Path(path)
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        try:
            values = json.loads(line)["metrics"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a killed supervisor
        for name, value in values.items():
            who, key = name.split("/", 1)
            kind, number = who.split("_", 1)
            if key == "straggler":
                stragglers[int(number)] = max(stragglers.get(int(number), 0.0), float(value))
            elif kind in KINDS:
                sums[kind][int(number)][key] += float(value)
                counts[kind][int(number)][key] += 1
    means = {kind: {n: {key: round(total / counts[kind][n][key], 6) for key, total in figures.items()}
                    for n, figures in sorted(sums[kind].items())} for kind in KINDS}
    return {"ranks": means["rank"], "stragglers": dict(sorted(stragglers.items())), "nodes": means["node"]}


def summary_line(summary: dict[str, Any]) -> str | None:
    """``summarize``'s figures for the task log, or None when no rank or node reported any."""
    if not summary["ranks"] and not summary.get("nodes"):
        return None
    per_rank = "; ".join(
        f"rank {rank}: step {f.get('step_time_s', 0) * 1e3:.1f}ms compute {f.get('compute_s', 0) * 1e3:.1f}ms "
        f"data-wait {f.get('data_wait_fraction', 0):.0%} {f.get('samples_per_s', 0):,.0f} samples/s"
        + (f" score {f['straggler_score']:.2f}" if "straggler_score" in f else "")
        for rank, f in summary["ranks"].items())
    nodes = "".join(
        f"; node {node}: cpu {f.get('cpu_percent', 0):.0f}% memory {f.get('memory_gb', 0):.1f} GiB"
        + "".join(f" {key.removesuffix('_utilization')} {value:.0f}%" for key, value in f.items()
                  if key.endswith("_utilization"))
        for node, f in summary.get("nodes", {}).items())
    return (f"per-rank figures over the run: {per_rank}; stragglers: {describe_stragglers(summary['stragglers'])}"
            + nodes)


def describe_stragglers(stragglers: dict) -> str:
    """``rank 3 (1.84x), ...`` (the highest score each reached while named), or ``none``: the log's and the MLflow
    run's ``stragglers`` tag."""
    return ", ".join(f"rank {rank} ({float(score):.2f}x)" for rank, score in stragglers.items()) or "none"

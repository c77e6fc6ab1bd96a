"""The prepare_data stage: publish (or find) the MDS dataset version a run trains on."""

from __future__ import annotations

import logging

from pipeline import deployment
from pipeline.config import PipelineConfig
from pipeline.results import PreparedData
from pipeline.stages.run import RunInfo
from pipeline.stopwatch import Stopwatch

log = logging.getLogger(__name__)


def prepare_data(cfg: PipelineConfig, run: RunInfo, window: dict[str, str] | None = None) -> PreparedData:
    """Publish (or find) the MDS dataset version of the configured input. A run that daily datasets
    triggered (``window``: the dataset and its newest interval's end) reads the newest
    ``data.window_intervals`` of them instead."""
    from pipeline.data.versions import windows

    if window:
        dataset = windows.resolve(deployment.data_root(), window["dataset"], window["end"], cfg.data.window_intervals)
        log.info("training on the window %s of %s: versions %s", dataset.interval, window["dataset"],
                 list(dataset.versions))
        return dataset
    from pipeline.data.prepare.version import prepare

    clock = Stopwatch()
    manifest = prepare(cfg.data, name=cfg.RECIPE, out_root=deployment.data_root())
    return windows.summary(manifest, clock.total())


def prepare_interval(cfg: PipelineConfig, run: RunInfo, name: str) -> PreparedData:
    """Publish (or find) dataset ``name``'s version of the run's data interval (its input partitions)."""
    from pipeline.data.prepare.version import prepare
    from pipeline.data.versions import windows
    from pipeline.errors import ConfigError

    if not (run.data_interval_start and run.data_interval_end):
        raise ConfigError(f"DAG run {run.run_id} has no data interval: a per-interval dataset needs a scheduled "
                          f"run (or a backfill) of a DAG with a timetable")
    clock = Stopwatch()
    manifest = prepare(cfg.data, name=name, out_root=deployment.data_root(),
                       interval=(run.data_interval_start, run.data_interval_end))
    return windows.summary(manifest, clock.total())

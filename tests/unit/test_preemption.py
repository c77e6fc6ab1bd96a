"""The rank side of a preemption without processes: the marker the launcher reads, and a request answered at
once where there is no process group. Signals to real ranks are in tests/integration/test_preemption_signals.py."""

from __future__ import annotations

import signal
import time

import pytest

from pipeline.job_files import PREEMPTION_FILE, mark_preempted, read_preemption


def test_the_marker_is_written_atomically_and_read_back(tmp_path):
    assert read_preemption(tmp_path) is None
    assert read_preemption(tmp_path / "missing") is None
    before = time.time()
    mark_preempted(tmp_path / "progress", rank=0, step=123)
    marker = read_preemption(tmp_path / "progress")
    assert marker["rank"] == 0 and marker["step"] == 123 and before <= marker["time"] <= time.time()
    assert sorted(p.name for p in (tmp_path / "progress").iterdir()) == [PREEMPTION_FILE]


@pytest.mark.parametrize("overlap", [True, False])
def test_without_a_process_group_the_request_is_answered_at_once(overlap):
    from pipeline.train.preemption import Preemption

    request = Preemption(None)
    assert request.should_stop(overlap=overlap) is False
    request.handle(signal.SIGTERM, None)
    assert request.should_stop(overlap=overlap) is True

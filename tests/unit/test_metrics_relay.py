"""Rank 0's metrics file and the task's relay to MLflow: every value sent once, in order, nothing lost to a failing
server, a line being written or a line cut short by a killed rank."""

import json
import threading

from pipeline.registry.metrics_relay import MAX_BATCH, MetricsFile, Relay
from pipeline.job_files import MetricsSink


class Recorder:
    """A stand-in for MLflow's log_batch: records what it takes, or fails while ``down`` is set."""

    def __init__(self):
        self.batches, self.down = [], threading.Event()

    def __call__(self, batch):
        if self.down.is_set():
            raise ConnectionError("Connection refused")
        self.batches.append(list(batch))

    @property
    def values(self):
        return [value for batch in self.batches for value in batch]


class Messages(list):
    """What the relay says, and ``failed``: set once it has said that a send failed."""

    def __init__(self):
        super().__init__()
        self.failed = threading.Event()

    def __call__(self, message: str) -> None:
        self.append(message)
        if "metric logging failed" in message:
            self.failed.set()


def test_a_sink_writes_whole_lines_and_the_relay_sends_each_value_once(tmp_path):
    path = tmp_path / "job" / "metrics.jsonl"
    sink = MetricsSink(path)
    sink.log({"step_loss": 0.5, "lr": 0.001}, step=5)
    sink.log({"val_loss": 0.25}, step=10)
    metrics, send = MetricsFile(path), Recorder()

    assert metrics.unsent() == 3
    assert metrics.send(send) == 3
    sent = [(key, value, step) for key, value, _, step in send.values]
    assert sent == [("step_loss", 0.5, 5), ("lr", 0.001, 5), ("val_loss", 0.25, 10)]
    assert metrics.send(send) == 0 and metrics.unsent() == 0  # the mark holds: nothing twice

    sink.log({"step_loss": 0.125}, step=15)
    sink.close()
    assert MetricsFile(path).send(send) == 1  # a new reader starts at the mark on disk
    assert send.values[-1][0] == "step_loss" and send.values[-1][3] == 15


def test_a_line_being_written_waits_and_a_line_cut_short_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    row = json.dumps({"step": 1, "timestamp": 1, "metrics": {"a": 1.0}})
    path.write_text(row + "\n" + row[:20])  # rank 0 killed in the middle of its second line
    metrics, send = MetricsFile(path), Recorder()
    assert metrics.send(send) == 1  # the unfinished line is not taken

    sink = MetricsSink(path)  # the next attempt's rank 0: its lines start on a line of their own
    sink.log({"b": 2.0}, step=2)
    sink.close()
    assert metrics.send(send) == 1
    assert [k for k, *_ in send.values] == ["a", "b"]


def test_batches_stay_within_mlflows_limit(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = MetricsSink(path)
    for step in range(MAX_BATCH + 10):
        sink.log({"x": float(step)}, step=step)
    sink.log({f"m{i}": 1.0 for i in range(MAX_BATCH + 1)}, step=0)  # one line over the limit on its own
    sink.close()
    send = Recorder()
    assert MetricsFile(path).send(send) == 2 * MAX_BATCH + 11
    assert max(len(b) for b in send.batches) <= MAX_BATCH
    assert [v for k, v, _, _ in send.values if k == "x"] == [float(s) for s in range(MAX_BATCH + 10)]


def test_the_relay_keeps_what_the_server_refuses_and_sends_it_when_it_is_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink, send, messages = MetricsSink(path), Recorder(), Messages()
    send.down.set()
    for step in range(20):
        sink.log({"step_loss": float(step)}, step=step)
    relay = Relay([MetricsFile(path)], send, interval_s=0.05, max_backoff_s=0.1, emit=messages)
    assert messages.failed.wait(30)  # its first send of the 20 values was refused
    assert relay.close(timeout_s=0) == 20  # still down at the end: all of it stays in the file
    assert send.values == []
    assert any("register_model sends them" in m for m in messages)

    send.down.clear()  # the server is back: the next relay (register_model's) sends exactly what was left
    relay = Relay([MetricsFile(path)], send, interval_s=0.05, emit=messages)
    sink.log({"val_loss": 0.5}, step=20)
    sink.close()
    assert relay.close(timeout_s=5) == 0
    assert [v for _, v, _, _ in send.values] == [float(s) for s in range(20)] + [0.5]


def test_the_relay_recovers_within_a_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink, send, messages = MetricsSink(path), Recorder(), Messages()
    send.down.set()
    sink.log({"a": 1.0}, step=1)
    relay = Relay([MetricsFile(path)], send, interval_s=0.05, max_backoff_s=0.1, emit=messages)
    assert messages.failed.wait(30)
    assert "metric logging failed (ConnectionError" in messages[0]
    sink.log({"a": 2.0}, step=2)
    send.down.clear()
    sink.close()
    assert relay.close(timeout_s=10) == 0
    assert [v for _, v, _, _ in send.values] == [1.0, 2.0]
    assert any("metric logging recovered" in m for m in messages)

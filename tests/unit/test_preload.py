"""Task processes with the heavy modules preloaded (pipeline.airflow.preload) within this process: what PIPELINE_PRELOAD names, the preload's
thread, its niceness and its session's, a task waiting for a module being imported. In a fresh process (a Celery
worker starting, the real session niceness, MLflow's distribution map): tests/integration/test_task_process.py."""

import sys

import pytest

from pipeline.airflow import preload


@pytest.mark.parametrize(("value", "expected"), [
    (None, list(preload.DEFAULT_MODULES)), ("none", []), ("", []), (" a.b , c ,", ["a.b", "c"]),
])
def test_pipeline_preload_names_the_modules(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("PIPELINE_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("PIPELINE_PRELOAD", value)
    assert preload.modules() == expected


def test_preload_in_background_imports_on_its_own_thread():
    sys.modules.pop("this", None)
    thread = preload.preload_in_background(["this"])  # the Zen of Python: a module nothing else imports
    thread.join(60)
    assert not thread.is_alive() and thread.daemon and thread.name == "pipeline-preload"
    assert "this" in sys.modules


def test_a_deferred_preload_waits_for_its_event_and_runs_at_low_priority(monkeypatch, tmp_path):
    """make demo's: nothing imported until the train task has started its ranks (``preload_while_a_job_runs``),
    then on a thread whose own niceness is raised, and its session's while it imports, so that the ranks
    (each in a session of its own) keep the cores; the session's niceness is set back afterwards."""
    import os
    import threading

    autogroup = tmp_path / "autogroup"
    autogroup.write_text("/autogroup-7 nice 0\n")
    monkeypatch.setattr(preload, "AUTOGROUP", autogroup)
    seen: dict[str, object] = {}

    def imports(names):
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen["process"] = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's
        seen["session"] = autogroup.read_text()

    monkeypatch.setattr(preload, "preload", imports)
    go = threading.Event()
    thread = preload.preload_in_background(["this"], after=go, nice=5)
    thread.join(0.3)
    assert thread.is_alive() and not seen  # still waiting
    go.set()
    thread.join(60)
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert seen == {"nice": min(base + 5, 19), "process": base, "session": "5"}  # the thread's, not the process's
    assert autogroup.read_text() == "0"


def test_a_session_already_niced_is_left_as_it_is(monkeypatch, tmp_path):
    """Two demos from one shell: the second finds the first's 19 and must not set it back to 19 after the first
    has set it back to 0."""
    autogroup = tmp_path / "autogroup"
    autogroup.write_text("/autogroup-7 nice 19\n")
    monkeypatch.setattr(preload, "AUTOGROUP", autogroup)
    with preload.session_niceness(19):
        autogroup.write_text("/autogroup-7 nice 0\n")  # the first demo's preload is done
    assert autogroup.read_text() == "/autogroup-7 nice 0\n"


def test_a_session_niceness_that_cannot_be_set_changes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(preload, "AUTOGROUP", tmp_path / "missing")
    with preload.session_niceness(19):
        pass
    assert not (tmp_path / "missing").exists()


def test_a_task_waits_for_a_preload_that_is_importing(tmp_path, monkeypatch):
    """make demo's tasks run in the preloading process: a task that looked a module up in sys.modules while the
    thread imported it found it half-imported (matplotlib.use and matplotlib.pyplot failed an evaluate task)."""
    import threading
    import types

    # The module's import says it began, then goes on once the gate opens.
    gate = types.SimpleNamespace(began=threading.Event(), open=threading.Event())
    monkeypatch.setitem(sys.modules, "slow_to_import_gate", gate)
    (tmp_path / "slow_to_import.py").write_text("import slow_to_import_gate\nslow_to_import_gate.began.set()\n"
                                                "slow_to_import_gate.open.wait(60)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_to_import", raising=False)
    go = threading.Event()
    thread = preload.preload_in_background(["slow_to_import"], after=go)
    preload.settled()  # a preload still waiting for its event holds nothing up (make demo's first task)
    assert "slow_to_import" not in sys.modules
    go.set()
    assert gate.began.wait(60), "the preload never began importing"
    assert not hasattr(sys.modules["slow_to_import"], "DONE")  # half-imported, as the failing task saw it

    class Watched:
        """The preload's lock, saying when a task begins to wait on it."""

        def __init__(self, lock):
            self.lock, self.waiting = lock, threading.Event()

        def __enter__(self):
            self.waiting.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    importing = Watched(preload._IMPORTING)  # held by the preload's thread since its import began
    monkeypatch.setattr(preload, "_IMPORTING", importing)

    def open_the_gate_once_the_task_waits():
        try:
            importing.waiting.wait(60)
        finally:
            gate.open.set()

    opener = threading.Thread(target=open_the_gate_once_the_task_waits, daemon=True)
    opener.start()
    preload.settled()
    assert importing.waiting.is_set() and sys.modules["slow_to_import"].DONE
    opener.join(60)
    thread.join(60)


def test_a_failing_step_after_an_import_is_logged_and_skipped(monkeypatch, caplog):
    def broken():
        raise RuntimeError("no map today")

    monkeypatch.setitem(preload.AFTER_IMPORT, "this", broken)
    with caplog.at_level("WARNING"):
        took = preload.preload(["this", "json"])
    assert list(took) == ["json"]
    assert "preloading this failed: RuntimeError: no map today" in caplog.text

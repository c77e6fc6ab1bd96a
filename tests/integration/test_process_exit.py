"""``exit_main``: a process started for a module ends at once but only after what the interpreter's own exit would
have run first (thread pools' work, atexit handlers, buffered output); the same module run inside another
process (as a Ray Train worker runs a rank's entry) leaves that process running."""

import subprocess
import sys
import textwrap

from pipeline import deployment

MODULE = textwrap.dedent("""
    import atexit, sys, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from pipeline.fast_exit import exit_main

    out = Path(sys.argv[1])
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: (time.sleep(0.3), (out / "pool").write_text("done")))
    print("buffered line", end="")  # no newline, no flush: lost by a bare os._exit

    if __name__ == "__main__":
        exit_main("exiting_module", 3)
""")


def _env(tmp_path):
    return {"PYTHONPATH": f"{tmp_path}:{deployment.PROJECT_ROOT}", "PATH": "/usr/bin:/bin"}


def test_a_process_started_for_the_module_exits_with_its_code_after_its_exit_work(tmp_path):
    (tmp_path / "exiting_module.py").write_text(MODULE)
    done = subprocess.run([sys.executable, "-m", "exiting_module", str(tmp_path)], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stdout == "buffered line"
    assert (tmp_path / "pool").read_text() == "done"  # the pool's work finished before the exit
    assert (tmp_path / "atexit").read_text() == "ran"


def test_the_module_run_inside_another_process_leaves_it_running(tmp_path):
    (tmp_path / "exiting_module.py").write_text(MODULE)
    host = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["exiting_module", {str(tmp_path)!r}]
        try:
            runpy.run_module("exiting_module", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            print(" / the host goes on after exit code", exc.code)
    """)
    done = subprocess.run([sys.executable, "-c", host], env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "buffered line / the host goes on after exit code 3"

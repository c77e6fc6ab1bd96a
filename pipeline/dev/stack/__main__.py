"""``python -m pipeline.dev.stack up|down|ui``: the local stack (``make stack``, ``make stack-down``) and the
embedded UI (``make ui``). See pipeline/dev/stack/local.py."""

from __future__ import annotations

import argparse
import signal
import sys

from pipeline.dev.stack.local import EMBEDDED_MODE, SERVICES_MODE, LocalStack


def _ui() -> int:
    """Foreground: demo inputs, the embedded Airflow and an MLflow UI; Ctrl-C (or SIGTERM) stops all."""
    from pipeline import deployment
    from pipeline.dev.demo import ensure_demo_inputs

    deployment.apply_airflow_env()
    for path in ensure_demo_inputs():
        print(f"wrote demo input {path}", flush=True)
    stack = LocalStack.from_env(EMBEDDED_MODE)
    stack.home = deployment.home() / "ui"
    stack.airflow_home.mkdir(parents=True, exist_ok=True)
    # The embedded default's Airflow home and database: what `make airflow` and `make demo` use.
    stack.extra_env = {key: value for key, value in deployment.airflow_env().items()
                       if key in ("AIRFLOW_HOME", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")}
    stopping = []

    def stop(signum, _frame):
        stopping.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    # Ctrl-C stops the stack even where SIGINT came ignored: a shell starts background jobs that way,
    # and Python then keeps it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stack.up()
        print(stack.banner(), flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        print("\nstopping: failing running tasks, then ending every process", flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave half a stop
        killed = stack.down()
        print(f"stopped{f' (killed {len(killed)} that ignored SIGTERM)' if killed else ''}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.dev.stack", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "ui"])
    parser.add_argument("--ray", action="store_true", help="up: also a Ray head on 127.0.0.1, the ray_default "
                        "connection pointed at it (make stack RAY=1)")
    parser.add_argument("--s3", action="store_true", help="up: also an S3 API server on 127.0.0.1 (bucket pipeline: "
                        "MLflow's artifacts, the dataset versions), the aws_default connection pointed at it "
                        "(make stack S3=1)")
    args = parser.parse_args(argv)
    if args.command == "ui":
        return _ui()
    stack = LocalStack.from_env(SERVICES_MODE)
    stack.ray, stack.s3 = args.ray, args.s3
    if args.command == "up":
        stack.up()
        print(stack.banner(), flush=True)
    else:
        killed = stack.down()
        print(f"stack stopped{f' (killed {len(killed)} that ignored SIGTERM)' if killed else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

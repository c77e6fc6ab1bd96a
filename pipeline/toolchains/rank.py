"""One rank of a toolchain job, in the toolchain's interpreter: run its entry (``-m module ...`` or
``script.py ...``) as ``python`` would, and report an exception of a type the toolchain declares a
configuration mistake (``toolchain.json``'s ``config_errors``, e.g. pydantic's ``ValidationError`` for
Axolotl's YAML) as a user error, so the supervisor fails the task at once instead of restarting and retrying it.

    python -m pipeline.toolchains.rank --config-error=pydantic_core._pydantic_core.ValidationError -- \\
        -m axolotl.cli.main train sft.yaml

Standard library only (with ``pipeline.errors`` and ``pipeline.job_files``): it runs beside whatever the toolchain installed.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from pipeline.errors import ConfigError
from pipeline.job_files import user_errors_reported


def declared(exc: BaseException, names: set[str]) -> str | None:
    """The qualified name under which ``exc``'s type (or a base of it) is declared a configuration error."""
    for cls in type(exc).__mro__:
        qualified = f"{cls.__module__}.{cls.__qualname__}"
        if qualified in names:
            return qualified
    return None


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="pipeline.toolchains.rank")
    parser.add_argument("--config-error", action="append", default=[], help="qualified exception type name")
    parser.add_argument("entry", nargs=argparse.REMAINDER, help="-- then -m MODULE ARGS... or SCRIPT ARGS...")
    args = parser.parse_args(argv)
    entry = args.entry[1:] if args.entry[:1] == ["--"] else args.entry
    if not entry or entry == ["-m"]:
        parser.error("no entry: expected -- -m MODULE ARGS... or -- SCRIPT ARGS...")
    try:
        if entry[0] == "-m":
            sys.argv = entry[1:]
            runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(entry)
            sys.path.insert(0, os.path.dirname(os.path.abspath(entry[0])))  # as `python script.py` would
            runpy.run_path(entry[0], run_name="__main__")
    except Exception as exc:
        name = declared(exc, set(args.config_error))
        if name is None:
            raise
        with user_errors_reported():
            raise ConfigError(f"{name}: {exc}") from exc
    close_process_group()


def close_process_group() -> None:
    """After an entry that succeeded: every rank waits for the others, then closes the process group the entry left
    up (the Hugging Face Trainer's). Left to the interpreter's exit, a rank still in c10d's threads when the group
    goes was seen to abort ("terminate called without an active exception", SIGABRT) after training had finished,
    under load, which failed a finished attempt."""
    dist = sys.modules.get("torch.distributed")  # only if the entry imported it: this module imports no torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

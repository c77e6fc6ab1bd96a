"""Run one pickled Python function on every rank: ``torchrun -m pipeline.train.function PAYLOAD RESULT``.

The payload is ``cloudpickle.dumps((function, args, kwargs))``. The process group is initialized
before the function is called (gloo on CPU, nccl on GPU) and destroyed after it returns, so the
function can use ``torch.distributed`` right away. Rank 0's return value is pickled to RESULT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from pipeline.job_files import user_errors_reported


@record
def main(argv: list[str] | None = None) -> int:
    import cloudpickle

    from pipeline.train import distributed

    payload, result = (argv if argv is not None else sys.argv[1:])[:2]
    function, args, kwargs = cloudpickle.loads(Path(payload).read_bytes())
    ctx = distributed.setup()  # launch.backend, exported by the place
    try:
        with user_errors_reported():  # a UserError from the function fails the task without retries
            value = function(*args, **kwargs)
    finally:
        distributed.teardown(ctx)
    if ctx.is_main:
        tmp = Path(f"{result}.tmp")
        tmp.write_bytes(cloudpickle.dumps(value))
        os.replace(tmp, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

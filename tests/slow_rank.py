"""``python -m pipeline.rank`` for the tabular recipe with one rank made slow, as a slower device or a noisy
neighbour would make it: ``SLOW_RANK`` (a rank number) spends ``SLOW_RANK_MS`` milliseconds of busy CPU work in
each training forward pass of its model. Without ``SLOW_RANK`` every rank is even. Straggler tests launch this entry."""

from __future__ import annotations

import dataclasses
import os
import time

from pipeline.job_files import user_errors_reported
from pipeline.rank import parse_args, resolve


def busy(seconds: float) -> None:
    """CPU-bound work for ``seconds`` (not a sleep: the rank's core stays busy, as with a slow device)."""
    until = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < until:
        x += sum(range(200))


def main() -> None:
    args = parse_args()
    with user_errors_reported():
        from pipeline.train.loop import train

        recipe, cfg, out = resolve(args)
        spec = recipe.load_train_spec()
        slow = os.environ.get("SLOW_RANK") == os.environ["RANK"]
        delay_s = float(os.environ.get("SLOW_RANK_MS", "0")) / 1e3

        def build_model(cfg, data):
            model = spec.build_model(cfg, data)
            if slow:
                model.register_forward_pre_hook(lambda module, args: busy(delay_s) if module.training else None)
            return model

        train(cfg, dataclasses.replace(spec, build_model=build_model), datasets=args.datasets, out_dir=out)


if __name__ == "__main__":
    main()

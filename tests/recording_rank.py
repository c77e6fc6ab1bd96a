"""``python -m pipeline.rank`` for the tabular recipe with its loss wrapped to record the training samples each
rank is given: ``samples-rank-R.jsonl`` in the job folder, one line per training micro-batch (a resumed attempt
appends), each sample its feature values. Tests that check which samples a run saw launch this entry instead."""

from __future__ import annotations

import dataclasses
import json
import os

from pipeline.job_files import user_errors_reported
from pipeline.rank import parse_args, resolve


def main() -> None:
    args = parse_args()
    with user_errors_reported():
        from pipeline.train.loop import train

        recipe, cfg, out = resolve(args)
        spec = recipe.load_train_spec()
        record = open(out / f"samples-rank-{os.environ['RANK']}.jsonl", "a")

        def loss(cfg, model, batch):
            if model.training:
                rows = [num + cat for num, cat in zip(batch["num"].tolist(), batch["cat"].tolist())]
                record.write(json.dumps([[round(v, 5) for v in row] for row in rows]) + "\n")
                record.flush()
            return spec.loss(cfg, model, batch)

        train(cfg, dataclasses.replace(spec, loss=loss), datasets=args.datasets, out_dir=out)


if __name__ == "__main__":
    main()

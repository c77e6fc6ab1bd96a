"""Training entrypoint: ``python -m pipeline.train`` alone, or under ``torchrun -m pipeline.train``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from pipeline.config import PipelineConfig, parse_set_args
from pipeline.errors import UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="resolved config JSON (PipelineConfig.to_dict)")
    parser.add_argument("--dataset", dest="datasets", required=True, action="append", metavar="URI",
                        help="dataset version folder or URI (with manifest.json); repeat it to read a window "
                        "of versions as streams of one dataset")
    parser.add_argument("--out", required=True, type=Path, help="folder for the model, checkpoints, result.json")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.learning_rate=3e-4 (repeatable)")
    return parser.parse_args(argv)


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = PipelineConfig.from_dict(json.loads(args.config.read_text()))
        cfg = cfg.with_overrides(parse_set_args(args.overrides))
    except UserError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    from pipeline.train.tabular import train

    train(cfg, datasets=args.datasets, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

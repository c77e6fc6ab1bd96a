"""Training entrypoint: ``python -m pipeline.train --recipe NAME ...`` alone, or under ``torchrun -m pipeline.train``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from pipeline.config import parse_set_args
from pipeline.errors import user_errors_reported


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__)
    parser.add_argument("--recipe", required=True, help="registered recipe name (pipeline.recipes), e.g. tabular_mlp")
    parser.add_argument("--config", type=Path, help="resolved config JSON (the recipe's config, to_dict); "
                        "default: the recipe's --variant")
    parser.add_argument("--variant", default="default", help="the recipe's config variant when no --config is given")
    parser.add_argument("--dataset", dest="datasets", required=True, action="append", metavar="URI",
                        help="dataset version folder or URI (with manifest.json); repeat it to read a window "
                        "of versions as streams of one dataset")
    parser.add_argument("--out", required=True, type=Path, help="folder for the model, checkpoints, result.json")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.learning_rate=3e-4 --set model.depth=2")
    return parser.parse_args(argv)


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with user_errors_reported():
        from pipeline.recipes import get_recipe
        from pipeline.train.loop import train

        recipe = get_recipe(args.recipe)
        if args.config:
            cfg = recipe.config_class.from_dict(json.loads(args.config.read_text()))
        else:
            cfg = recipe.config(args.variant)
        cfg = cfg.with_overrides(parse_set_args(args.overrides))
        train(cfg, recipe.load_train_spec(), datasets=args.datasets, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

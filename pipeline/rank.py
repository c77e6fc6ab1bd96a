"""One rank of a recipe's training job: ``python -m pipeline.rank --config FILE ...`` alone, or under
``torchrun -m pipeline.rank`` (the place exports the job folder as ``PIPELINE_JOB_DIR``). It stands above the
recipes and the loop: it looks the recipe up by name and hands the loop its config and hooks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from pipeline.config_fields import parse_set_args
from pipeline.job_files import user_errors_reported


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.rank", description=__doc__)
    parser.add_argument("--config", type=Path, help="resolved config JSON (PipelineConfig.to_dict: it names its "
                        "recipe); under the supervisor, the job folder's config.json")
    parser.add_argument("--recipe", help="registered recipe name (pipeline.recipes), e.g. tabular_mlp: the config "
                        "of its --variant, when no --config is given")
    parser.add_argument("--variant", default="default", help="the recipe's config variant when no --config is given")
    parser.add_argument("--dataset", dest="datasets", required=True, action="append", metavar="URI",
                        help="dataset version folder or URI (with manifest.json); repeat it to read a window "
                        "of versions as streams of one dataset")
    parser.add_argument("--out", type=Path, help="the job folder (model, checkpoints, result.json); default: "
                        "$PIPELINE_JOB_DIR, which every place exports")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.learning_rate=3e-4 --set model.depth=2")
    return parser.parse_args(argv)


def resolve(args: argparse.Namespace):
    """(recipe, config, job folder) from the arguments and the environment the place exported."""
    from pipeline.errors import ConfigError
    from pipeline.job_files import JobFiles
    from pipeline.recipes import config_from_dict, get_recipe

    if args.config:
        cfg = config_from_dict(json.loads(args.config.read_text()))
        if args.recipe and args.recipe != cfg.RECIPE:
            raise ConfigError(f"--recipe {args.recipe}: the config {args.config} is of the {cfg.RECIPE} recipe")
        recipe = get_recipe(cfg.RECIPE)
    elif args.recipe:
        recipe = get_recipe(args.recipe)
        cfg = recipe.config(args.variant)
    else:
        raise ConfigError("python -m pipeline.rank needs --config FILE (it names its recipe) or --recipe NAME")
    exported = JobFiles.from_env()
    out = args.out or (exported.root if exported else None)
    if out is None:
        raise ConfigError("python -m pipeline.rank needs --out DIR when no place exported PIPELINE_JOB_DIR")
    return recipe, cfg.with_overrides(parse_set_args(args.overrides)), out


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with user_errors_reported():
        from pipeline.train.loop import train

        recipe, cfg, out = resolve(args)
        train(cfg, recipe.load_train_spec(), datasets=args.datasets, out_dir=out)
    return 0


if __name__ == "__main__":
    code = main()  # a failure raises: the interpreter's own exit prints it
    from pipeline.fast_exit import exit_main

    exit_main("pipeline.rank", code)

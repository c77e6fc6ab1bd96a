"""LoRA fine-tuning with Axolotl, under torchrun in the axolotl toolchain's environment.

What ``axolotl train sft.yaml --launcher python`` does in each rank (``axolotl.cli.train``: load and validate
the config, load the datasets, train), with the run's own values set on the config first: the base model, the
train split's JSON Lines, ``output_dir`` in the job folder (checkpoints and the final adapter; with
``auto_resume_from_checkpoints`` a retry continues from the newest) and ``use_mlflow`` when the DAG's run is
given (``MLFLOW_RUN_ID``). A mistake in the config fails Axolotl's validation (pydantic's
``ValidationError``: toolchain.json's ``config_errors``). Rank 0 then writes ``$PIPELINE_RESULT_FILE``.

    torchrun --nproc-per-node=2 sft.py --model ./tiny-llama --data train.jsonl --config sft.yaml
"""

import argparse
import glob
import json
import os
import time

import torch
import yaml
from axolotl.cli.args import TrainerCliArgs
from axolotl.cli.config import load_cfg
from axolotl.cli.train import do_train
from axolotl.utils.dict import DictDefault

from pipeline.toolchains import write_result


def newest_checkpoint(folder):
    found = sorted(glob.glob(os.path.join(folder, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
    return found[-1] if found else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="local model folder (with its tokenizer)")
    parser.add_argument("--data", required=True, help="JSON Lines with prompt and completion fields")
    parser.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft.yaml"))
    parser.add_argument("--output", default=os.path.join(os.environ.get("PIPELINE_JOB_DIR", "."), "model"))
    args = parser.parse_args()
    started = time.monotonic()

    with open(args.config) as fh:
        raw = yaml.safe_load(fh) or {}
    raw["base_model"] = args.model
    for dataset in raw.get("datasets") or []:
        dataset.setdefault("path", args.data)
    raw["output_dir"] = args.output
    raw.setdefault("dataset_prepared_path", os.path.join(os.path.dirname(os.path.abspath(args.output)), "prepared"))
    raw.setdefault("use_mlflow", bool(os.environ.get("MLFLOW_RUN_ID")))
    resumed_from = newest_checkpoint(args.output)
    cpu = not torch.cuda.is_available()
    if cpu:
        # With WORLD_SIZE > 1 Axolotl asks CUDA about peer-to-peer access, which fails without a GPU; CPU ranks have
        # no peer access to report.
        import axolotl.utils.trainer

        axolotl.utils.trainer.check_cuda_p2p_ib_support = lambda: False
        for kernel in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"):  # Triton kernels, GPU only
            raw.setdefault(kernel, False)
    cfg = load_cfg(DictDefault(raw))  # Axolotl's validation: a mistake raises here, in every rank
    if cpu:  # with WORLD_SIZE > 1 Axolotl maps the model to the GPU numbered LOCAL_RANK
        cfg.device_map = {"": "cpu"}
    do_train(cfg, TrainerCliArgs())

    if int(os.environ.get("RANK", "0")) == 0:
        import axolotl

        final = newest_checkpoint(args.output)
        with open(os.path.join(final, "trainer_state.json")) as fh:
            state = json.load(fh)
        losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
        result = {"model_dir": os.path.abspath(args.output), "resumed_from": resumed_from,
                  "world_size": int(os.environ.get("WORLD_SIZE", "1")), "steps": state["global_step"],
                  "toolchain": "axolotl", "axolotl_version": axolotl.__version__,
                  "metrics": {"train_loss": losses[-1]} if losses else {}, "wall_s": round(time.monotonic() - started, 3)}
        write_result(result)


if __name__ == "__main__":
    main()

"""LoRA fine-tuning with Unsloth, under torchrun in the unsloth toolchain's environment.

Unsloth patches the model (``FastLanguageModel``), TRL's ``SFTTrainer`` trains it over DDP (gloo on CPUs,
where Unsloth falls back to stock transformers, PEFT and TRL; nccl and Unsloth's kernels on GPUs). The HF
Trainer's MLflow callback logs into the DAG's run (``MLFLOW_RUN_ID``); checkpoints go to
``$PIPELINE_CHECKPOINT_DIR``, and a retry resumes from the newest (``resume_from_checkpoint``). Rank 0 saves
the LoRA adapter (the DAG's adopt task merges it into the base model) and writes ``$PIPELINE_RESULT_FILE``.

    torchrun --nproc-per-node=2 sft.py --model ./tiny-llama --data train.jsonl --config sft.yaml
"""

import argparse
import glob
import os
import time

import torch
import unsloth  # noqa: F401  (before datasets, TRL and transformers: it patches them)
import yaml
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer
from unsloth import FastLanguageModel

from pipeline.toolchains import write_result

CONFIG_KEYS = {"max_seq_length", "lora", "sft"}


class ConfigMistake(ValueError):
    """The config file names a key or value the toolchain does not accept (toolchain.json's config_errors)."""


def restore_on_cpu_ranks():
    """Accelerate names a CPU rank's device ``cpu:N``, and the Trainer loads a checkpoint's optimizer state with
    that device as ``map_location``, which torch's CPU deserializer does not accept (it takes ``cpu``): so resuming
    DDP on CPUs fails. Storages tagged ``cpu:N`` are restored on the CPU."""
    torch.serialization.register_package(
        11, lambda obj: None, lambda obj, location: obj.cpu() if location.startswith("cpu:") else None)


def read_config(path):
    with open(path) as fh:
        config = yaml.safe_load(fh) or {}
    unknown = set(config) - CONFIG_KEYS
    if unknown:
        raise ConfigMistake(f"{path}: unknown key(s) {sorted(unknown)}; expected {sorted(CONFIG_KEYS)}")
    return config


def sft_config(path, values, checkpoints):
    try:
        return SFTConfig(**{
            "save_strategy": "steps", "dataloader_num_workers": 0, "disable_tqdm": True, **values,
            "output_dir": checkpoints, "report_to": ["mlflow"] if os.environ.get("MLFLOW_RUN_ID") else [],
            "use_cpu": not torch.cuda.is_available()})
    except (TypeError, ValueError) as exc:
        raise ConfigMistake(f"{path}: sft: {exc}") from exc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="local model folder (with its tokenizer)")
    parser.add_argument("--data", required=True, help="JSON Lines with prompt and completion fields")
    parser.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft.yaml"))
    parser.add_argument("--output", default=os.path.join(os.environ.get("PIPELINE_JOB_DIR", "."), "model"))
    args = parser.parse_args()
    started = time.monotonic()

    config = read_config(args.config)
    if not torch.cuda.is_available():
        restore_on_cpu_ranks()
    checkpoints = os.environ.get("PIPELINE_CHECKPOINT_DIR", os.path.join(args.output, "checkpoints"))
    training = sft_config(args.config, config.get("sft", {}), checkpoints)
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=args.model, max_seq_length=config.get("max_seq_length", 2048), load_in_4bit=False,
        dtype=torch.float32 if not torch.cuda.is_available() else None, local_files_only=True)
    try:
        model = FastLanguageModel.get_peft_model(model, **config.get("lora", {}), use_gradient_checkpointing=False,
                                                 random_state=training.seed)
    except TypeError as exc:
        raise ConfigMistake(f"{args.config}: lora: {exc}") from exc
    dataset = load_dataset("json", data_files=args.data, split="train")
    trainer = SFTTrainer(model=model, args=training, train_dataset=dataset, processing_class=tokenizer)
    found = sorted(glob.glob(os.path.join(checkpoints, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
    outcome = trainer.train(resume_from_checkpoint=found[-1] if found else None)

    trainer.save_model(args.output)  # the adapter; rank 0 writes, the others wait
    if trainer.is_world_process_zero():
        tokens = max((entry.get("num_tokens", 0) for entry in trainer.state.log_history), default=0)
        runtime = outcome.metrics.get("train_runtime") or 0
        result = {"model_dir": os.path.abspath(args.output), "resumed_from": found[-1] if found else None,
                  "world_size": training.world_size, "steps": outcome.global_step, "toolchain": "unsloth",
                  "unsloth_version": unsloth.__version__, "metrics": {"train_loss": outcome.training_loss},
                  "tokens_per_s": round(tokens / runtime, 1) if tokens and runtime else None,
                  "wall_s": round(time.monotonic() - started, 3)}
        write_result(result)


if __name__ == "__main__":
    main()

"""Supervised fine-tuning with TRL's SFTTrainer, unaware of Airflow: what `TorchrunOperator` runs unchanged.

Reads prompt/completion JSON Lines and a local model folder; trains with the loss on completions only.
The Hugging Face Trainer reads the torchrun environment itself (DDP over gloo on CPUs, nccl on GPUs),
logs to MLflow when MLFLOW_RUN_ID is set (its MLflow callback), checkpoints into $PIPELINE_CHECKPOINT_DIR
(so an Airflow retry resumes from the newest one), and rank 0 saves the model with its tokenizer and
writes a small JSON result to $PIPELINE_RESULT_FILE.

    torchrun --nproc-per-node=2 examples/trl_sft.py --model ./tiny-llama --data train.jsonl --output ./out
"""

import argparse
import glob
import json
import os

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="local model folder (with its tokenizer)")
    parser.add_argument("--data", required=True, help="JSON Lines with prompt and completion fields")
    parser.add_argument("--output", default=os.path.join(os.environ.get("PIPELINE_JOB_DIR", "."), "model"))
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-length", type=int, default=32)
    args = parser.parse_args()

    checkpoints = os.environ.get("PIPELINE_CHECKPOINT_DIR", os.path.join(args.output, "checkpoints"))
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    dataset = load_dataset("json", data_files=args.data, split="train")
    config = SFTConfig(
        output_dir=checkpoints, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, max_length=args.max_length, completion_only_loss=True, logging_steps=10,
        save_strategy="epoch", save_total_limit=2, report_to=["mlflow"] if os.environ.get("MLFLOW_RUN_ID") else [],
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    resume = bool(glob.glob(os.path.join(checkpoints, "checkpoint-*")))
    outcome = trainer.train(resume_from_checkpoint=resume or None)
    trainer.save_model(args.output)  # rank 0 writes; the others wait
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output)
        result = {"model_dir": os.path.abspath(args.output), "resumed": resume, "world_size": trainer.args.world_size,
                  "metrics": {"train_loss": outcome.training_loss}, "steps": outcome.global_step}
        if os.environ.get("PIPELINE_RESULT_FILE"):
            with open(os.environ["PIPELINE_RESULT_FILE"], "w") as fh:
                json.dump(result, fh)
        print(json.dumps(result))


if __name__ == "__main__":
    main()

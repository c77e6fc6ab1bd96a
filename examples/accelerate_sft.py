"""A plain Accelerate fine-tuning loop, unaware of Airflow: what `TorchrunOperator` runs unchanged.

`Accelerator()` picks up the torchrun environment (RANK, WORLD_SIZE, ...) and wraps model, optimizer and
loader for DDP. Prompt tokens are masked out of the loss. Logs to MLflow through Accelerate's tracker
when MLFLOW_RUN_ID is set; saves its state to $PIPELINE_CHECKPOINT_DIR every epoch (an Airflow retry
resumes from it); rank 0 saves the model with its tokenizer and writes $PIPELINE_RESULT_FILE.

    torchrun --nproc-per-node=2 examples/accelerate_sft.py --model ./tiny-llama --data train.jsonl --output ./out
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer


def tokenize(tokenizer, rows, max_length):
    """prompt + completion + EOS; labels -100 on the prompt's tokens (and padding)."""
    examples = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (prompt + completion)[:max_length]
        examples.append((ids, ([-100] * len(prompt) + completion)[:max_length]))
    return examples


def collate(batch, pad_id):
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(batch):
        ids[i, :len(row_ids)], labels[i, :len(row_labels)], mask[i, :len(row_ids)] = (
            torch.tensor(row_ids), torch.tensor(row_labels), 1)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="JSON Lines with prompt and completion fields")
    parser.add_argument("--output", default=os.path.join(os.environ.get("PIPELINE_JOB_DIR", "."), "model"))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-length", type=int, default=32)
    args = parser.parse_args()

    tracking = os.environ.get("MLFLOW_RUN_ID")
    accelerator = Accelerator(log_with="mlflow" if tracking else None, cpu=not torch.cuda.is_available())
    if tracking:
        accelerator.init_trackers("accelerate_sft", config=vars(args))
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    with open(args.data) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    examples = tokenize(tokenizer, rows, args.max_length)
    loader = torch.utils.data.DataLoader(examples, batch_size=args.batch_size, shuffle=True,
                                         collate_fn=lambda b: collate(b, tokenizer.pad_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    checkpoints = os.environ.get("PIPELINE_CHECKPOINT_DIR", os.path.join(args.output, "checkpoints"))
    state_file = os.path.join(checkpoints, "epoch.json")
    start_epoch = 0
    if os.path.exists(state_file):  # a retry: the state of the last finished epoch
        accelerator.load_state(os.path.join(checkpoints, "state"))
        with open(state_file) as fh:
            start_epoch = json.load(fh)["epoch"]
    step, loss = 0, torch.tensor(0.0)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 10 == 0:
                accelerator.log({"train_loss": loss.item()}, step=step)
        accelerator.save_state(os.path.join(checkpoints, "state"))
        if accelerator.is_main_process:
            with open(state_file + ".tmp", "w") as fh:
                json.dump({"epoch": epoch + 1}, fh)
            os.replace(state_file + ".tmp", state_file)
        accelerator.wait_for_everyone()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(args.output)
        tokenizer.save_pretrained(args.output)
        result = {"model_dir": os.path.abspath(args.output), "resumed": start_epoch > 0,
                  "world_size": accelerator.num_processes, "metrics": {"train_loss": loss.item()}, "steps": step}
        if os.environ.get("PIPELINE_RESULT_FILE"):
            with open(os.environ["PIPELINE_RESULT_FILE"], "w") as fh:
                json.dump(result, fh)
        print(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()

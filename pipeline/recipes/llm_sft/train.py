"""The causal LM's hooks for the generic loop: model (local checkpoint or a Llama-style config; LoRA through
peft), token batches, the completion-only loss, the exact match and loss before training, the export and the
``mlflow.transformers`` package, and the evaluation inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.data.read.training_data import TrainingData
from pipeline.data.prepare.transform import FOLDER
from pipeline.errors import ConfigError
from pipeline.evaluate.language_model import (EVALUATOR, IGNORE_INDEX, exact_match, generate, token_loss_sum,
                                              uses_chat_template)
from pipeline.recipes.llm_sft.tokenize import TOKENIZER, beside_input, load_tokenizer
from pipeline.registry.package import ModelPackage
from pipeline.results import TrainedModel
from pipeline.train.distributed import all_reduce_sum
from pipeline.train.spec import TrainSpec

MODEL_DIR = "hf_model"


def tokenizer_dir(data: TrainingData) -> Path:
    """The tokenizer the dataset was tokenized with (copied into the version by the preparation)."""
    return data.dirs[0] / FOLDER / TOKENIZER


def seq_len(data: TrainingData) -> int:
    return int(data.schema["encodings"]["input_ids"].rsplit(":", 1)[1])


def build_model(cfg, data: TrainingData):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    mc = cfg.model
    tokenizer = load_tokenizer(tokenizer_dir(data))
    if mc.pretrained_path:
        path = beside_input(mc.pretrained_path, cfg.data.input_path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.pretrained_path={mc.pretrained_path!r}: {path} is not a local checkpoint folder "
                              f"(no config.json there); nothing is fetched from a hub, so give a local directory")
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, attn_implementation="sdpa",
                                                     dtype=torch.float32)
    else:
        if mc.hidden_size % mc.num_heads or mc.num_heads % mc.num_kv_heads:
            raise ConfigError(f"model.hidden_size={mc.hidden_size}, model.num_heads={mc.num_heads}, model.num_kv_heads="
                              f"{mc.num_kv_heads}: expected hidden_size divisible by num_heads and num_heads by "
                              f"num_kv_heads")
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
            num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
            max_position_embeddings=seq_len(data) + mc.eval_max_new_tokens, tie_word_embeddings=mc.tie_embeddings,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            attn_implementation="sdpa",
        )
        model = LlamaForCausalLM(config)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if mc.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if mc.lora:
        from peft import LoraConfig, get_peft_model

        missing = [m for m in mc.lora_target_modules if not any(n.endswith(m) for n, _ in model.named_modules())]
        if missing:
            raise ConfigError(f"model.lora_target_modules: {missing} name no module of the model; its linear layers "
                              f"are {sorted({n.rsplit('.', 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})}")
        layers = model.config.num_hidden_layers
        if any(not 0 <= i < layers for i in mc.lora_layers):
            raise ConfigError(f"model.lora_layers={list(mc.lora_layers)}: the model has {layers} decoder layers; "
                              f"expected indices in 0..{layers - 1}")
        model = get_peft_model(model, LoraConfig(r=mc.lora_rank, lora_alpha=mc.lora_alpha, lora_dropout=mc.lora_dropout,
                                                 target_modules=list(mc.lora_target_modules), task_type="CAUSAL_LM",
                                                 layers_to_transform=list(mc.lora_layers) or None))
    if mc.compile:
        model.compile()  # in place: the state dict keeps its keys
    return model


def shard_units(cfg, model) -> list[torch.nn.Module]:
    """Each decoder layer; the embeddings, the final norm and the head (tied or not) stay in the model's own unit."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's LoRA wrapper
    return list(base.model.layers)


class ToTensors:
    """Token rows -> ``input_ids``, ``labels``, ``attention_mask`` int64 [B, T], T the batch's longest row."""

    def __call__(self, columns: dict[str, Any]) -> dict[str, torch.Tensor]:
        lengths = np.asarray(columns["num_tokens"], np.int64)
        width = max(int(lengths.max()) if len(lengths) else 1, 2)
        ids = torch.from_numpy(np.ascontiguousarray(columns["input_ids"][:, :width], np.int64))
        labels = torch.from_numpy(np.ascontiguousarray(columns["labels"][:, :width], np.int64))
        mask = (torch.arange(width)[None] < torch.from_numpy(lengths)[:, None]).long()
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def batch_transform(cfg, data: TrainingData, train: bool) -> ToTensors:
    return ToTensors()


def loss(cfg, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's mean loss per completion token (times the rows: the loop divides by them), and token accuracy.

    The output layer runs only at the positions that predict a completion token in some row (``logits_to_keep``):
    with a vocabulary of tens of thousands and prompts longer than their answers, it is most of the work else."""
    target = batch["labels"][:, 1:]
    keep = (target != IGNORE_INDEX).any(0).nonzero().squeeze(1)
    # No KV cache: nothing generates here, and a recomputed block (activation checkpointing) must see the inputs
    # of its first run, not a cache that run grew.
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep,
                   use_cache=False).logits.float()
    target = target[:, keep]
    counted = target != IGNORE_INDEX
    tokens = counted.sum().clamp_min(1)
    summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX,
                             reduction="sum")
    rows = batch["input_ids"].shape[0]
    correct = ((logits.argmax(-1) == target) & counted).sum()
    return summed / tokens * rows, {"token_accuracy": correct.float() / tokens * rows}


def tokens(cfg, batch: dict[str, torch.Tensor]) -> int:
    return int(batch["attention_mask"].sum())


def baseline(cfg, model, data: TrainingData, dist) -> dict[str, float]:
    """Exact match and token loss of the model before training (untrained, or the pretrained one before its
    fine-tuning) on the test split, as the evaluation measures them: every rank scores every world_size-th row."""
    columns = data.read_split("test")
    tokenizer = load_tokenizer(tokenizer_dir(data))
    limit = cfg.model.eval_max_examples or len(columns["prompt"])
    mine = slice(dist.rank, limit, dist.world_size)
    prompts, refs = [str(p) for p in columns["prompt"][mine]], [str(r) for r in columns["reference"][mine]]
    generated = generate(model, tokenizer, prompts, max_new_tokens=cfg.model.eval_max_new_tokens,
                         batch_size=cfg.model.eval_batch_size, add_special_tokens=not uses_chat_template(tokenizer))
    rows = slice(dist.rank, None, dist.world_size)
    loss, tokens = token_loss_sum(model, columns["input_ids"][rows], columns["labels"][rows],
                                  np.asarray(columns["num_tokens"])[rows], batch_size=cfg.model.eval_batch_size)
    model.train()
    matched, scored, loss, tokens = all_reduce_sum(dist, [exact_match(generated, refs) * len(refs), len(refs), loss,
                                                          tokens])
    return {"test_exact_match": matched / max(scored, 1), "test_loss": loss / max(tokens, 1)}


def export(cfg, model, data: TrainingData, out_dir: Path) -> dict[str, str]:
    """The model (LoRA adapters merged into the base) and its tokenizer as a transformers checkpoint folder."""
    if hasattr(model, "merge_and_unload"):  # a peft model: the registered model is the merged one
        model = model.merge_and_unload()
    model = model.cpu().eval()
    model.config.use_cache = True
    model.generation_config.max_new_tokens = cfg.model.eval_max_new_tokens
    model.generation_config.do_sample = False
    target = Path(out_dir) / MODEL_DIR
    model.save_pretrained(str(target))
    load_tokenizer(tokenizer_dir(data)).save_pretrained(str(target))
    return {"model_dir": str(target)}


def package(cfg, trained: TrainedModel, data: TrainingData) -> ModelPackage:
    import mlflow
    import transformers

    example = [str(data.read_split("test")["prompt"][0])] if data.rows("test") else ["Hello"]
    return ModelPackage(
        flavor="transformers",
        flavor_args={"transformers_model": trained.model_files["model_dir"], "task": "text-generation",
                     # The completion only, greedy: what the evaluation scores.
                     "model_config": {"return_full_text": False, "do_sample": False}},
        input_example=example,
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
                          f"mlflow=={mlflow.__version__}", "accelerate"],
    )


def evaluation_inputs(cfg, data: TrainingData, split: str):
    """The split's prompts and token rows (what the evaluator scores the model on) and its references."""
    columns = data.read_split(split)
    inputs = {"prompt": [str(p) for p in columns["prompt"]], "input_ids": columns["input_ids"],
              "labels": columns["labels"], "num_tokens": np.asarray(columns["num_tokens"])}
    return inputs, np.asarray([str(r) for r in columns["reference"]], dtype=object)


SPEC = TrainSpec(build_model=build_model, batch_transform=batch_transform, loss=loss, export=export, package=package,
                 evaluation_inputs=evaluation_inputs, evaluator=EVALUATOR, tokens=tokens, baseline=baseline,
                 shard_units=shard_units)

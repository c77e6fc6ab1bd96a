"""Causal-LM supervised fine-tuning: prompt/response pairs or chat ``messages`` tokenized into MDS (loss on
completions only), a ``transformers`` model from a local checkpoint or a small Llama-style config, full
fine-tune or LoRA (``peft``), trained in the generic DDP loop and registered with the ``mlflow.transformers``
flavor (text-generation).

Light: no torch or transformers here; tokenization is in ``tokenize.py`` (run by the preparation's workers),
the hooks in ``train.py``; the evaluation is ``pipeline.evaluate.language_model``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import DataConfig, EvaluateConfig, ModelConfig, PipelineConfig
from pipeline.config_fields import what_field, where_field
from pipeline.evaluate.directions import LANGUAGE_MODEL
from pipeline.recipes.base import Recipe

NAME = "llm_sft"


@dataclass(kw_only=True)
class LlmDataConfig(DataConfig):
    transform: str = what_field(
        "pipeline.recipes.llm_sft.tokenize:make", "Row transform of the preparation: this recipe's tokenization."
    )
    label_column: str = what_field("", "Unused by this recipe (the labels are the completions' tokens).")
    tokenizer_path: str = what_field(
        "", "Local folder of a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json); relative paths are "
        "taken from the folder of data.input_path. Its files are part of the dataset version and are copied into it. "
        "Nothing is fetched from a hub.",
    )
    prompt_column: str = what_field("prompt", "Column of the prompts (prompt/response data).")
    response_column: str = what_field("response", "Column of the completions the loss is on (prompt/response data).")
    messages_column: str = what_field(
        "messages", "Column of chat conversations (lists of {role, content}); when the input has it, the loss is on "
        "the last assistant message and the tokenizer's chat template formats the conversation.",
    )
    max_seq_len: int = what_field(128, "Tokens per training sequence.", min=8, max=131_072)
    overlong: str = what_field(
        "truncate", "An example longer than max_seq_len: truncate keeps its first max_seq_len tokens (dropped when no "
        "completion token is left), drop drops it; both are counted in the manifest.", choices=["truncate", "drop"],
    )
    packing: bool = what_field(
        False, "Pack training examples into full max_seq_len sequences (whole examples, in order; attention spans "
        "the examples of a sequence). Validation and test rows stay one example each.",
    )


@dataclass(kw_only=True)
class LlmModelConfig(ModelConfig):
    pretrained_path: str = what_field(
        "", "Local folder of a causal-LM checkpoint (AutoModelForCausalLM); relative paths are taken from the folder "
        "of data.input_path; empty builds a Llama-style model from the fields below. A hub name is refused: nothing "
        "is fetched at run time.",
    )
    hidden_size: int = what_field(64, "Width of the Llama-style model built from a config.", min=8, max=65_536)
    num_layers: int = what_field(2, "Decoder layers of the model built from a config.", min=1, max=256)
    num_heads: int = what_field(4, "Attention heads.", min=1, max=256)
    num_kv_heads: int = what_field(4, "Key/value heads (fewer than num_heads: grouped-query attention).", min=1, max=256)
    intermediate_size: int = what_field(256, "Width of the MLP of each layer.", min=8, max=262_144)
    tie_embeddings: bool = what_field(True, "Share the input embedding and the output projection.")
    lora: bool = what_field(
        False, "Train LoRA adapters (peft) instead of every weight; checkpoints hold the adapters, the registered "
        "model has them merged into the base.")
    lora_rank: int = what_field(8, "LoRA rank.", min=1, max=1024)
    lora_alpha: float = what_field(16.0, "LoRA alpha (the update is scaled by alpha / rank).", min=0.0)
    lora_dropout: float = what_field(0.05, "Dropout on the LoRA path.", min=0.0, max=0.9)
    lora_target_modules: list[str] = what_field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], "Module names that get LoRA adapters.")
    lora_layers: list[int] = what_field(
        [], "Decoder layers (indices from 0) that get LoRA adapters; empty: every layer. Adapting only the upper "
        "layers spares the backward pass through the lower ones.")
    gradient_checkpointing: bool = where_field(False, "Recompute activations in the backward pass (less memory).")
    compile: bool = where_field(False, "torch.compile the model (GPUs; the first steps compile).")
    eval_max_new_tokens: int = where_field(16, "Tokens generated per held-out prompt for exact match.", min=1, max=4096)
    eval_batch_size: int = where_field(64, "Prompts per batch of greedy generation.", min=1, max=4096)
    eval_max_examples: int = where_field(0, "Held-out examples generated for; 0: all of the test split.", min=0)
    report_samples: int = where_field(20, "Sample generations shown in the report.", min=0, max=1000)


@dataclass(kw_only=True)
class LlmConfig(PipelineConfig):
    METRICS = LANGUAGE_MODEL
    RECIPE = NAME
    data: LlmDataConfig = field(default_factory=LlmDataConfig)
    model: LlmModelConfig = field(default_factory=LlmModelConfig)
    evaluate: EvaluateConfig = field(default_factory=lambda: EvaluateConfig(metric="exact_match", guardrails=[]))


def _write_demo(path) -> None:
    from pipeline.recipes.llm_sft import demo

    demo.write_wordnet_pos(path)


RECIPE = Recipe(
    name=NAME,
    description="Causal-LM supervised fine-tuning (transformers; full or LoRA), tokenized MDS, mlflow.transformers.",
    config_class=LlmConfig,
    # SmolLM2-135M-Instruct with LoRA on its upper 15 of 30 layers, on parts of speech from WordNet's example
    # sentences (make demo), the checkpoint and its tokenizer beside the questions; the split holds out whole words.
    defaults={
        "data.tokenizer_path": "SmolLM2-135M-Instruct", "model.pretrained_path": "SmolLM2-135M-Instruct",
        "model.lora": True, "model.lora_layers": list(range(15, 30)), "data.key_column": "word",
        "data.max_seq_len": 128, "data.val_fraction": 0.05,
        "train.epochs": 1, "train.batch_size": 8, "train.learning_rate": 1e-3, "train.weight_decay": 0.0,
        "train.lr_schedule": "cosine", "train.warmup_steps": 10, "train.log_every_steps": 10,
        "model.eval_max_new_tokens": 4, "model.eval_batch_size": 32, "evaluate.min_improvement": 0.0,
    },
    variants={
        "demo": {},
        # The tests' additions (demo.write_addition) with their own tokenizer and a tiny model built from a config.
        "tiny": {"data.tokenizer_path": "tokenizer", "model.pretrained_path": "", "model.lora": False,
                 "model.lora_layers": [], "data.key_column": "", "data.val_fraction": 0.1, "data.max_seq_len": 16,
                 "train.batch_size": 16, "train.learning_rate": 3e-3, "train.warmup_steps": 20,
                 "model.hidden_size": 32, "model.intermediate_size": 64, "model.num_layers": 1,
                 "model.eval_max_new_tokens": 4, "model.eval_max_examples": 64, "model.eval_batch_size": 64,
                 "data.shard_size_limit_bytes": 1 << 14},
    },
    params={
        "input_path": "data.input_path",
        "tokenizer_path": "data.tokenizer_path",
        "pretrained_path": "model.pretrained_path",
        "max_seq_len": "data.max_seq_len",
        "packing": "data.packing",
        "lora": "model.lora",
        "lora_rank": "model.lora_rank",
        "parallelism": "train.parallelism",
    },
    train_spec="pipeline.recipes.llm_sft.train:SPEC",
    demo_path="wordnet-pos/questions.jsonl",
    write_demo=_write_demo,
    tags=("ddp", "llm", "transformers"),
)

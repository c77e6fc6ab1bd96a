"""Evaluation of a causal LM: held-out token loss and perplexity, exact match of greedy generations
(batched) against the references, and the report's sample generations, each model's beside the reference.

``LmEvaluator.score`` loads a registered version's model and tokenizer (``mlflow.transformers``
components) and scores them itself: the loss needs the model, not only its generated text. The generation
and exact match are shared with the llm_sft recipe's baseline (the exact match before training).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pipeline.evaluate.directions import LANGUAGE_MODEL

IGNORE_INDEX = -100  # the label of a token outside the loss (a prompt's, padding): PyTorch's cross_entropy default


def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, batch_size: int,
             add_special_tokens: bool = True) -> list[str]:
    """Greedy completions of ``prompts`` (left-padded batches), decoded without special tokens."""
    import torch

    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        model.eval()
        for at in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[at:at + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=add_special_tokens).to(device)
            with torch.no_grad():
                generated = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            out += tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return out


def exact_match(generated: list[str], references: list[str]) -> float:
    """Share of generations equal to their reference, surrounding whitespace ignored."""
    if not references:
        return 0.0
    return float(np.mean([g.strip() == r.strip() for g, r in zip(generated, references)]))


def token_loss(model, input_ids: np.ndarray, labels: np.ndarray, num_tokens: np.ndarray, *, batch_size: int) -> float:
    """Mean loss per completion token (prompt tokens are -100 in ``labels``)."""
    total, count = token_loss_sum(model, input_ids, labels, num_tokens, batch_size=batch_size)
    return total / max(count, 1)


def token_loss_sum(model, input_ids: np.ndarray, labels: np.ndarray, num_tokens: np.ndarray, *,
                   batch_size: int) -> tuple[float, int]:
    """The summed loss over the completion tokens, and how many there are (to add up across ranks)."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    for at in range(0, len(input_ids), batch_size):
        n = num_tokens[at:at + batch_size]
        width = int(n.max())
        ids = torch.from_numpy(input_ids[at:at + batch_size, :width].astype(np.int64)).to(device)
        target = torch.from_numpy(labels[at:at + batch_size, :width].astype(np.int64)).to(device)
        mask = (torch.arange(width, device=device)[None] < torch.from_numpy(n.astype(np.int64)).to(device)[:, None])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask.long()).logits[:, :-1].float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum").item()
        count += int((target[:, 1:] != IGNORE_INDEX).sum())
    return total, count


def uses_chat_template(tokenizer) -> bool:
    return tokenizer.chat_template is not None


class LmEvaluator:
    metrics = LANGUAGE_MODEL
    history_keys = ("train_loss", "val_loss", "train_token_accuracy", "val_token_accuracy")
    baseline = "model before training"  # its exact match, logged by the recipe's baseline hook (untrained or pretrained)

    def score(self, model_uri: str, inputs: dict[str, Any], references: np.ndarray, cfg) -> dict[str, Any]:
        """Exact match of greedy generations (the first ``model.eval_max_examples``) and the token loss."""
        import mlflow.transformers

        components = mlflow.transformers.load_model(model_uri, return_type="components")
        model, tokenizer = components["model"], components["tokenizer"]
        mc = cfg.model
        limit = mc.eval_max_examples or len(references)
        prompts, refs = list(inputs["prompt"][:limit]), [str(r) for r in references[:limit]]
        generated = generate(model, tokenizer, prompts, max_new_tokens=mc.eval_max_new_tokens,
                             batch_size=mc.eval_batch_size, add_special_tokens=not uses_chat_template(tokenizer))
        loss = token_loss(model, inputs["input_ids"], inputs["labels"], inputs["num_tokens"], batch_size=mc.eval_batch_size)
        metrics = {"exact_match": exact_match(generated, refs), "loss": loss, "perplexity": math.exp(min(loss, 50.0)),
                   "rows": float(len(references)), "generated_rows": float(len(prompts))}
        samples = [{"prompt": p, "reference": r, "generated": g}
                   for p, r, g in list(zip(prompts, refs, generated))[:mc.report_samples]]
        return {"metrics": metrics, "details": {"samples": samples}}

    def report_sections(self, classes: list, scored: dict[str, Any], history) -> list:
        from pipeline.evaluate.report.document import Sample, Samples, Section, role_labels
        from pipeline.evaluate.report.plots import training_curves

        labels = role_labels(scored)
        # Every model generates for the same first prompts of the split: a row per prompt, a column per model.
        by_prompt = {role: {x["prompt"]: x["generated"] for x in scored[role]["details"]["samples"]} for role in labels}
        rows = tuple(Sample(x["prompt"], x["reference"], {role: by_prompt[role][x["prompt"]] for role in labels
                                                           if x["prompt"] in by_prompt[role]})
                     for x in scored["challenger"]["details"]["samples"])
        samples = Samples(f"{len(rows)} greedy generations against their references: ✓ exact match, ✗ not; "
                          "words the reference lacks are marked, words the generation lacks struck through",
                          labels, rows)
        sections = [Section("Sample generations", (samples,))]
        curves = training_curves(history, labels)
        if curves is not None:
            sections.append(Section("Training", (curves,)))
        return sections


EVALUATOR = LmEvaluator()

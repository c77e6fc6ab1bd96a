"""Evaluation of a causal LM: held-out token loss and perplexity, exact match of greedy generations
(batched) against the references, and a report with sample generations.

``LmEvaluator.score`` loads a registered version's model and tokenizer (``mlflow.transformers``
components) and scores them itself: the loss needs the model, not only its generated text. The generation
and exact match are shared with the llm_sft recipe's baseline (the untrained model's exact match).
"""

from __future__ import annotations

import html
import math
from pathlib import Path
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
    return total / max(count, 1)


def uses_chat_template(tokenizer) -> bool:
    return tokenizer.chat_template is not None


class LmEvaluator:
    metrics = LANGUAGE_MODEL
    history_keys = ("train_loss", "val_loss")

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

    def write_report(self, out_dir: Path, *, model_name: str, classes: list, scored: dict[str, Any],
                     history: dict[str, list[tuple[int, float]]], decision: dict[str, Any]) -> list[Path]:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        files = []
        if any(history.values()):
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            for key, points in history.items():
                if points:
                    ax.plot(*zip(*sorted(points)), label=key)
            ax.set_xlabel("step")
            ax.set_ylabel("loss per completion token")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out_dir / "loss.png", dpi=90)
            plt.close(fig)
            files.append(out_dir / "loss.png")
        present = {role: s for role, s in scored.items() if s is not None}
        rows = "".join(
            f"<tr><td>{role} (version {s['version']})</td>" + "".join(
                f"<td>{s['metrics'].get(k, float('nan')):.4f}</td>" for k in self.metrics) + "</tr>"
            for role, s in present.items())
        parts = [f"<h1>{html.escape(model_name)}</h1>",
                 f"<p>Gate: {html.escape(str(decision.get('status')))}: {html.escape(str(decision.get('reason')))}</p>",
                 "<table border=1><tr><th>model</th>" + "".join(f"<th>{k}</th>" for k in self.metrics) + f"</tr>{rows}</table>"]
        if files:
            parts.append('<img src="loss.png">')
        for role, s in present.items():
            samples = s["details"]["samples"]
            parts.append(f"<h2>Sample generations: {role}</h2><table border=1><tr><th>prompt</th><th>reference</th>"
                         "<th>generated</th><th>match</th></tr>" + "".join(
                             f"<tr><td><pre>{html.escape(x['prompt'])}</pre></td><td>{html.escape(x['reference'])}</td>"
                             f"<td>{html.escape(x['generated'])}</td>"
                             f"<td>{'yes' if x['generated'].strip() == x['reference'].strip() else 'no'}</td></tr>"
                             for x in samples) + "</table>")
        (out_dir / "report.html").write_text("<html><body>" + "".join(parts) + "</body></html>")
        return [out_dir / "report.html", *files]

    def text_summary(self, classes: list, scored: dict[str, Any], decision: dict[str, Any]) -> str:
        lines = []
        for role, s in scored.items():
            if s is not None:
                lines.append(f"{role} version {s['version']}: " + ", ".join(
                    f"{k} {s['metrics'][k]:.4f}" for k in self.metrics))
                lines += [f"  {x['prompt']!r} -> {x['generated']!r} (reference {x['reference']!r})"
                          for x in s["details"]["samples"][:5]]
        lines.append(f"gate {decision.get('status')}: {decision.get('reason')}")
        return "\n".join(lines)


EVALUATOR = LmEvaluator()

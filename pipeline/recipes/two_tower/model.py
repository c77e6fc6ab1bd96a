"""The towers: an id embedding, categorical-feature embeddings and standardized numbers, through an MLP
into a unit vector; a user and an item are scored by the cosine of their vectors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Tower(nn.Module):
    """(ids [B], categorical codes [B, C], raw numbers [B, N][, history [B, H]]) -> unit vectors [B, embedding_dim].
    Numbers are standardized inside, so that an exported tower takes raw values. With ``history_items``, the
    tower also reads a row's history, item codes (0: none), as the mean of their embeddings."""

    def __init__(self, *, ids: int, vocab_sizes: list[int], numeric: int, mean: list[float], std: list[float],
                 id_dim: int, feature_dim: int, widths: list[int], out_dim: int, history_items: int = 0):
        super().__init__()
        self.id_embedding = nn.Embedding(ids, id_dim)
        self.history_embedding = nn.Embedding(history_items, id_dim, padding_idx=0) if history_items else None
        self.feature_embeddings = nn.ModuleList(nn.Embedding(size, feature_dim) for size in vocab_sizes)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).reshape(numeric))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).clamp_min(1e-6).reshape(numeric))
        layers: list[nn.Module] = []
        width = id_dim * (2 if history_items else 1) + feature_dim * len(vocab_sizes) + numeric
        for hidden in widths:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, out_dim))
        self.mlp = nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor, cat: torch.Tensor, num: torch.Tensor,
                history: torch.Tensor | None = None) -> torch.Tensor:
        parts = [self.id_embedding(ids)]
        if self.history_embedding is not None:
            count = (history != 0).sum(dim=1, keepdim=True).clamp_min(1)
            parts.append(self.history_embedding(history).sum(dim=1) / count)
        parts += [embedding(cat[:, j]) for j, embedding in enumerate(self.feature_embeddings)]
        parts.append((num - self.mean) / self.std)
        return F.normalize(self.mlp(torch.cat(parts, dim=1)), dim=1)


class TwoTower(nn.Module):
    def __init__(self, user: Tower, item: Tower):
        super().__init__()
        self.user, self.item = user, item

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.user(batch["user"], batch["user_cat"], batch["user_num"], batch.get("history")),
                self.item(batch["item"], batch["item_cat"], batch["item_num"]))


def in_batch_softmax_loss(users: torch.Tensor, items: torch.Tensor, item_ids: torch.Tensor,
                          log_q: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Sampled softmax over the batch's items, summed over its rows: row i's positive is item i, the
    other rows' items are its negatives. With ``log_q`` (log of each item's sampling frequency), the
    logits are corrected for popular items being drawn as negatives more often (Yi et al., 2019).
    Another row holding the same item is not a negative (an accidental hit) and is masked out."""
    logits = users @ items.T / temperature
    if log_q is not None:
        logits = logits - log_q[None, :]
    same = item_ids[None, :] == item_ids[:, None]
    logits = logits.masked_fill(same & ~torch.eye(len(item_ids), dtype=torch.bool, device=logits.device), float("-inf"))
    return F.cross_entropy(logits.float(), torch.arange(len(item_ids), device=logits.device), reduction="sum")

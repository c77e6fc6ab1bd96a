"""The tabular MLP: numeric standardization and categorical embeddings inside the module."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(kw_only=True)
class ModelSpec:
    """Everything needed to rebuild the module before loading its state dict."""

    num_numeric: int
    cardinalities: list[int]  # per categorical column, including the unknown code 0
    num_classes: int
    hidden_sizes: list[int]
    dropout: float

    def to_dict(self) -> dict:
        return asdict(self)


class TabularMLP(nn.Module):
    def __init__(self, spec: ModelSpec, mean: list[float] | None = None, std: list[float] | None = None):
        super().__init__()
        self.spec = spec
        mean_t = torch.tensor(mean if mean is not None else [0.0] * spec.num_numeric, dtype=torch.float32)
        std_t = torch.tensor(std if std is not None else [1.0] * spec.num_numeric, dtype=torch.float32)
        # Buffers, so that the saved model standardizes raw inputs itself.
        self.register_buffer("mean", mean_t)
        self.register_buffer("std", std_t.clamp_min(1e-6))
        self.embeddings = nn.ModuleList(
            nn.Embedding(cardinality, _embedding_dim(cardinality)) for cardinality in spec.cardinalities
        )
        width = spec.num_numeric + sum(e.embedding_dim for e in self.embeddings)
        layers: list[nn.Module] = []
        for hidden in spec.hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(spec.dropout)]
            width = hidden
        layers.append(nn.Linear(width, spec.num_classes))
        self.mlp = nn.Sequential(*layers)

    def forward(self, num: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        parts = [(num - self.mean) / self.std]
        parts += [embedding(cat[:, i]) for i, embedding in enumerate(self.embeddings)]
        return self.mlp(torch.cat(parts, dim=1))


def _embedding_dim(cardinality: int) -> int:
    return min(16, (cardinality + 1) // 2 + 1)

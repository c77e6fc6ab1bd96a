"""Saving a trained network so that it loads without its Python class: ``torch.export`` with a dynamic
batch dimension (``torch.export.load(path).module()`` runs it wherever torch is installed)."""

from __future__ import annotations

from pathlib import Path

import torch

NETWORK_FILE = "network.pt2"


def export_network(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], path: Path) -> Path:
    """Export ``model`` (in eval mode, on the CPU) for inputs shaped like ``example_inputs``, any batch size."""
    model = model.cpu().eval()
    dynamic = tuple({0: torch.export.Dim.DYNAMIC} for _ in example_inputs)
    program = torch.export.export(model, tuple(t.cpu() for t in example_inputs), dynamic_shapes=dynamic)
    torch.export.save(program, str(path))
    return Path(path)

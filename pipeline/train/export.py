"""Saving a trained network so that it loads without its Python class: ``torch.export`` with a dynamic
batch dimension (``torch.export.load(path).module()`` runs it wherever torch is installed); and the model
files of a run, written whole or not at all."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

import torch

from pipeline.diskspace import space_checked
from pipeline.train.checkpoint import state_bytes

NETWORK_FILE = "network.pt2"


def export_network(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], path: Path) -> Path:
    """Export ``model`` (in eval mode, on the CPU) for inputs shaped like ``example_inputs``, any batch size."""
    model = model.cpu().eval()
    dynamic = tuple({0: torch.export.Dim.DYNAMIC} for _ in example_inputs)
    program = torch.export.export(model, tuple(t.cpu() for t in example_inputs), dynamic_shapes=dynamic)
    torch.export.save(program, str(path))
    return Path(path)


def saved_model_files(out_dir: Path, model: torch.nn.Module, write: Callable[[Path], dict[str, str]]) -> dict[str, str]:
    """The model files ``write(folder)`` makes (name -> path), written into a temporary folder and renamed into
    ``out_dir`` once all are complete: a failed write (a full disk: ``OutOfSpace``, the bytes needed estimated
    from ``model``'s state) leaves none of them."""
    out_dir = Path(out_dir)
    tmp = out_dir / f".model-files-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        with space_checked(out_dir, state_bytes(model.state_dict())):
            files = write(tmp)
        for entry in tmp.iterdir():
            target = out_dir / entry.name
            if target.is_dir():
                shutil.rmtree(target)  # an earlier attempt's
            os.replace(entry, target)  # a rename on one file system: needs no space
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {name: str(out_dir / Path(path).relative_to(tmp)) if Path(path).is_relative_to(tmp) else path
            for name, path in files.items()}

"""Load a registered model the way its users do: a fresh interpreter in which ``pipeline`` cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_LOADER = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class NoPipeline(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "pipeline" or name.startswith("pipeline."):
                raise ImportError(f"{name} is not importable in this interpreter")

    sys.meta_path.insert(0, NoPipeline())
    import mlflow.pyfunc
    import pandas as pd

    model = mlflow.pyfunc.load_model(sys.argv[1])
    plain = lambda p: [str(v) for v in p] if hasattr(p, "__len__") and not isinstance(p, str) else str(p)
    answers = []
    for frame in pd.read_pickle(sys.argv[2]):  # the frames, each predicted by the one loaded model
        output = model.predict(frame)
        predictions = output[sys.argv[3]] if hasattr(output, "columns") else output  # a table, or texts (LLMs)
        answers.append([plain(p) for p in predictions])
    assert not any(m == "pipeline" or m.startswith("pipeline.") for m in sys.modules)
    print("PREDICTIONS=" + json.dumps(answers))
    """
)


def predict_in_fresh_interpreter(model_uri: str, frame, tmp_path: Path, column: str = "prediction",
                                 env: dict[str, str] | None = None) -> list:
    """``model_uri``'s predictions for ``frame`` (a pandas DataFrame), from a subprocess that cannot import
    this project (its working folder is elsewhere, and an import hook refuses ``pipeline``): the output's
    ``column`` as text, or lists of text where its values are lists. ``frame`` may be a list of frames: the
    model is loaded once, and each frame's predictions come back in a list. ``env``: set in its environment."""
    import pandas as pd

    frames = frame if isinstance(frame, list) else [frame]
    frame_path = tmp_path / "input.pkl"
    pd.to_pickle(frames, frame_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | (env or {})
    done = subprocess.run([sys.executable, "-c", _LOADER, model_uri, str(frame_path), column], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("PREDICTIONS="))
    answers = json.loads(line.removeprefix("PREDICTIONS="))
    return answers if isinstance(frame, list) else answers[0]


def digit_images(count: int):
    """scikit-learn's first ``count`` digits as 8-bit pixel arrays, and the same as PNG files' bytes: what the image
    recipe's registered model takes."""
    import io

    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    pixels = np.clip(np.rint(load_digits().images[:count] * (255 / 16)), 0, 255).astype(np.uint8)
    encoded = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    return pixels, encoded

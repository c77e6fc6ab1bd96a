"""The registered image classifier (MLflow models-from-code): raw images in, class names and probabilities out.

Self-contained: it imports torch, numpy, pandas, Pillow and mlflow only, never this project. Input:
a DataFrame whose ``image`` column holds encoded images (PNG/JPEG bytes) or pixel arrays (H x W, or
H x W x C), or an array of images [N, H, W(, C)]. Images are converted to the channels the network
was trained on and resized to its input size. Output: ``prediction`` (the class name) and one
``proba_<name>`` column per class.
"""

import io
import json

import mlflow.pyfunc
import numpy as np
import pandas as pd
from mlflow.models import set_model

# As pipeline.data.images (this file imports nothing of the project): a PNG of a few KB can claim
# 30000 x 30000 pixels; such an image is refused before its pixels are decoded.
MAX_PIXELS = 1 << 26


class ImageClassifier(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        import torch

        with open(context.artifacts["labels"]) as fh:
            self.labels = json.load(fh)
        self.network = torch.export.load(context.artifacts["network"]).module()

    def predict(self, context, model_input, params=None):
        import torch

        if isinstance(model_input, pd.DataFrame):
            if "image" not in model_input:
                raise ValueError(f"input has columns {list(model_input.columns)}; expected an 'image' column of "
                                 f"PNG/JPEG bytes or pixel arrays")
            images, index = list(model_input["image"]), model_input.index
        else:
            images, index = list(np.asarray(model_input)), None
        pixels = np.stack([self._pixels(image, i) for i, image in enumerate(images)]).astype(np.float32)
        with torch.no_grad():
            probabilities = torch.softmax(self.network(torch.from_numpy(pixels)), dim=1).numpy()
        names = self.labels["names"]
        out = pd.DataFrame(probabilities, columns=[f"proba_{n}" for n in names], index=index)
        out.insert(0, "prediction", np.asarray(names, dtype=object)[probabilities.argmax(axis=1)])
        return out

    def _pixels(self, image, row: int) -> np.ndarray:
        """One image -> [C, H, W] uint8 in the network's channels and size."""
        from PIL import Image

        channels, height, width = self.labels["channels"], self.labels["height"], self.labels["width"]
        if isinstance(image, (bytes, bytearray)):
            try:
                picture = Image.open(io.BytesIO(image))
                pixels = picture.size[0] * picture.size[1]
                if pixels <= MAX_PIXELS:
                    picture.load()
            except Exception as exc:
                raise ValueError(f"row {row}: the image bytes do not decode as PNG/JPEG ({exc})") from None
            if pixels > MAX_PIXELS:
                raise ValueError(f"row {row}: the image claims {picture.size[0]} x {picture.size[1]} pixels, more "
                                 f"than the {MAX_PIXELS:,} allowed")
        else:
            array = np.asarray(image)
            if array.ndim not in (2, 3):
                raise ValueError(f"row {row}: an image array must be H x W or H x W x C, got shape {array.shape}")
            if array.dtype != np.uint8:
                array = np.clip(array, 0, 255).astype(np.uint8)
            picture = Image.fromarray(array)
        picture = picture.convert("L" if channels == 1 else "RGB")
        if picture.size != (width, height):
            picture = picture.resize((width, height), Image.BILINEAR)
        array = np.asarray(picture, dtype=np.uint8)
        return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


set_model(ImageClassifier())

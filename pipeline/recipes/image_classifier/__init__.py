"""Image classifier recipe: a small ResNet on IDX files (MNIST/FashionMNIST layout) or class folders of
PNG/JPEG, with on-the-fly augmentation, plain PyTorch DDP.

Light: no torch here; the network is in ``model.py`` and the hooks in ``train.py``, imported by the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import ModelConfig, PipelineConfig
from pipeline.config_fields import what_field
from pipeline.data.packaged import FASHION_MNIST_CLASSES
from pipeline.evaluate.directions import CLASSIFICATION
from pipeline.recipes.base import Recipe

NAME = "image_classifier"


@dataclass(kw_only=True)
class ImageModelConfig(ModelConfig):
    widths: list[int] = what_field(
        [32, 64, 128], "Channels of each ResNet stage; every stage after the first halves the resolution.",
        min=1, max=4096,
    )
    depth: int = what_field(1, "Residual blocks (two 3x3 convolutions each) per stage.", min=1, max=16)
    dropout: float = what_field(0.1, "Dropout before the classifier.", min=0.0, max=0.9)
    augment: bool = what_field(True, "Random shifts and rotations of training images, on the fly on the device.")
    max_shift: float = what_field(0.1, "Largest random shift, as a fraction of the image size.", min=0.0, max=0.5)
    max_rotation_deg: float = what_field(10.0, "Largest random rotation in degrees.", min=0.0, max=180.0)
    class_names: list[str] = what_field(
        [], "Names of the label classes in their sorted order (IDX labels 0..9: the names of those digits); "
        "empty names each class by its label. The registered model returns these names.",
    )


@dataclass(kw_only=True)
class ImageConfig(PipelineConfig):
    METRICS = CLASSIFICATION
    RECIPE = NAME
    model: ImageModelConfig = field(default_factory=ImageModelConfig)


def _write_demo(path) -> None:
    from pipeline.data import packaged

    packaged.link_files(packaged.FASHION_MNIST, path)  # Debian's dataset-fashion-mnist, installed when missing


RECIPE = Recipe(
    name=NAME,
    description="Small ResNet image classifier on IDX files or class folders of PNG/JPEG, PyTorch DDP.",
    config_class=ImageConfig,
    defaults={
        "train.epochs": 20, "train.batch_size": 64, "train.learning_rate": 3e-3, "train.lr_schedule": "cosine",
        "train.warmup_steps": 10, "train.log_every_steps": 20,
    },
    variants={
        # Fashion-MNIST (make demo): its own 10,000 test images are the test split.
        "demo": {"train.epochs": 8, "model.widths": [16, 32, 64], "model.augment": False, "data.split_by": "files",
                 "data.test_files": ["t10k-*"], "data.val_fraction": 0.05, "model.class_names": FASHION_MNIST_CLASSES},
        "tiny": {"train.epochs": 2, "train.batch_size": 16, "model.widths": [8, 16], "train.log_every_steps": 5,
                 "data.shard_size_limit_bytes": 1 << 14},
    },
    params={
        "input_path": "data.input_path",
        "label_column": "data.label_column",
        "widths": "model.widths",
        "depth": "model.depth",
        "augment": "model.augment",
        "parallelism": "train.parallelism",
    },
    train_spec="pipeline.recipes.image_classifier.train:SPEC",
    demo_path="fashion-mnist",
    write_demo=_write_demo,
    tags=("ddp", "images"),
)

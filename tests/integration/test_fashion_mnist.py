"""The image demo's real data: Debian's Fashion-MNIST (``dataset-fashion-mnist``, which ``make test`` installs
with the other system packages) prepared with the demo variant's config, its own t10k files the test split."""

import numpy as np
import pytest

from pipeline.data import packaged
from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.recipes import get_recipe


def test_fashion_mnist_keeps_its_own_10000_test_images_as_the_test_split(tmp_path):
    if not packaged.FASHION_MNIST.present():
        pytest.skip("Fashion-MNIST is not installed: apt-get install dataset-fashion-mnist (tests/system-packages.sh)")
    cfg = get_recipe("image_classifier").config("demo")
    linked = packaged.link_files(packaged.FASHION_MNIST, tmp_path / "fashion-mnist")
    cfg = cfg.with_overrides({"data.input_path": str(linked)})
    manifest = prepare(cfg.data, name="fashion", out_root=tmp_path / "out")
    rows = manifest["splits"]
    assert rows["test"] == 10_000 and rows["train"] + rows["val"] == 60_000
    assert 0.03 < rows["val"] / 60_000 < 0.07  # the demo's val_fraction, 0.05, by the hash
    assert manifest["label_classes"] == list(range(10)) and len(cfg.model.class_names) == 10

    test = TrainingData.open([manifest["uri"]], tmp_path / "cache").read_split("test")
    # The t10k set is balanced, 1,000 images of each class, and its images are 28x28 grey.
    assert np.bincount(np.asarray(test["label"]), minlength=10).tolist() == [1000] * 10
    assert np.asarray(test["image"][0]).shape == (28, 28)

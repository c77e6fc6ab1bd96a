"""Decoding that cannot hang: a corrupted image raises at once with where it is, in every stage that decodes
(training's loader, the registered model's input example and evaluation, which read whole splits, and
serving). Pillow decodes: on the PNG of ``png_bad_filter`` torchvision's decode_png crashed the process
(here) or hung deaf to SIGTERM (where the damage was found), so merely running these tests in-process
shows that nothing here calls it."""

import io
import json

import numpy as np
import pytest

from pipeline.data import images
from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.data.versions import integrity
from pipeline.errors import DataError
from tests.datafiles import (
    cfg,
    dataset_dir,
    png_bad_filter,
    png_bomb,
    write_image_folder,
)


@pytest.mark.parametrize("blob, expected", [
    (b"", "value of 0 bytes is empty"),
    (png_bad_filter(), "value of 99 bytes is not a decodable image"),
    (b"\x89PNG\r\n\x1a\n" + bytes(40), "value of 48 bytes is not a decodable image"),
    (png_bomb(), "value of 109 bytes is a decompression bomb"),
    (png_bomb(9_000), "value of 88 bytes claims 9000 x 9000 pixels (a decompression bomb?)"),
], ids=["empty", "bad-filter-bytes", "garbage", "bomb-30000", "bomb-9000"])
def test_a_bad_image_raises_saying_what_is_wrong(blob, expected):
    with pytest.raises(images.BadImage) as raised:
        images.decode(blob)
    assert expected in str(raised.value)


def test_good_images_decode_as_pil_does():
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    for image in (Image.fromarray(pixels), Image.fromarray(pixels[..., 0]), Image.fromarray(pixels).convert("P")):
        out = io.BytesIO()
        image.save(out, format="PNG")
        assert np.array_equal(images.decode(out.getvalue()), np.asarray(image))


@pytest.fixture
def damaged_record(tmp_path):
    """A published image version whose first training sample's PNG data is garbage, with the manifest's digest
    made to match, and the split index's: damage that digests cannot see (a broken writer, a bad disk before
    publication)."""
    write_image_folder(tmp_path / "img", {"boot": 30, "shirt": 30})
    manifest = prepare(cfg(tmp_path / "img", compression="none"), name="t", out_root=tmp_path / "out")
    entry = manifest["shards"]["train"][0]
    shard = dataset_dir(manifest) / "train" / entry["basename"]
    data = bytearray(shard.read_bytes())
    at = data.index(b"IDAT") + 4  # the first sample's compressed pixels
    data[at:at + 20] = bytes(range(20))
    shard.write_bytes(bytes(data))
    entry["xxh3_128"] = integrity.digest_file(shard)
    # The split's index records the shard's digest too, and the manifest the index's: a writer that wrote bad
    # bytes wrote both of those for them.
    index_path = dataset_dir(manifest) / "train" / integrity.INDEX
    index = json.loads(index_path.read_text())
    for shard_entry in index["shards"]:
        if shard_entry["raw_data"]["basename"] == entry["basename"]:
            shard_entry["raw_data"]["bytes"] = len(data)
            shard_entry["raw_data"]["hashes"] = {integrity.ALGORITHM: entry["xxh3_128"]}
    index_path.write_text(json.dumps(index, sort_keys=True))
    manifest["indexes"]["train"] = integrity.file_entry(index_path.read_bytes(), integrity.INDEX)
    (dataset_dir(manifest) / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "skipped"}))
    return manifest, entry


def _assert_names_the_sample(message: str, manifest, entry) -> None:
    assert (f"dataset t version {manifest['version']}, split train, shard {entry['basename']}, sample 0, "
            f"column 'image': value of ") in message
    assert "is not a decodable image" in message


def test_training_fails_on_a_corrupted_record_naming_split_shard_and_sample(damaged_record, tmp_path):
    manifest, entry = damaged_record
    loader = TrainingData.open([manifest["uri"]], tmp_path / "cache").loader(
        "train", batch_size=8, shuffle=False, seed=0, transform=lambda columns: columns)
    with pytest.raises(DataError) as raised:
        next(iter(loader))
    _assert_names_the_sample(str(raised.value), manifest, entry)


def test_registration_and_evaluation_fail_on_it_the_same_way(damaged_record, tmp_path):
    """Both read whole splits (the model's input example is the test split's first images)."""
    manifest, entry = damaged_record
    with pytest.raises(DataError) as raised:
        TrainingData.open([manifest["uri"]], tmp_path / "cache").read_split("train")
    _assert_names_the_sample(str(raised.value), manifest, entry)


def test_serving_refuses_bad_images_and_bombs_with_the_row():
    from pipeline.recipes.image_classifier.serving import ImageClassifier

    model = ImageClassifier()
    model.labels = {"channels": 1, "height": 8, "width": 8, "names": ["a", "b"]}
    with pytest.raises(ValueError, match="row 2: the image bytes do not decode as PNG/JPEG"):
        model._pixels(png_bad_filter(), 2)
    with pytest.raises(ValueError, match="row 3: .*decompression bomb"):
        model._pixels(png_bomb(), 3)
    with pytest.raises(ValueError, match="row 4: the image claims 9000 x 9000 pixels"):
        model._pixels(png_bomb(9_000), 4)

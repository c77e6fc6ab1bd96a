"""The batch path of TrainingData.loader: the same batches (values, order) as the per-sample path for rows,
array images and PNG/JPEG images, over one version or a window of several; exact mid-epoch resume;
read_split and encode_columns against their per-sample counterparts."""

import io

import numpy as np
import pytest

from pipeline.data.demo import write_idx
from pipeline.data.prepare.version import prepare
from pipeline.data.read import shards
from pipeline.data.read.shards import _images, decode_columns
from pipeline.data.read.training_data import TrainingData
from tests.datafiles import (
    as_columns,
    assert_same_batches,
    both_paths,
    cfg,
    check_mid_epoch_resume,
    numbered_rows,
    streaming_dataset,
    table,
    write_image_folder,
    write_parquet,
)


@pytest.fixture(scope="module")
def tabular(tmp_path_factory) -> dict:
    return numbered_rows(tmp_path_factory.mktemp("tabular"))


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
def test_rows_come_in_the_batches_of_the_per_sample_path(tabular, tmp_path, shuffle):
    data = TrainingData.open([tabular["uri"]], tmp_path / "cache")
    fast, slow = both_paths(data, tmp_path, batch_size=32, shuffle=shuffle, seed=3)
    assert_same_batches(fast, slow)
    assert sum(len(b["id"]) for b in fast) == tabular["splits"]["train"]
    assert len(data.loader("train", batch_size=32, shuffle=True, seed=3, transform=as_columns)) == len(fast)
    assert {b["a"].dtype for b in fast} == {np.dtype("float64")} and {b["b"].dtype for b in fast} == {np.dtype("int64")}
    assert isinstance(fast[0]["color"][0], str) and fast[0]["color"].dtype == object


def test_a_window_of_versions_reads_as_the_per_sample_path_does(tmp_path):
    for i, day in enumerate(["2026-11-28", "2026-11-29"]):
        write_parquet(tmp_path / "in" / f"dt={day}" / "part-0.parquet", table(300, seed=i))
    uris = [prepare(cfg(tmp_path / "in"), name="daily", out_root=tmp_path / "out",
                         interval=(f"{day}T00:00:00+00:00", f"{day}T23:59:59+00:00"))["uri"]
            for day in ["2026-11-28", "2026-11-29"]]
    data = TrainingData.open(uris, tmp_path / "cache")
    fast, slow = both_paths(data, tmp_path, batch_size=24, shuffle=True, seed=0)
    assert_same_batches(fast, slow)
    assert sum(len(b["a"]) for b in fast) == data.rows("train")


def test_array_images_come_as_one_uint8_array(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (400, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "idx", "train", images, rng.integers(0, 10, 400))
    manifest = prepare(cfg(tmp_path / "idx", unit_bytes=64 * 785, shard_size_limit_bytes=1 << 14),
                            name="idx", out_root=tmp_path / "out")
    data = TrainingData.open([manifest["uri"]], tmp_path / "cache")
    fast, slow = both_paths(data, tmp_path, batch_size=20, shuffle=True, seed=0)
    assert_same_batches(fast, slow)
    assert fast[0]["image"].shape == (20, 28, 28) and fast[0]["image"].dtype == np.uint8
    # Every image exactly once over the epoch (images are unique).
    seen = [img.tobytes() for b in fast for img in b["image"]]
    assert len(seen) == len(set(seen)) == manifest["splits"]["train"]
    assert set(seen) <= {img.tobytes() for img in images}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_encoded_images_decode_as_pil_does(tmp_path, fmt):
    write_image_folder(tmp_path / "in", {"boot": 40, "shirt": 35}, fmt=fmt)
    manifest = prepare(cfg(tmp_path / "in"), name="img", out_root=tmp_path / "out")
    data = TrainingData.open([manifest["uri"]], tmp_path / "cache")
    fast, slow = both_paths(data, tmp_path, batch_size=16, shuffle=True, seed=0)
    assert_same_batches(fast, slow)
    assert fast[0]["image"].shape == (16, 8, 8) and fast[0]["image"].dtype == np.uint8
    assert fast[0]["label"].dtype == object and set(np.concatenate([b["label"] for b in fast])) == {"boot", "shirt"}


def test_pngs_of_every_kind_decode_as_pil_does():
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (6, 5, 4), dtype=np.uint8)
    gray = Image.fromarray(pixels[..., 0])
    images = [gray, Image.fromarray(pixels[..., :3]), Image.fromarray(pixels), Image.fromarray(pixels).convert("LA"),
              Image.fromarray(pixels[..., :3]).convert("P"),  # palette: indices, not colors
              gray.convert("1"),  # 1 bit
              Image.fromarray(pixels[..., 0].astype(np.uint16) * 200)]  # 16 bits
    assert [i.mode for i in images] == ["L", "RGB", "RGBA", "LA", "P", "1", "I;16"]
    transparent = Image.fromarray(pixels[..., 0])
    transparent.info["transparency"] = 7  # a tRNS chunk
    images.append(transparent)
    blobs = []
    for image in images:
        out = io.BytesIO()
        image.save(out, format="PNG", transparency=image.info["transparency"]) if "transparency" in image.info \
            else image.save(out, format="PNG")
        blobs.append(out.getvalue())
    flat = np.frombuffer(b"".join(blobs), np.uint8).copy()
    starts = np.cumsum([0] + [len(b) for b in blobs])[:-1].tolist()
    decoded = _images(flat, starts, [len(b) for b in blobs])
    for i, blob in enumerate(blobs):
        want = np.asarray(Image.open(io.BytesIO(blob)))
        assert decoded[i].dtype == want.dtype and np.array_equal(decoded[i], want), images[i].mode


def test_mid_epoch_resume_delivers_exactly_the_remaining_samples(tabular, tmp_path):
    check_mid_epoch_resume(tabular, tmp_path, num_workers=0)  # with workers: tests/integration/


def test_read_split_and_encode_columns_match_the_per_sample_path(tabular, tmp_path):
    data = TrainingData.open([tabular["uri"]], tmp_path / "cache")
    columns = data.read_split("val")
    dataset = streaming_dataset(data, tmp_path / "reference", "val")
    samples = [dataset[i] for i in range(dataset.num_samples)]
    want = decode_columns(samples, data.schema["columns"])
    assert list(columns) == data.schema["columns"]
    assert_same_batches([columns], [want])
    for got, expected in zip(data.encoder.encode_columns(columns), data.encoder.encode(samples)):
        assert got.dtype == expected.dtype and np.array_equal(got, expected)


@pytest.mark.parametrize("binary", [False, True])
def test_text_codes_are_the_same_from_pyarrows_encoder_and_from_the_dict(binary):
    """Small columns are encoded without importing pyarrow.compute, large ones with it: the same codes either way
    (values that differ only by a trailing NUL, or by case, stay distinct)."""
    import pyarrow as pa

    values = ["b", "a", "", "b", "a\x00", "é", "A", "", "a"] * 3
    array = pa.array([v.encode() for v in values] if binary else values, pa.large_binary() if binary else None)
    by_dict, by_pyarrow = shards._dict_encode(array.to_pylist()), shards._pyarrow_encode(array)
    for codes, distinct in (by_dict, by_pyarrow):
        assert codes.dtype == np.int32 and [distinct[c] for c in codes] == array.to_pylist()
    assert np.array_equal(by_dict[0], by_pyarrow[0]) and by_dict[1] == by_pyarrow[1]


def test_read_ahead_reads_on_its_own_thread_up_to_its_depth_and_keeps_the_order():
    import threading

    from pipeline.data.read.ahead import ReadAhead

    asked = [0]  # the consumer's next() calls begun
    pulled: list[tuple[int, int, str]] = []  # (item, next() calls begun when the source gave it, thread)
    took = threading.Condition()

    def source():
        for i in range(10):
            with took:
                pulled.append((i, asked[0], threading.current_thread().name))
                took.notify_all()
            yield i

    ahead, got = ReadAhead(source(), 2), []
    for n in range(10):
        # Before each next(): the thread has taken what there is room for (two queued, a third in hand).
        with took:
            assert took.wait_for(lambda: len(pulled) >= min(10, n + 3), timeout=30), pulled
        asked[0] += 1
        got.append(next(ahead))
    assert list(ahead) == [] and got == list(range(10))
    # Item i was taken only once the consumer's next() for item i - 3 made room: never more than 2 + 1 ahead.
    assert [calls for _, calls, _ in pulled] == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert {name for _, _, name in pulled} == {"read-ahead"}


def test_read_ahead_raises_the_sources_error_at_its_item():
    from pipeline.data.read.ahead import ReadAhead

    def source():
        yield from range(3)
        raise ValueError("shard 7: bad column")

    ahead, got = ReadAhead(source(), 2), []
    with pytest.raises(ValueError, match="shard 7"):
        for item in ahead:
            got.append(item)
    assert got == [0, 1, 2]


def test_a_dropped_read_ahead_stops_and_closes_its_source_on_its_thread():
    import threading

    from pipeline.data.read.ahead import ReadAhead

    closed: list[str] = []
    closing = threading.Event()

    def source():
        try:
            yield from range(1_000_000)
        finally:
            closed.append(threading.current_thread().name)
            closing.set()

    def readers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "read-ahead"}

    before = readers()
    ahead = ReadAhead(source(), 2)
    assert next(ahead) == 0
    started = readers() - before
    del ahead  # a preempted rank drops its batches mid-epoch
    assert closing.wait(30) and closed == ["read-ahead"]  # the source closed on the read-ahead thread
    for thread in started:
        thread.join(30)
    assert not any(thread.is_alive() for thread in started)  # and the thread ended


def test_the_loaders_transform_runs_ahead_of_the_caller(tabular, tmp_path):
    """Batches are read and transformed on the read-ahead thread; a checkpoint still counts only what the
    caller took (test_mid_epoch_resume_delivers_exactly_the_remaining_samples)."""
    import threading

    threads: set[str] = set()
    transformed = threading.Event()

    def transform(columns):
        threads.add(threading.current_thread().name)
        transformed.set()
        return columns

    data = TrainingData.open([tabular["uri"]], tmp_path / "cache")
    batches = iter(data.loader("train", batch_size=32, shuffle=True, seed=3, transform=transform))
    assert transformed.wait(30), "no batch transformed before the first next()"
    assert threads == {"read-ahead"}
    assert sum(len(b["id"]) for b in batches) == tabular["splits"]["train"]
    assert threads == {"read-ahead"}


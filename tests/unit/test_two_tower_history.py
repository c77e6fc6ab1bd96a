"""The two-tower user history (``model.history_length``): a row's history is its user's last items strictly
before the row's time, in the batches, in the evaluation's input rows and in the registered model, which reads
it as a ``history`` column of recent item ids."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.recipes import get_recipe
from pipeline.recipes.two_tower import train as hooks
from pipeline.recipes.two_tower.synthetic import write_interactions

LENGTH = 3


@pytest.fixture(scope="module")
def version(tmp_path_factory):
    folder = tmp_path_factory.mktemp("history")
    path = write_interactions(folder / "interactions.parquet", users=40, items=30, clusters=4, per_user=8)
    cfg = get_recipe("two_tower").config("tiny").with_overrides({"data.input_path": str(path),
                                                                 "model.history_length": LENGTH})
    manifest = prepare(cfg.data, name="history", out_root=folder / "out")
    return cfg, pd.read_parquet(path), TrainingData.open([manifest["uri"]], folder / "cache")


def _expected(raw: pd.DataFrame, train: pd.DataFrame, user: str, time: float) -> list[str]:
    """By brute force: the user's training items strictly before ``time``, the last LENGTH, oldest first."""
    earlier = train[(train.user_id == user) & (train.timestamp < time)].sort_values("timestamp", kind="stable")
    return earlier.item_id.tolist()[-LENGTH:]


def test_a_rows_history_is_its_users_last_items_before_it(version):
    cfg, raw, data = version
    columns = data.read_split("train")
    train = pd.DataFrame({c: np.asarray(columns[c]) for c in ("user_id", "item_id", "timestamp")})
    vocab = np.asarray(data.preprocessing["vocab"]["item_id"], dtype=object)
    transform = hooks.ToTensors(cfg, data.preprocessing, hooks.item_log_q(cfg, data), hooks.History(cfg, data))
    test = data.read_split("test")
    batch = transform(test)
    assert batch["history"].shape == (len(test["user_id"]), LENGTH)
    for row, (user, time) in enumerate(zip(test["user_id"], test["timestamp"])):
        codes = batch["history"][row].numpy()
        assert vocab[codes[codes != 0]].tolist() == _expected(raw, train, str(user), float(time))
    assert (batch["history"] != 0).any()  # held-out rows come after their users' training rows
    assert len(transform.history.items_of(0)) == 0  # the unknown user has no history

    frame, held = hooks.evaluation_inputs(cfg, data, "test")
    first = {str(u): float(t) for u, t in reversed(list(zip(test["user_id"], test["timestamp"])))}
    assert [list(h) for h in frame["history"]] == [_expected(raw, train, u, first[u]) for u in frame["user_id"]]


def test_the_registered_model_reads_the_history_column(version, tmp_path):
    from pipeline.recipes.two_tower.serving import TwoTowerRetriever

    cfg, _, data = version
    torch.manual_seed(0)
    model = hooks.build_model(cfg, data)
    files = hooks.export(cfg, model, data, tmp_path, hooks.catalogue(cfg, data))
    retriever = TwoTowerRetriever()
    retriever.load_context(SimpleNamespace(artifacts=files))
    frame, _ = hooks.evaluation_inputs(cfg, data, "test", limit=2)
    answer = retriever.predict(None, frame, params={"k": 5})
    assert [len(items) for items in answer["item_ids"]] == [5, 5]
    # Another history, another ranking: the tower reads it (unknown ids are skipped).
    other = frame.assign(history=[["no-such-item"], list(data.preprocessing["vocab"]["item_id"][1:4])])
    assert retriever.predict(None, other)["scores"].tolist() != retriever.predict(None, frame)["scores"].tolist()
    with pytest.raises(ValueError, match=r"missing column\(s\) \['history'\]"):
        retriever.predict(None, frame.drop(columns=["history"]))

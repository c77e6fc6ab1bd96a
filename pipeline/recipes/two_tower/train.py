"""The two-tower recipe's heavy half: the Lightning body every rank runs under the pipeline's torchrun
launcher, the catalogue's item embeddings, packaging, and the held-out interactions evaluation scores.

Lightning does not start processes here: ``Trainer(strategy="ddp", devices=LOCAL_WORLD_SIZE,
num_nodes=...)`` joins the process group the place's torchrun set up, and reads the data through the
pipeline's resumable StreamingDataset loaders (its own distributed sampler off). The run context
reaches it as one callback (``pipeline.train.callbacks.lightning_callback``) and the checkpoint plugin it
carries: heartbeats for the stall watchdog, progress lines, metrics to MLflow, and checkpoints in the job's
store, which a restarted rank or an Airflow retry resumes from, mid-epoch included.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl  # here, not in run(): imported before the job's first heartbeat
import torch

from pipeline.data.read.training_data import Encoder, TrainingData
from pipeline.data.versions.stats import UNKNOWN
from pipeline.errors import ConfigError
from pipeline.evaluate.retrieval import EVALUATOR, KS, HeldOut
from pipeline.recipes.two_tower.model import Tower, TwoTower, in_batch_softmax_loss
from pipeline.train.export import NETWORK_FILE, export_network, saved_model_files
from pipeline.registry.package import ModelPackage
from pipeline.results import TrainedModel
from pipeline.train.spec import TrainSpec

SERVING = Path(__file__).with_name("serving.py")
CATALOGUE_FILE = "catalogue.npz"  # item ids and their embeddings
USERS_FILE = "users.json"  # what the user tower reads: columns, vocabularies
HISTORY_COLUMN = "history"  # with model.history_length: the input rows' recent item ids, oldest first


class Layout:
    """Where each tower's inputs are among the dataset's encoded columns (``Encoder``'s ``cat``/``num``)."""

    def __init__(self, cfg, preprocessing: dict[str, Any]):
        m = cfg.model
        categorical, numeric = preprocessing["categorical_columns"], preprocessing["numeric_columns"]
        for field_name, column in (("model.user_id_column", m.user_id_column), ("model.item_id_column", m.item_id_column)):
            if column not in categorical:
                raise ConfigError(f"{field_name}={column!r} is not a categorical column of the dataset "
                                  f"(categorical: {categorical}); list it in data.categorical_columns")
        for field_name, columns in (("model.user_features", m.user_features), ("model.item_features", m.item_features)):
            unknown = [c for c in columns if c not in categorical and c not in numeric]
            if unknown:
                raise ConfigError(f"{field_name}: {unknown} are not feature columns of the dataset; its categorical "
                                  f"columns are {categorical} and numeric ones {numeric}")
        self.user_id, self.item_id = categorical.index(m.user_id_column), categorical.index(m.item_id_column)
        self.user_cat = [categorical.index(c) for c in m.user_features if c in categorical]
        self.user_num = [numeric.index(c) for c in m.user_features if c in numeric]
        self.item_cat = [categorical.index(c) for c in m.item_features if c in categorical]
        self.item_num = [numeric.index(c) for c in m.item_features if c in numeric]


def item_log_q(cfg, data: TrainingData) -> np.ndarray:
    """log of each item's share of the training interactions, by the item vocabulary's codes (the
    frequency with which in-batch sampling draws it); unseen codes get the rarest item's."""
    column = cfg.model.item_id_column
    counts = data.stats.categories[column]
    vocab = data.preprocessing["vocab"][column]
    freq = np.array([counts.get(v, 0) for v in vocab], dtype=np.float64)
    freq[freq == 0] = freq[freq > 0].min() if (freq > 0).any() else 1.0
    return np.log(freq / freq.sum()).astype(np.float32)


class History:
    """Each user's training items in time order (``data.time_column``; the split's order without one), by
    vocabulary codes: a row's history is its user's last ``model.history_length`` items strictly before the row's
    time, oldest first, 0-padded in front; ``items_of`` is all of them (what evaluation leaves out of the user's
    ranking). The unknown user (code 0) has none. Built from the training split (picklable: loader workers)."""

    def __init__(self, cfg, data: TrainingData):
        m, time_column = cfg.model, cfg.data.time_column
        if m.history_length and not time_column:
            raise ConfigError(f"model.history_length={m.history_length}: a user's items are ordered by "
                              f"data.time_column, which is empty; name the column of the interactions' times")
        self.time_column, self.length = time_column, m.history_length
        columns = data.read_split("train")
        lay = Layout(cfg, data.preprocessing)
        _, cat, _ = Encoder(data.preprocessing, "").encode_columns(columns)
        users = cat[:, lay.user_id]
        times = np.asarray(columns[time_column], dtype=np.float64) if time_column else np.zeros(len(users))
        order = np.lexsort((times, users))  # stable: equal times keep the split's order
        self.users, self.times, self.items = users[order], times[order], cat[order, lay.item_id]
        codes = np.arange(len(data.preprocessing["vocab"][m.user_id_column]))
        self.start, self.end = np.searchsorted(self.users, codes, "left"), np.searchsorted(self.users, codes, "right")
        self.end[0] = self.start[0]  # rows without a user id are nobody's history

    def items_of(self, user: int) -> np.ndarray:
        """Every training item code of the user with code ``user``, oldest first."""
        return self.items[self.start[user]:self.end[user]]

    def __call__(self, users: np.ndarray, times: np.ndarray) -> np.ndarray:
        """[B, history_length] item codes of each (user code, time)."""
        out = np.zeros((len(users), self.length), dtype=np.int64)
        for row, (user, time) in enumerate(zip(users.tolist(), np.asarray(times, dtype=np.float64).tolist())):
            start, end = self.start[user], self.end[user]
            stop = start + int(np.searchsorted(self.times[start:end], time, "left"))
            recent = self.items[max(start, stop - self.length):stop]
            out[row, self.length - len(recent):] = recent
        return out


class ToTensors:
    """Decoded columns -> the towers' inputs and each row's item log-frequency (picklable: loader workers)."""

    def __init__(self, cfg, preprocessing: dict[str, Any], log_q: np.ndarray, history: History | None = None):
        self.encoder = Encoder(preprocessing, "")
        self.layout = Layout(cfg, preprocessing)
        self.log_q = log_q
        self.history = history

    def __call__(self, columns: dict[str, Any]) -> dict[str, torch.Tensor]:
        num, cat, _ = self.encoder.encode_columns(columns)
        lay = self.layout
        items = cat[:, lay.item_id]
        batch = {"user": torch.from_numpy(cat[:, lay.user_id].copy()),
                 "user_cat": torch.from_numpy(cat[:, lay.user_cat]), "user_num": torch.from_numpy(num[:, lay.user_num]),
                 "item": torch.from_numpy(items.copy()), "item_cat": torch.from_numpy(cat[:, lay.item_cat]),
                 "item_num": torch.from_numpy(num[:, lay.item_num]), "log_q": torch.from_numpy(self.log_q[items])}
        if self.history is not None:
            batch["history"] = torch.from_numpy(self.history(cat[:, lay.user_id], columns[self.history.time_column]))
        return batch


def build_model(cfg, data: TrainingData) -> TwoTower:
    m, prep = cfg.model, data.preprocessing
    lay = Layout(cfg, prep)
    categorical, vocab = prep["categorical_columns"], prep["vocab"]

    def tower(id_code: int, cat: list[int], num: list[int], widths: list[int], history_items: int = 0) -> Tower:
        return Tower(ids=len(vocab[categorical[id_code]]), vocab_sizes=[len(vocab[categorical[j]]) for j in cat],
                     numeric=len(num), mean=[prep["mean"][j] for j in num], std=[prep["std"][j] for j in num],
                     id_dim=m.id_embedding_dim, feature_dim=m.feature_embedding_dim, widths=widths,
                     out_dim=m.embedding_dim, history_items=history_items)

    items = len(vocab[m.item_id_column]) if m.history_length else 0
    return TwoTower(tower(lay.user_id, lay.user_cat, lay.user_num, m.user_tower, items),
                    tower(lay.item_id, lay.item_cat, lay.item_num, m.item_tower))


def lightning_module(cfg, model: TwoTower):
    class TwoTowerModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def _loss(self, batch) -> torch.Tensor:
            users, items = self.model(batch)
            log_q = batch["log_q"] if cfg.model.logq_correction else None
            return in_batch_softmax_loss(users, items, batch["item"], log_q, cfg.model.temperature) / len(batch["item"])

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(batch["item"]))
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True, batch_size=len(batch["item"]))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)

    return TwoTowerModule()


def run(cfg, ctx, data: TrainingData) -> dict[str, Any]:
    """Every rank: fit with Lightning's DDP inside the process group torchrun set up; rank 0 exports."""
    from pipeline.train.callbacks import last_lightning_checkpoint, lightning_callback, scalar_metrics

    _quiet_lightning()
    tc = cfg.train
    torch.manual_seed(tc.seed)  # the same initial weights on every rank
    model = build_model(cfg, data)
    transform = ToTensors(cfg, data.preprocessing, item_log_q(cfg, data),
                          History(cfg, data) if cfg.model.history_length else None)
    train_loader = data.loader("train", batch_size=tc.batch_size, shuffle=True, seed=tc.seed,
                               num_workers=tc.num_workers, transform=transform)
    val_loader = (data.loader("val", batch_size=tc.batch_size, shuffle=False, seed=tc.seed,
                              num_workers=tc.num_workers, transform=transform) if data.rows("val") else None)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    callback = lightning_callback(ctx, every_steps=tc.checkpoint_every_steps, log_every_steps=tc.log_every_steps)
    trainer = pl.Trainer(
        accelerator="gpu" if ctx.dist.device.type == "cuda" else "cpu", devices=devices,
        num_nodes=max(1, ctx.dist.world_size // devices), strategy="ddp" if ctx.dist.enabled else "auto",
        max_epochs=tc.epochs, use_distributed_sampler=False, callbacks=[callback], plugins=[callback.checkpoint_io],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(ctx.out_dir),
    )
    torch.manual_seed(tc.seed + ctx.dist.rank)
    trainer.fit(lightning_module(cfg, model), train_dataloaders=train_loader, val_dataloaders=val_loader,
                ckpt_path=last_lightning_checkpoint(ctx))
    metrics = scalar_metrics(trainer)
    result = {"metrics": metrics, "steps": trainer.global_step, **callback.summary()}
    items = catalogue(cfg, data)  # on every rank: opening a split is collective
    if ctx.is_main:
        result["model_files"] = saved_model_files(ctx.out_dir, model,
                                                  lambda folder: export(cfg, model, data, folder, items))
    return result


def _quiet_lightning() -> None:
    """Keep Lightning's advertisements and warnings that do not apply here out of the task log: the
    loaders are StreamingDataset's (their length is right per rank), and the logging is the run context's."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(
        lambda record: not str(record.msg).startswith("💡"))


def catalogue(cfg, data: TrainingData) -> dict[str, Any]:
    """Every item of the training vocabulary with its features: from its newest training row."""
    m = cfg.model
    columns = data.read_split("train")
    encoder, lay = Encoder(data.preprocessing, ""), Layout(cfg, data.preprocessing)
    num, cat, _ = encoder.encode_columns(columns)
    codes = cat[:, lay.item_id]
    newest = np.zeros(len(data.preprocessing["vocab"][m.item_id_column]), dtype=np.int64)
    newest[codes] = np.arange(len(codes))  # the last row of each item wins
    keep = np.unique(codes[codes != 0])  # code 0 is the unknown item: never recommended
    rows = newest[keep]
    return {"ids": np.asarray(data.preprocessing["vocab"][m.item_id_column], dtype=object)[keep].astype(str),
            "item": torch.from_numpy(keep), "item_cat": torch.from_numpy(cat[rows][:, lay.item_cat]),
            "item_num": torch.from_numpy(num[rows][:, lay.item_num])}


@torch.no_grad()
def export(cfg, model: TwoTower, data: TrainingData, out_dir: Path, items: dict[str, Any]) -> dict[str, str]:
    """The user tower as a ``torch.export`` program, the ``catalogue``'s embeddings, and the user columns."""
    out_dir = Path(out_dir)
    model = model.cpu().eval()
    embeddings = torch.cat([model.item(items["item"][i:i + 4096], items["item_cat"][i:i + 4096],
                                       items["item_num"][i:i + 4096]) for i in range(0, len(items["item"]), 4096)])
    np.savez(out_dir / CATALOGUE_FILE, ids=items["ids"], embeddings=embeddings.numpy().astype(np.float32))
    m, prep = cfg.model, data.preprocessing
    lay = Layout(cfg, prep)
    example = (torch.zeros(2, dtype=torch.long), torch.zeros(2, len(lay.user_cat), dtype=torch.long),
               torch.zeros(2, len(lay.user_num)))
    if m.history_length:
        example += (torch.zeros(2, m.history_length, dtype=torch.long),)
    export_network(model.user, example, out_dir / NETWORK_FILE)
    user_cat = [prep["categorical_columns"][j] for j in lay.user_cat]
    (out_dir / USERS_FILE).write_text(json.dumps({
        "id_column": m.user_id_column, "categorical_columns": user_cat,
        "numeric_columns": [prep["numeric_columns"][j] for j in lay.user_num],
        "vocab": {c: prep["vocab"][c] for c in [m.user_id_column, *user_cat]}, "top_k": m.top_k,
        "history_length": m.history_length,
        "history_vocab": prep["vocab"][m.item_id_column] if m.history_length else [],
    }, indent=2))
    return {"network": str(out_dir / NETWORK_FILE), "catalogue": str(out_dir / CATALOGUE_FILE),
            "users": str(out_dir / USERS_FILE)}


def package(cfg, trained: TrainedModel, data: TrainingData) -> ModelPackage:
    inputs, _ = evaluation_inputs(cfg, data, "test", limit=3)
    # (rows, params): the signature declares the request's k, model.top_k unless a request says otherwise.
    return ModelPackage(python_model=str(SERVING), artifacts=dict(trained.model_files),
                        input_example=(inputs, {"k": cfg.model.top_k}))


def evaluation_inputs(cfg, data: TrainingData, split: str, limit: int | None = None):
    """The split's users as the rows the registered model takes (id and user features, from each
    user's first row of the split), and what they did: their held-out items, the items of their training rows
    (left out of the rankings with ``model.exclude_seen``), the training split's items by popularity (the
    baseline) and the catalogue's size."""
    import pandas as pd

    m = cfg.model
    columns = data.read_split(split)
    users = np.asarray(columns[m.user_id_column]).astype(str)
    items = np.asarray(columns[m.item_id_column]).astype(str)
    order = np.unique(users, return_index=True)[1]
    first = np.sort(order)[:limit]
    frame = pd.DataFrame({c: np.asarray(columns[c])[first] for c in [m.user_id_column, *m.user_features]})
    frame[m.user_id_column] = frame[m.user_id_column].astype(str)
    relevant: dict[str, set[str]] = {}
    for user, item in zip(users.tolist(), items.tolist()):
        relevant.setdefault(user, set()).add(item)
    vocab = data.preprocessing["vocab"]
    known_users, known_items = set(vocab[m.user_id_column][1:]), set(vocab[m.item_id_column][1:])
    seen = None
    if m.history_length or m.exclude_seen:  # from the users' training rows, read once
        index = History(cfg, data)
        item_vocab = np.asarray(vocab[m.item_id_column], dtype=object)
        _, cat, _ = Encoder(data.preprocessing, "").encode_columns(columns)
        codes = cat[first, Layout(cfg, data.preprocessing).user_id]
        if m.history_length:  # each user's items before their first held-out row, as a client would send them
            recent = index(codes, np.asarray(columns[cfg.data.time_column])[first])
            frame[HISTORY_COLUMN] = [item_vocab[row[row != 0]].astype(str).tolist() for row in recent]
        if m.exclude_seen:
            seen = [set(item_vocab[index.items_of(user)].astype(str).tolist()) for user in codes.tolist()]
    counts = data.stats.categories[m.item_id_column]
    held = HeldOut(
        relevant=[relevant[u] for u in frame[m.user_id_column]],
        popular=[item for item, _ in counts.most_common() if item not in ("", UNKNOWN)], seen=seen,
        catalogue_size=len(known_items), interactions=int(len(items)),
        oov_users=int(sum(u not in known_users for u in relevant)),
        oov_items=int(sum(i not in known_items for i in items.tolist())),
    )
    # The baseline's ranking as deep as the model's: what is left after the seen items is at least what it returns.
    held.popular = held.popular[:held.depth(max(m.top_k, max(KS)))]
    return frame, held


SPEC = TrainSpec(run=run, package=package, evaluation_inputs=evaluation_inputs, evaluator=EVALUATOR)

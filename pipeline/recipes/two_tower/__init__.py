"""Two-tower retrieval recipe: user and item towers (ID embeddings plus feature MLPs) trained with
in-batch sampled softmax and log-Q correction, by PyTorch Lightning's DDP under the pipeline's torchrun
launcher, on interactions (``user_id``, ``item_id``, ``timestamp``, optional user and item features)
split by time; evaluated by recall@10/@50 and NDCG@10 over the whole catalogue against a most-popular
baseline.

Light: no torch here; the towers are in ``model.py``, the Lightning body in ``train.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import EvaluateConfig, ModelConfig, PipelineConfig
from pipeline.config_fields import what_field, where_field
from pipeline.evaluate.directions import RETRIEVAL
from pipeline.recipes.base import Recipe

NAME = "two_tower"


@dataclass(kw_only=True)
class TwoTowerModelConfig(ModelConfig):
    user_id_column: str = what_field("user_id", "Column of user ids (declared categorical: each id is embedded).")
    item_id_column: str = what_field("item_id", "Column of item ids (declared categorical: each id is embedded).")
    user_features: list[str] = what_field(
        ["user_segment", "user_age"], "Columns describing the user (categorical or numeric) the user tower reads "
        "beside the id; a registered model's input rows carry the id and these.")
    item_features: list[str] = what_field(
        ["item_category", "item_price"], "Columns describing the item the item tower reads beside the id; "
        "an item's newest training row gives its features.")
    history_length: int = what_field(
        0, "The user tower also reads the user's last history_length items before the row's time (the mean of their "
        "embeddings; data.time_column orders them); 0: no history. A registered model's input rows then carry "
        "'history', the user's recent item ids, oldest first.", min=0, max=10_000)
    embedding_dim: int = what_field(32, "Size of the user and item embeddings that are compared.", min=2, max=4096)
    id_embedding_dim: int = what_field(32, "Size of the user-id and item-id embeddings.", min=1, max=4096)
    feature_embedding_dim: int = what_field(8, "Size of each categorical feature's embedding.", min=1, max=1024)
    user_tower: list[int] = what_field([64], "Hidden widths of the user tower's MLP.", min=1, max=65_536)
    item_tower: list[int] = what_field([64], "Hidden widths of the item tower's MLP.", min=1, max=65_536)
    temperature: float = what_field(0.05, "Softmax temperature of the cosine scores.", min=1e-4, max=10.0)
    logq_correction: bool = what_field(
        True, "Subtract log(item frequency) from in-batch logits: in-batch negatives are drawn by popularity, "
        "and without it popular items are over-penalized.")
    exclude_seen: bool = where_field(
        True, "Evaluation leaves the items of a user's training rows out of their ranking (and the baseline's), as a "
        "catalogue that shows a user only what they have not had yet would; false where users come back to items.")
    top_k: int = what_field(100, "Items the registered model returns per user unless the request's params "
                            "say k; evaluation reads recall@50 from it.", min=50, max=100_000)


@dataclass(kw_only=True)
class TwoTowerConfig(PipelineConfig):
    METRICS = RETRIEVAL
    RECIPE = NAME
    SHARDS = False  # its own loop (train.py run): whole towers on every rank
    model: TwoTowerModelConfig = field(default_factory=TwoTowerModelConfig)
    evaluate: EvaluateConfig = field(default_factory=lambda: EvaluateConfig(
        metric="recall_at_10", guardrails=["ndcg_at_10"]))


def _write_demo(path) -> None:
    from pipeline.data import packaged

    packaged.movielens_100k(path)  # from the recbole wheel on PyPI, at demo time: never committed


# The default variant reads MovieLens 100K (make demo, and the DAG's default input): each user's newest rating is
# the test split, the one before it validation; the user tower reads the user's last 10 films. ``tiny`` reads the
# tests' synthetic interactions (synthetic.py) and their columns.
RECIPE = Recipe(
    name=NAME,
    description="Two-tower retrieval (user and item towers, in-batch softmax with log-Q correction), "
                "PyTorch Lightning DDP under torchrun, recall@k and NDCG against a popularity baseline.",
    config_class=TwoTowerConfig,
    defaults={
        "data.label_column": "", "data.split_by": "last_per_group", "data.time_column": "timestamp",
        "data.group_column": "user_id",
        "data.categorical_columns": ["user_id", "item_id", "user_gender", "user_occupation", "item_genre"],
        "model.user_features": ["user_age", "user_gender", "user_occupation"],
        "model.item_features": ["item_genre", "item_year"], "model.history_length": 10,
        "train.epochs": 8, "train.batch_size": 256, "train.learning_rate": 3e-3, "train.weight_decay": 0.0,
        "train.log_every_steps": 50, "train.checkpoint_every_steps": 100,
    },
    variants={
        "demo": {},
        "tiny": {"data.categorical_columns": ["user_id", "item_id", "user_segment", "item_category"],
                 "model.user_features": ["user_segment", "user_age"],
                 "model.item_features": ["item_category", "item_price"], "model.history_length": 0, "train.epochs": 3, "train.batch_size": 64, "train.log_every_steps": 5,
                 "train.checkpoint_every_steps": 10, "model.user_tower": [32], "model.item_tower": [32],
                 "model.embedding_dim": 16, "model.id_embedding_dim": 16},
    },
    params={
        "input_path": "data.input_path",
        "embedding_dim": "model.embedding_dim",
        "user_tower": "model.user_tower",
        "item_tower": "model.item_tower",
        "temperature": "model.temperature",
        "logq_correction": "model.logq_correction",
    },
    train_spec="pipeline.recipes.two_tower.train:SPEC",
    demo_path="movielens-100k/interactions.parquet",
    write_demo=_write_demo,
    tags=("ddp", "lightning", "recommender"),
)

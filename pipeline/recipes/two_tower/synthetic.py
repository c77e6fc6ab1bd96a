"""Synthetic interactions with planted preferences, for the demo and the tests.

Users and items belong to clusters; a user mostly picks items of their own cluster, by popularity
(a Zipf skew), and sometimes any item by popularity. Features carry the clusters with noise: a user's
``user_segment`` is their cluster 80% of the time, an item's ``item_category`` 90%; ``user_age`` and
``item_price`` are numbers loosely tied to the cluster. Each user's interactions have increasing
``timestamp`` s (epoch seconds), so the newest ones can be held out. A model that learns the clusters
beats recommending the most popular items; one that does not, does not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def interactions(*, users: int = 3000, items: int = 600, clusters: int = 20, per_user: float = 20.0,
                 in_cluster: float = 0.8, zipf: float = 0.6, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    item_cluster = rng.integers(0, clusters, items)
    popularity = 1.0 / (rng.permutation(items) + 1.0) ** zipf  # a random item order of Zipf weights
    user_cluster = rng.integers(0, clusters, users)
    counts = 5 + rng.poisson(per_user - 5, users)
    rows = int(counts.sum())
    user = np.repeat(np.arange(users), counts)
    item = np.empty(rows, dtype=np.int64)
    global_p = popularity / popularity.sum()
    by_cluster = []
    for c in range(clusters):
        members = np.flatnonzero(item_cluster == c)
        by_cluster.append((members, popularity[members] / popularity[members].sum()))
    own = rng.random(rows) < in_cluster
    for c, (members, p) in enumerate(by_cluster):
        rows_c = np.flatnonzero(own & (user_cluster[user] == c))
        item[rows_c] = rng.choice(members, size=len(rows_c), p=p)
    rest = np.flatnonzero(~own)
    item[rest] = rng.choice(items, size=len(rest), p=global_p)

    start = 1_700_000_000 + rng.integers(0, 60 * 86_400, users)
    gaps = rng.exponential(3_600.0, rows).astype(np.int64) + 1
    first = np.r_[0, np.cumsum(counts)[:-1]]
    elapsed = np.cumsum(gaps)
    elapsed -= np.repeat(elapsed[first] - gaps[first], counts)  # per user, from their first interaction
    timestamp = start[user] + elapsed

    segment = np.where(rng.random(users) < 0.8, user_cluster, rng.integers(0, clusters, users))
    category = np.where(rng.random(items) < 0.9, item_cluster, rng.integers(0, clusters, items))
    age = np.round(20 + 3 * user_cluster + rng.normal(0, 6, users)).clip(16, 90)
    price = np.round(np.exp(2 + 0.15 * item_cluster + rng.normal(0, 0.3, items)), 2)
    return {
        "user_id": np.array([f"u{u:05d}" for u in user]),
        "item_id": np.array([f"i{i:04d}" for i in item]),
        "timestamp": timestamp.astype(np.int64),
        "user_segment": np.array([f"s{s}" for s in segment[user]]),
        "user_age": age[user].astype(np.float64),
        "item_category": np.array([f"c{c}" for c in category[item]]),
        "item_price": price[item],
    }


def write_interactions(path: str | Path, **kwargs) -> Path:
    """The interactions as one Parquet file at ``path`` (written whole, then renamed into place)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.table(interactions(**kwargs)), tmp, row_group_size=50_000)
    tmp.replace(path)
    return path

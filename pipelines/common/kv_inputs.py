"""The inputs CollectiveKV pools are fitted to: each cached token's normed layer input (the x
that K and V are projected from) for sampled users, collected by Ray Data ranker actors
(``train_kv_pool`` fits pools to them, ``analyze_kv`` measures their redundancy)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl

from artifacts import storage
from artifacts.data import user_sequences
from models.errors import InputError
from pipelines.common.ranker_actors import RankerActor, map_with_rankers


class KVInputs(RankerActor):
    """Ray Data callable class: per cached token of a batch of users, each layer's normed
    input (the x that K and V are projected from) and the token's user."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from models.batches import history_batch

        h = history_batch(list(batch["hist"]), list(batch["hist_fb"]), self.max_len)
        xs, valid = self.model.kv_inputs(h)
        users = np.repeat(batch["user_id"], valid.sum(1).numpy())
        out = {"user_id": users}
        for i, x in enumerate(xs):
            out[f"x{i}"] = x[valid].float().numpy()
        return out


def user_tokens(seqs: pl.DataFrame, max_len: int) -> np.ndarray:
    """Cached tokens per user of ``seqs``: the last ``max_len`` history items and the first
    token."""
    return seqs["hist"].list.len().clip(upper_bound=max_len).to_numpy() + 1


def sample_users(
    seqs: pl.DataFrame, rng: np.random.Generator, *, users: int, max_tokens: int, max_len: int
) -> pl.DataFrame:
    """``users`` random users, or with ``users`` 0 the fewest random users whose cached tokens
    (``user_tokens``) reach ``max_tokens``."""
    order = rng.permutation(seqs.height)
    if users:
        order = order[:users]
    else:
        tokens = user_tokens(seqs, max_len)[order]
        order = order[: int(np.searchsorted(np.cumsum(tokens), max_tokens)) + 1]
    return seqs[np.sort(order)]


def fitting_users(
    dataset_uri: str, checkpoint: str, min_history: int = 1
) -> tuple[pl.DataFrame, int]:
    """The users K and V can be collected from (``min_history``+ training history items) and
    the ranker's ``max_len``, the most history items a user caches."""
    seqs = user_sequences(dataset_uri).select("user_id", "hist", "hist_fb")
    seqs = seqs.filter(pl.col("hist").list.len() >= max(1, min_history))
    if seqs.height == 0:
        raise InputError(
            f"{dataset_uri}: no user has {max(1, min_history)}+ history items to collect K and "
            "V from"
        )
    max_len = int(json.loads(storage.read_file(checkpoint, "train.json"))["max_len"])
    return seqs, max_len


def cached_tokens(dataset_uri: str, checkpoint: str, *, users: int, seed: int) -> int:
    """How many cached tokens ``collect_kv_inputs`` can return with ``users`` (0: every user
    with a history, else that many seeded users - the same ones it samples)."""
    seqs, max_len = fitting_users(dataset_uri, checkpoint)
    if users:
        seqs = sample_users(
            seqs, np.random.default_rng(seed), users=users, max_tokens=0, max_len=max_len
        )
    return int(user_tokens(seqs, max_len).sum())


def collect_kv_inputs(
    checkpoint: str,
    dataset_uri: str,
    *,
    users: int,
    max_tokens: int,
    vectors_uri: str | None = None,
    min_history: int = 1,
    actors: int = 2,
    seed: int = 0,
) -> tuple[list[np.ndarray], np.ndarray]:
    """(per layer x (N, d_model), user id per row) for up to ``max_tokens`` cached tokens of
    seeded random users with ``min_history``+ history items (their training histories), via a
    Ray Data actor pool: ``users`` of them, or with ``users`` 0 as many as the tokens need."""

    seqs, max_len = fitting_users(dataset_uri, checkpoint, min_history)
    rng = np.random.default_rng(seed)
    seqs = sample_users(seqs, rng, users=users, max_tokens=max_tokens, max_len=max_len)
    res = map_with_rankers(
        seqs.to_arrow(), KVInputs, checkpoint, vectors_uri, actors=actors, batch_size=16
    )
    parts = list(res.iter_batches(batch_size=None, batch_format="numpy"))
    user = np.concatenate([p["user_id"] for p in parts])
    n_layers = sum(1 for k in parts[0] if k.startswith("x"))
    # Ray Data returns the batches in the order they finish: put the rows in user order (each
    # user's tokens stay in position order) so that one seed always fits the same pools
    order = np.argsort(user, kind="stable")
    user = user[order]
    xs = [np.concatenate([p[f"x{i}"] for p in parts])[order] for i in range(n_layers)]
    if len(user) > max_tokens:
        keep = np.sort(rng.choice(len(user), size=max_tokens, replace=False))
        user, xs = user[keep], [x[keep] for x in xs]
    return xs, user

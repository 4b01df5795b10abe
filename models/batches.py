"""Training and evaluation batches from per-user sequences (vids), in plain PyTorch/NumPy.

A user's training sequence is their split history (validation and test items are never
trained on). Each training batch takes, per user, a window of at most ``max_len + 1`` items
(half the time the latest ones - the history serving ranks after - otherwise ending at a random
point) and ``cuts`` cut points t in it: the model reads window[:t] and must pick window[t] (the
positive, candidate 0) among ``negatives`` items drawn from the catalog. All cut points of a
user share one prefill (``Ranker.forward(..., cut=...)``). ``next_vids`` holds every next item
of the window, for the full-catalog loss of the user token at every position.

Negatives are drawn uniformly from the catalog (or from a pool: the catalog without its
held-out items); training may then swap some of them for the items an item prior puts forward
after the cut (``pipelines.common.prior_offsets.prior_negatives``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.inputs import History


@dataclass(frozen=True)
class TrainBatch:
    history: History
    candidates: Tensor  # (B, C * (1 + K)) vids; per cut: positive first, then K negatives
    cut: Tensor  # (B, C * (1 + K)) history items visible to each candidate
    groups: int  # C: cut points per user; scores.view(B, C, 1 + K), label 0
    next_vids: Tensor  # (B, T): the item after the first t + 1 history items; -100 = padding
    teacher: Tensor | None = None  # (B, C * (1 + K)) a teacher's logits of the candidates
    folds: Tensor | None = None  # (B,) which out-of-fold prior scores each window (training
    # complementary to the item prior)


def _pad(rows: list[np.ndarray], fill: int) -> Tensor:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def history_batch(vids: list[np.ndarray], feedback: list[np.ndarray], max_len: int) -> History:
    """The most recent ``max_len`` items of each sequence, right-padded."""
    v = [np.asarray(x[-max_len:]) for x in vids]
    f = [np.asarray(x[-max_len:]) for x in feedback]
    return History(_pad(v, -1), _pad(f, -1), torch.tensor([len(x) for x in v], dtype=torch.long))


def sample_window(
    v: np.ndarray, f: np.ndarray, rng: np.random.Generator, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """A window of at most ``max_len + 1`` items of a sequence of >= 2: half the time the
    latest ones, otherwise ending at a random point."""
    n = len(v)
    if n < 2:
        raise ValueError("training sequences need at least 2 items")
    end = n if rng.random() < 0.5 else int(rng.integers(2, n + 1))
    start = max(0, end - max_len - 1)
    return np.asarray(v[start:end]), np.asarray(f[start:end])


def sample_candidates(
    window: np.ndarray,
    rng: np.random.Generator,
    *,
    n_items: int,
    cuts: int,
    negatives: int,
    pool: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``cuts`` cut points t in 1..len-1 (with replacement for short windows) and, per cut, the
    positive window[t] followed by ``negatives`` items drawn uniformly from the catalog, or
    from the vids in ``pool`` (a catalog without its held-out items).
    Returns (t (cuts,), candidates (cuts, 1 + negatives))."""
    t = rng.integers(1, len(window), size=cuts)
    if pool is None:
        neg = rng.integers(0, n_items, size=(cuts, negatives))
    else:
        neg = pool[rng.integers(0, len(pool), size=(cuts, negatives))]
    return t, np.concatenate([window[t][:, None], neg], axis=1)


def length_buckets(lengths: np.ndarray, batch_size: int, rng: np.random.Generator) -> list:
    """Row indices of a chunk of rows cut into batches of ``batch_size`` rows of similar
    lengths (sorted by length, ties in row order), the batches in a random order. A batch pads
    to its longest row: on histories of a few items with a long tail, batches of mixed lengths
    compute mostly padding."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def training_batch(
    vids: list[np.ndarray],
    feedback: list[np.ndarray],
    rng: np.random.Generator,
    *,
    n_items: int,
    max_len: int,
    cuts: int,
    negatives: int,
    windowed: bool = False,
    given: tuple[list[np.ndarray], list[np.ndarray]] | None = None,
    teacher: np.ndarray | None = None,
    pool: np.ndarray | None = None,
    folds: np.ndarray | None = None,
) -> TrainBatch:
    """Sample windows, cut points and negatives for a batch of users (sequences of >= 2 items).
    Negatives are uniform over the catalog. ``windowed``: the sequences are windows already
    (``sample_window``'s), used whole. ``given``: fixed
    (cut points (cuts,), candidates (cuts, 1 + negatives)) per sequence instead - the examples
    a teacher labelled; the sequences are then used whole, as the windows they were cut for;
    ``teacher``: the teacher's logits of those candidates, (B, cuts * (1 + negatives));
    ``pool``: the vids negatives are drawn from (default: the whole catalog); ``folds``: each
    sequence's prior fold (B,), passed through."""
    win_v, win_f, cand_rows, cut_rows, next_rows = [], [], [], [], []
    k = 1 + negatives
    for i, (v, f) in enumerate(zip(vids, feedback, strict=True)):
        if given is None:
            if windowed:
                wv, wf = np.asarray(v), np.asarray(f)
            else:
                wv, wf = sample_window(v, f, rng, max_len)
            t, cands = sample_candidates(
                wv, rng, n_items=n_items, cuts=cuts, negatives=negatives, pool=pool
            )
        else:
            wv, wf = np.asarray(v), np.asarray(f)
            t, cands = np.asarray(given[0][i]), np.asarray(given[1][i]).reshape(cuts, k)
            if len(wv) > max_len + 1 or t.min() < 1 or t.max() >= len(wv):
                raise ValueError(
                    f"labelled cut points {t.tolist()} do not fit a window of {len(wv)}"
                )
        cand_rows.append(cands.reshape(-1))
        cut_rows.append(np.repeat(t, k))
        # the last item is only ever a positive, never history: drop it from the prefill input
        win_v.append(wv[:-1])
        win_f.append(wf[:-1])
        next_rows.append(wv[1:])
    history = History(_pad(win_v, -1), _pad(win_f, -1), torch.tensor([len(x) for x in win_v]))
    return TrainBatch(
        history,
        torch.from_numpy(np.stack(cand_rows)),
        torch.from_numpy(np.stack(cut_rows)),
        cuts,
        _pad(next_rows, -100),
        None if teacher is None else torch.as_tensor(teacher, dtype=torch.float32),
        None if folds is None else torch.as_tensor(np.asarray(folds), dtype=torch.long),
    )

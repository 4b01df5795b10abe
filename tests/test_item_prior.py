"""The item-to-item prior (models.item_prior): the next-item and EASE fits, their sparse reading,
the fusion."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from models.item_prior import (
    FUSION_WEIGHTS,
    ItemPrior,
    PriorConfig,
    cooccurrence,
    ease_weights,
    fuse,
    next_item_grams,
    next_item_weights,
    sparsify,
)


def random_histories(n_users: int, n_items: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, n_items, (int(torch.randint(2, 20, (), generator=g)),), generator=g)
        for _ in range(n_users)
    ]


def test_cooccurrence_counts_each_user_item_pair_once():
    hists = [torch.tensor([0, 1, 1, 1]), torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)]
    g = cooccurrence(hists, 4)
    x = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=np.float32)
    np.testing.assert_array_equal(g.numpy(), x.T @ x)  # item 1 thrice in a history: once


def test_ease_weights_are_the_ridge_regression_of_each_item_on_all_others():
    hists = random_histories(300, 40)
    x = np.zeros((300, 40))
    for u, h in enumerate(hists):
        x[u, h.numpy()] = 1
    b = ease_weights(cooccurrence(hists, 40), l2=5.0).numpy()
    # column j: min ||x_j - X_{-j} w||^2 + 5 ||w||^2, item j itself excluded (zero diagonal)
    for j in range(40):
        others = [i for i in range(40) if i != j]
        a = x[:, others]
        w = np.linalg.solve(a.T @ a + 5.0 * np.eye(39), a.T @ x[:, j])
        np.testing.assert_allclose(b[others, j], w, atol=1e-5)
        assert b[j, j] == 0


def test_next_item_weights_are_the_ridge_regression_of_each_next_item_on_its_context():
    hists = random_histories(60, 25, seed=1) + [
        torch.tensor([3]),
        torch.tensor([], dtype=torch.long),
    ]
    recent, decay, l2 = 3, 0.5, 2.0
    s_rows, y_rows = [], []  # spelt out: one row per position t >= 1 of every history
    for h in hists:
        for t in range(1, len(h)):
            s, y = np.zeros(25), np.zeros(25)
            for k in range(1, min(recent, t) + 1):
                s[h[t - k]] += decay ** (k - 1)  # an item twice in the window adds up
            y[h[t]] = 1
            s_rows.append(s)
            y_rows.append(y)
    s, y = np.array(s_rows), np.array(y_rows)
    gram, cross = next_item_grams(hists, 25, recent, decay)
    np.testing.assert_allclose(gram.numpy(), s.T @ s, atol=1e-5)
    np.testing.assert_allclose(cross.numpy(), s.T @ y, atol=1e-5)
    want = np.linalg.solve(s.T @ s + l2 * np.eye(25), s.T @ y)
    np.testing.assert_allclose(next_item_weights(gram, cross, l2).numpy(), want, atol=1e-4)


def test_sparsify_keeps_each_rows_largest_weights():
    b = torch.tensor([[0.0, 0.5, -1.0, 0.2], [0.3, 0.0, 0.9, 0.1]])
    idx, w = sparsify(b, 2)
    assert idx.dtype == torch.int32 and idx.tolist() == [[1, 3], [2, 0]]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.2], [0.9, 0.3]]))
    assert sparsify(b, 10)[0].shape == (2, 4)  # never more than the catalog


def test_the_prior_sums_the_newest_items_rows_with_decaying_votes():
    # item i votes for its two neighbours: (i + 1) % 5 with weight 1, (i + 2) % 5 with 0.5
    index = torch.tensor([[(i + 1) % 5, (i + 2) % 5] for i in range(5)], dtype=torch.int32)
    weight = torch.tensor([[1.0, 0.5]] * 5)
    prior = ItemPrior(index, weight, PriorConfig(recent=2, decay=0.5))
    scores = prior.scores(
        [torch.tensor([4, 0, 1]), torch.tensor([3]), torch.tensor([], dtype=torch.long)]
    )
    # user 0: newest 1 (vote 1) -> 2: 1, 3: 0.5; then 0 (vote 0.5) -> 1: 0.5, 2: 0.25; 4 is too old
    assert scores[0].tolist() == pytest.approx([0, 0.5, 1.25, 0.5, 0])
    assert scores[1].tolist() == pytest.approx([0.5, 0, 0, 0, 1.0])
    assert scores[2].tolist() == [0.0] * 5  # no history: no prior
    # reading it with more recent items brings the older ones in
    assert prior.with_recency(3, 0.5).scores([torch.tensor([4, 0, 1])])[0, 0].item() == 0.25


def test_the_next_item_fit_knows_order_and_ease_only_what_sits_beside():
    # every user walks 0 -> 1 -> 2 -> 3 ... over a 30-item catalog, starting anywhere
    hists = [torch.arange(s, s + 6) % 30 for s in range(30) for _ in range(3)]
    cfg = PriorConfig(l2=1.0, neighbours=5, recent=2, decay=0.5)
    ease = ItemPrior.fit(hists, 30, replace(cfg, kind="ease", recent=1))
    assert set(ease.scores([torch.tensor([7])])[0].topk(2).indices.tolist()) == {6, 8}
    nxt = ItemPrior.fit(hists, 30, cfg)
    assert nxt.cfg.kind == "next"  # the default
    scores = nxt.scores([torch.tensor([6, 7])])[0]
    assert scores.argmax().item() == 8  # what follows 7
    assert scores[8] > 2 * scores[5]  # not what came before, as EASE has it


def test_the_fused_score_ranks_any_candidate_subset_as_the_whole_catalog():
    ranker, prior = torch.randn(4, 50), torch.rand(4, 50)
    assert FUSION_WEIGHTS[0] == 0 and list(FUSION_WEIGHTS) == sorted(FUSION_WEIGHTS)
    assert torch.equal(fuse(ranker, prior, 0.0), ranker)  # weight 0: the ranker itself
    # fused per item, no statistic of the catalog: a request's candidates keep their order
    whole = fuse(ranker, prior, 2.0)
    cands = torch.tensor([3, 41, 7, 19])
    assert torch.equal(fuse(ranker[:, cands], prior[:, cands], 2.0), whole[:, cands])
    # the largest weight ranks by the prior
    top = fuse(ranker, prior, FUSION_WEIGHTS[-1] * 1e3).argmax(dim=1)
    assert torch.equal(top, prior.argmax(dim=1))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"l2": 0}, "l2 must be positive"),
        ({"decay": 0}, r"decay must be in \(0, 1\]"),
        ({"recent": 0}, "at least 1"),
        ({"kind": "svd"}, "kind must be one of next, ease, got 'svd'"),
    ],
)
def test_a_prior_config_out_of_range_is_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        PriorConfig(**kw)

"""The item-to-item prior (models.item_prior): the next-item and EASE fits, their sparse reading,
the fusion."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from models.item_prior import (
    FUSION_WEIGHTS,
    NEIGHBOUR_TEMPERATURE,
    ItemPrior,
    PriorConfig,
    borrow_from_text_neighbours,
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


def test_an_item_without_interactions_borrows_its_text_neighbours_rows_and_columns():
    n = 8
    hists = [torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]), torch.tensor([3, 4, 0])]
    b = ease_weights(cooccurrence(hists, n), 1.0)  # items 5, 6, 7: in no history
    assert not b[:, 5:].any() and not b[5:, :].any()
    vectors = torch.zeros(n, 3)
    vectors[:5] = torch.tensor(
        [[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 1.0, 0], [0, 1.0, 1.0]]
    )
    vectors[5] = torch.tensor([1.0, 0.1, 0])  # nearest: item 0, then 3
    vectors[6] = torch.tensor([0, 0, 2.0])  # the same direction as item 2
    interacted = torch.zeros(n, dtype=torch.bool)
    interacted[:5] = True  # item 7 has no vector: it is left alone
    before = b.clone()
    out, borrowed = borrow_from_text_neighbours(b.clone(), interacted, vectors, k=2)
    assert borrowed == 2
    unit = torch.nn.functional.normalize(vectors, dim=1)
    for new in (5, 6):
        sims, near = (unit[new] @ unit[:5].T).topk(2)
        w = torch.softmax(sims / NEIGHBOUR_TEMPERATURE, dim=0)
        want_col = before[:5, near] @ w  # the votes it receives from interacted items
        torch.testing.assert_close(out[:5, new], want_col)
        want_row = w @ before[near, :5]  # the votes it casts for them
        torch.testing.assert_close(out[new, :5], want_row)
    torch.testing.assert_close(out[:5, :5], before[:5, :5])  # the interacted part unchanged
    assert not out[7].any() and not out[:, 7].any() and not out.diagonal().any()
    # read as a prior: a user who had item 2's voters now ranks item 6 where item 2 stood
    prior = ItemPrior(*sparsify(out, 7), PriorConfig(recent=3, kind="ease"))
    s = prior.scores([torch.tensor([1, 3])])[0]
    assert s[6] == pytest.approx(float(s[2]), rel=0.01) and s[6] != 0  # item 4 weighs 0.3%
    # a fit given the vectors borrows the same way
    fitted = ItemPrior.fit(hists, n, PriorConfig(l2=1.0, neighbours=7, kind="ease"), vectors, 2)
    torch.testing.assert_close(fitted.weight, sparsify(out, 7)[1])
    # k 0: unchanged
    assert torch.equal(
        borrow_from_text_neighbours(before.clone(), interacted, vectors, 0)[0], before
    )


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


def test_prefix_scores_read_each_prefix_as_the_prior_reads_a_history():
    """Training's offsets: the prior after every wanted prefix of a padded batch, each history
    read by its fold's prior, equal to ``ItemPrior.scores`` of that prefix alone."""
    from models.item_prior import StackedPriors

    n = 25
    cfg = PriorConfig(l2=5.0, neighbours=6, recent=4, decay=0.7)
    priors = [ItemPrior.fit(random_histories(30, n, seed=s), n, cfg) for s in range(3)]
    stacked = StackedPriors.of(priors)
    lengths = [12, 5, 2, 1]
    vids = torch.full((4, 12), -1)
    for b, length in enumerate(lengths):
        vids[b, :length] = torch.randint(0, n, (length,))
    rows = torch.arange(12)[None, :] < torch.tensor(lengths)[:, None] - 1
    folds = torch.tensor([2, 0, 1, 2])
    got = stacked.prefix_scores(vids, rows, folds)
    want = [
        priors[int(folds[b])].scores([vids[b, : p + 1]])[0]
        for b in range(4)
        for p in range(12)
        if rows[b, p]
    ]
    assert got.shape == (sum(lengths) - 4, n)  # a prefix before each next item
    torch.testing.assert_close(got, torch.stack(want), atol=1e-6, rtol=0)
    assert stacked.prior(1).scores([vids[0]]).equal(priors[1].scores([vids[0]]))


@pytest.mark.parametrize("weight", [0.0, 7.5])
def test_the_offset_path_scores_as_the_fusion_it_replaces(weight):
    """A ranker trained complementary to the prior: each training logit (a cut's candidates by
    MIS, the user token's catalog logits after every position) is the fused score evaluation
    and serving rank by, ``fuse(ranker, prior, weight)`` after the same history - at weight 0
    (a ranker without the prior: its own scores) and at its weight."""
    from models.batches import training_batch
    from models.item_prior import StackedPriors
    from models.metrics import dot_catalog_scores
    from models.ranker import History, Ranker
    from pipelines.common.prior_offsets import fused, prior_offsets
    from tests.test_ranker import N_ITEMS, tiny_config

    torch.manual_seed(0)
    model = Ranker(tiny_config(item_input="id", prior_weight=weight), n_items=N_ITEMS).eval()
    assert (model.prior_weight is None) == (weight == 0)
    if weight:
        assert model.prior_weight.item() == weight  # the learned gain starts at 1
        model.prior_gain.data.fill_(0.3)  # and moves in training
        weight = model.prior_weight.item()
    cfg = PriorConfig(l2=5.0, neighbours=8, recent=3, decay=0.8)
    folds = [ItemPrior.fit(random_histories(40, N_ITEMS, seed=s), N_ITEMS, cfg) for s in (1, 2)]
    priors = StackedPriors.of(folds)
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, N_ITEMS, size=n) for n in (9, 3, 6)]
    tb = training_batch(
        windows,
        [rng.integers(0, 5, size=len(w)) for w in windows],
        rng,
        n_items=N_ITEMS,
        max_len=20,
        cuts=2,
        negatives=4,
        windowed=True,
        folds=np.array([1, 0, 1]),
    )
    rows = tb.next_vids >= 0
    h = tb.history
    with torch.no_grad():
        out = model(h, tb.candidates, cut=tb.cut, catalog=rows)
        offsets = prior_offsets(priors, tb, h.vids, tb.next_vids, tb.candidates, tb.cut)
        got = fused(model, out, offsets, catalog=True)
    r = 0
    for b, w in enumerate(windows):
        prior = folds[int(tb.folds[b])]
        for p in range(len(w) - 1):  # the catalog after the first p + 1 items
            prefix = History.from_lists([w[: p + 1].tolist()], [[0] * (p + 1)])
            prefix = History(prefix.vids, h.feedback[b : b + 1, : p + 1], prefix.lengths)
            want = fuse(
                dot_catalog_scores(model, prefix),
                prior.scores([torch.as_tensor(w[: p + 1])]),
                weight,
            )
            torch.testing.assert_close(got.catalog[r], want[0], atol=1e-4, rtol=1e-5)
            r += 1
        for c in range(2):  # each cut's candidates, after the items before the cut
            t = int(tb.cut[b, c * 5])
            cands = tb.candidates[b, c * 5 : (c + 1) * 5]
            prefix = History(h.vids[b : b + 1, :t], h.feedback[b : b + 1, :t], torch.tensor([t]))
            with torch.no_grad():
                alone = model.score(model.prefill(prefix), cands[None])
            want = fuse(alone, prior.scores([torch.as_tensor(w[:t])])[:, cands], weight)
            torch.testing.assert_close(
                got.scores[b, c * 5 : (c + 1) * 5], want[0], atol=1e-4, rtol=1e-5
            )
    assert r == len(got.catalog)


def test_the_calibrated_weight_is_where_the_prior_alone_predicts_best():
    """Training's starting prior weight: the maximum of softmax(w x prior)'s mean
    log-likelihood of the targets, which is concave in w."""
    from pipelines.common.prior_offsets import calibrated_weight

    g = torch.Generator().manual_seed(0)
    scores = torch.rand(200, 50, generator=g) * 0.05
    targets = torch.multinomial(torch.softmax(scores * 80.0, 1), 1, generator=g)[:, 0]

    def loglik(w: float) -> float:
        return float(torch.log_softmax(scores * w, 1).gather(1, targets[:, None]).mean())

    w = calibrated_weight(scores, targets)
    assert 20 < w < 300  # the targets were drawn at 80
    assert loglik(w) >= max(loglik(w * 0.9), loglik(w / 0.9))
    assert calibrated_weight(scores[:0], targets[:0]) == 1.0  # nothing to calibrate on


def test_prior_negatives_are_the_priors_top_items_after_each_cut_never_the_windows_own():
    """Mined negatives: each cut's first ``m`` negatives are items the prior ranks in its top
    ``PRIOR_NEGATIVE_POOL`` after the history that cut shows, voted for (> 0), never an item of
    the window (a history or next item, so never a positive) nor a held-out one; the rest of a
    cut's candidates, and every positive, stay as sampled."""
    from models.batches import training_batch
    from models.item_prior import StackedPriors
    from pipelines.common.prior_offsets import PRIOR_NEGATIVE_POOL, prior_negatives

    n, k, m = 300, 6, 4
    cfg = PriorConfig(l2=5.0, neighbours=150, recent=3, decay=0.8)
    prior = ItemPrior.fit(random_histories(400, n, seed=3), n, cfg)
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, n, size=s) for s in (9, 3, 6, 2)]
    tb = training_batch(
        windows,
        [np.zeros(len(w), dtype=np.int64) for w in windows],
        rng,
        n_items=n,
        max_len=20,
        cuts=3,
        negatives=k - 1,
        windowed=True,
    )
    held = torch.tensor([int(prior.index[windows[0][0], 0]), 7])  # one the prior votes for
    torch.manual_seed(0)
    got = prior_negatives(
        StackedPriors.of([prior]),
        tb.history.vids,
        tb.next_vids,
        tb.candidates,
        tb.cut,
        k - 1,
        m,
        held,
    )
    assert got.shape == tb.candidates.shape
    mined = 0
    for b, w in enumerate(windows):
        for c in range(3):
            t = int(tb.cut[b, c * k])
            row = got[b, c * k : (c + 1) * k]
            assert row[0] == tb.candidates[b, c * k] == w[t]  # the positive
            assert row[1 + m :].equal(tb.candidates[b, c * k + 1 + m : (c + 1) * k])
            scores = prior.scores([torch.as_tensor(w[:t])])[0]
            scores[torch.as_tensor(w)] = float("-inf")
            scores[held] = float("-inf")
            top = set(
                scores.topk(PRIOR_NEGATIVE_POOL)
                .indices[scores.topk(PRIOR_NEGATIVE_POOL).values > 0]
                .tolist()
            )
            for v in row[1 : 1 + m].tolist():
                assert v in top and v not in set(w.tolist()) and v not in held.tolist()
                mined += 1
    assert mined == 4 * 3 * m
    # a cut whose prior votes for nothing (an empty prior) keeps its uniform negatives
    empty = ItemPrior(prior.index, torch.zeros_like(prior.weight), cfg)
    kept = prior_negatives(
        StackedPriors.of([empty]), tb.history.vids, tb.next_vids, tb.candidates, tb.cut, k - 1, m
    )
    assert kept.equal(tb.candidates)

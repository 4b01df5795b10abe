"""The Ranker deployment's engine without HTTP: it follows a newly published item-vectors
version, /v1/recommend's whole-catalog ranking and what retrieval (exact, or through the
index) keeps of it - on a tiny text ranker's artifacts, no training run."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from artifacts import storage


class TextRankerStates:
    """A tiny text ranker's published artifacts, made without a training run: its item vectors
    (``vectors(table)`` publishes a new version), its checkpoint and a user_states manifest
    naming them (``uri``); the engine builds the users' states itself (``extend``)."""

    def __init__(self, tmp_path) -> None:
        import io
        import json

        from tests.test_ranker import CKV_MODES, N_ITEMS, tiny_ranker

        self.tmp_path, self.n_items = tmp_path, N_ITEMS
        self.model = tiny_ranker(CKV_MODES["collective_kv"])
        self.table = torch.randn(N_ITEMS, self.model.cfg.item_dim)
        self.first = self.vectors(self.table)
        weights = io.BytesIO()
        torch.save(self.model.state_dict(), weights)
        checkpoint = self.publish(
            "checkpoint",
            {"n_items": N_ITEMS, "vectors_uri": self.first},
            {
                "model.pt": weights.getvalue(),
                "ranker.json": self.model.cfg.to_json().encode(),
                "train.json": json.dumps({"max_len": 10}).encode(),
            },
        )
        manifest = {"kind": "user_states", "checkpoint": checkpoint, "vectors_uri": self.first}
        self.uri = str(tmp_path / "states")
        self.publish("states", manifest, {})

    def publish(self, folder: str, meta: dict, files: dict) -> str:
        pub = storage.Publication(str(self.tmp_path / folder))
        for name, data in files.items():
            pub.put_bytes(name, data) if isinstance(data, bytes) else pub.put_table(name, data)
        return pub.publish(meta)["uri"]

    def vectors(self, t: torch.Tensor) -> str:
        rows = pa.table({"vid": list(range(len(t))), "vector": t.tolist()})
        return self.publish("vectors", {"dim": t.shape[1]}, {"vectors.parquet": rows})


def test_the_ranker_follows_a_newly_published_item_vectors_version(tmp_path):
    """A text ranker's replica engine (item_vectors_poll_s > 0): a new version of the vectors
    folder its states were built with (two items' texts re-encoded: here their vectors
    swapped) is scored from after one check, as a fresh engine over that version scores; a
    version that does not fit the ranker is refused and the last one kept; an engine not
    following keeps the states' version."""
    from models.errors import InputError
    from services.engine import RankEngine

    built = TextRankerStates(tmp_path)
    states_uri, table, first, vectors = built.uri, built.table, built.first, built.vectors
    engine = RankEngine(states_uri, follow_vectors=True)
    row = engine.empty_state(7)
    for vid, fb in [(1, 0), (2, 3), (3, 1)]:
        row = engine.extend(row, vid, fb)

    def rank(e: RankEngine):
        ((top, scores),) = e.rank([row], [[4, 5, 6, 8]], [4])
        return dict(zip(top, scores, strict=True))

    before = rank(engine)
    assert engine.follow_vectors() is None and engine.vectors_uri == first
    swapped = table.clone()
    swapped[[4, 5]] = table[[5, 4]]
    second = vectors(swapped)
    assert engine.follow_vectors() == second
    after = rank(engine)
    assert after == pytest.approx(rank(RankEngine(states_uri, follow_vectors=True)), abs=1e-6)
    assert after[4] != pytest.approx(before[4], abs=1e-4)  # the re-encoded items score anew
    assert after[6] == pytest.approx(before[6], abs=1e-6)  # the others as before
    assert rank(RankEngine(states_uri)) == pytest.approx(before, abs=1e-6)  # not following
    vectors(torch.randn(built.n_items, built.model.cfg.item_dim + 1))  # another encoder's width
    with pytest.raises((InputError, ValueError), match="item table must be"):
        engine.follow_vectors()
    assert engine.vectors_uri == second and rank(engine) == pytest.approx(after, abs=1e-6)


def test_recommend_is_the_whole_catalog_ranked_and_retrieval_only_narrows_it(tmp_path):
    """RankEngine.recommend: retrieving the whole catalog, its top k is the full score's top k
    over every item the user has not seen (or every item); a short retrieval ranks only what
    the user vector retrieved, with the same full score."""
    from services.engine import RankEngine

    built = TextRankerStates(tmp_path)
    engine, n = RankEngine(built.uri), built.n_items
    rows = [engine.empty_state(9)]
    for user, hist in enumerate([[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], list(range(n - 2))]):
        row = engine.empty_state(user)
        for vid in hist:
            row = engine.extend(row, vid, vid % 5)
        rows.append(row)
    got = engine.recommend(rows, [5] * 4, retrieve=n, exclude_seen=[True] * 4)
    for row, (top, scores) in zip(rows, got, strict=True):
        unseen = [v for v in range(n) if v not in set(row["hist"])]
        ((want, want_scores),) = engine.rank([row], [unseen], [5])
        assert top == want and scores == pytest.approx(want_scores, abs=1e-5)
        assert not set(top) & set(row["hist"]) and len(top) == min(5, len(unseen))
    (everything,) = engine.recommend(rows[2:3], [n], retrieve=n, exclude_seen=[False])
    ((want, _),) = engine.rank(rows[2:3], [list(range(n))], [n])
    assert everything[0] == want and len(everything[0]) == n
    u = engine.model.user_vector(engine._cache(rows[2:3]))
    dots = (u @ engine.model.catalog_tokens().T)[0]
    dots[torch.as_tensor(rows[2]["hist"])] = float("-inf")
    retrieved = set(dots.topk(8).indices.tolist())
    ((top, scores),) = engine.recommend(rows[2:3], [8], retrieve=8, exclude_seen=[True])
    ((want, want_scores),) = engine.rank(rows[2:3], [sorted(retrieved)], [8])
    assert set(top) == retrieved and (top, scores) == (want, pytest.approx(want_scores))


def test_the_retrieval_index_finds_the_largest_dot_products():
    """artifacts.retrieval on 5,000 items: scanning every group it returns exactly the top n
    of the matrix product; at the default nprobe it keeps most of the top 10; serialised and
    loaded, it answers the same."""
    from artifacts import retrieval

    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(50, 16, generator=gen)
    tokens = centres[torch.randint(0, 50, (5000,), generator=gen)]
    tokens += 0.3 * torch.randn(5000, 16, generator=gen)
    queries = torch.randn(20, 16, generator=gen)
    exact = (queries @ tokens.T).topk(30, dim=1).indices.numpy()
    blob, meta = retrieval.build(tokens.numpy(), nprobe=10**6)
    assert (meta["items"], meta["nlist"], meta["nprobe"]) == (5000, 128, 128)
    found = retrieval.search(retrieval.load(blob, meta), queries.numpy(), 30)
    assert [f.tolist() for f in found] == exact.tolist()
    blob, meta = retrieval.build(tokens.numpy())
    assert meta["nprobe"] == retrieval.NPROBE
    found = retrieval.search(retrieval.load(blob, meta), queries.numpy(), 10)
    pairs = zip(found, exact.tolist(), strict=True)
    kept = sum(len(set(f.tolist()) & set(e[:10])) for f, e in pairs)
    assert kept >= 0.8 * 10 * len(queries)


def test_retrieval_through_the_index_keeps_what_the_prior_votes_for(tmp_path):
    """With a retrieval index, the first stage takes the index's best items by the dot product
    plus every item the prior scores: items the dot product puts last but the prior votes for
    strongly are retrieved as exact retrieval retrieves them; without a prior, an exhaustive
    index retrieves exactly what the matrix product does."""
    from artifacts import retrieval
    from models.item_prior import ItemPrior, PriorConfig
    from services.engine import RankEngine

    built = TextRankerStates(tmp_path)
    engine, n = RankEngine(built.uri), built.n_items
    rows = []
    for user, hist in enumerate([[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [40]]):
        row = engine.empty_state(user)
        for vid in hist:
            row = engine.extend(row, vid, vid % 5)
        rows.append(row)
    cache = engine._cache(rows)
    hists = [torch.as_tensor(r["hist"]) for r in rows]
    with torch.no_grad():
        tokens = engine.model.catalog_tokens().float()
        users = engine.model.user_vector(cache).float()
    dots = users @ tokens.T
    blob, meta = retrieval.build(tokens.numpy(), nprobe=10**6)
    index = retrieval.load(blob, meta)
    assert meta["nprobe"] == meta["nlist"]  # every group scanned: exhaustive

    def both(retrieve: int) -> tuple[list, list]:
        engine.index = None
        exact = engine.retrieved(cache, hists, retrieve, [True] * len(rows))
        engine.index = index
        return exact, engine.retrieved(cache, hists, retrieve, [True] * len(rows))

    exact, indexed = both(5)
    assert indexed == exact and all(len(r) == 5 for r in exact)
    # a prior whose every item votes for three unseen items the index does not return
    found = retrieval.search(index, users.numpy(), 3 + max(len(h) for h in hists))
    elsewhere = set(range(n)) - {int(v) for f in found for v in f}
    elsewhere -= {int(v) for h in hists for v in h}
    last = sorted(sorted(elsewhere, key=lambda v: float(dots[:, v].sum()))[:3])
    votes = torch.tensor(last, dtype=torch.int32).repeat(n, 1)
    engine.prior = ItemPrior(votes, torch.full(votes.shape, 1.0), PriorConfig(recent=2))
    engine.prior_weight = 1e4
    exact, indexed = both(3)
    assert indexed == exact and [sorted(r) for r in indexed] == [last] * len(rows)

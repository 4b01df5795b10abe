"""pipelines.recommend: every user's top k, as the serving engine (and so /v1/recommend, see
tests/test_serve.py) answers it, written to S3 (moto on 127.0.0.1), resumed after a stop."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from artifacts import storage
from pipelines import recommend
from tests.tiny import N_USERS


def test_the_batch_job_writes_what_the_engine_answers_and_resumes_after_a_stop(
    tiny_trained, s3_bucket, monkeypatch, capsys
):
    from artifacts.states import read_states
    from services.engine import RankEngine

    states_uri = tiny_trained["states"]["user_states"]
    out = f"{s3_bucket}/kvrank"
    args = ["--states-uri", states_uri, "--out", out, "--k", "5", "--users-per-part", "20"]
    # a stop after the parts are written and before they are published
    publish = storage.Publication.publish

    def stopped(self, meta):
        raise KeyboardInterrupt("stopped")

    monkeypatch.setattr(storage.Publication, "publish", stopped)
    with pytest.raises(KeyboardInterrupt):
        recommend.main([*args, "--actors", "1"])
    monkeypatch.setattr(storage.Publication, "publish", publish)
    capsys.readouterr()
    assert recommend.main([*args, "--actors", "1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["users"], summary["parts"], summary["parts_reused"]) == (N_USERS, 2, 2)
    assert summary["users_per_second"] > 0
    target = summary["recommendations"]
    marker = storage.read_marker(target)
    assert marker["states"] == storage.resolve(states_uri) and marker["k"] == 5
    got = pa.concat_tables(
        storage.read_table(target, f, marker=marker) for f in marker["recommendation_files"]
    ).to_pylist()
    assert [r["user_id"] for r in got] == sorted(r["user_id"] for r in got)
    assert len(got) == N_USERS and not storage.exists(storage.join(target, "_parts"))
    engine = RankEngine(states_uri)
    manifest = storage.read_marker(states_uri)
    items = storage.read_table(manifest["dataset_uri"], "items.parquet")
    item_of = dict(zip(items["vid"].to_pylist(), items["item_id"].to_pylist(), strict=True))
    rows = {r["user_id"]: r for r in read_states(states_uri)[1].to_pylist()}
    for r in got[::7]:
        ((vids, scores),) = engine.recommend([rows[r["user_id"]]], [5], 500, [True])
        assert r["item_ids"] == [item_of[v] for v in vids]
        assert r["scores"] == pytest.approx(scores, abs=1e-5)
        assert not set(vids) & set(rows[r["user_id"]]["hist"])

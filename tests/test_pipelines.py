"""The offline Ray jobs on a tiny synthetic catalog: incremental encoding, and the whole chain
on s3:// (moto) with Ray Train on two workers, checkpoint and resume, and evaluation."""

from __future__ import annotations

import json
import os

import numpy as np
import polars as pl
import pytest
import torch

from artifacts import data, storage
from artifacts.data import item_table, training_windows
from models.errors import InputError
from pipelines import encode_items, evaluate, prepare_data, train_ranker
from pipelines.common import ranker_training, training, validation
from tests.tiny import N_USERS, TINY_SHAPE, base_texts, prepare, run_json, write_catalog


def test_training_windows_make_every_history_item_after_the_first_a_target_once():
    seqs = pl.DataFrame(
        {
            "user_id": [1, 2, 3],
            "hist": [list(range(100, 112)), [7, 8], [9]],
            "hist_fb": [list(range(12)), [1, 2], [3]],
        }
    )
    w = training_windows(seqs, max_len=5)
    assert w["user_id"].to_list() == [1, 1, 1, 2]  # user 3 has nothing to predict
    assert w["hist"].to_list() == [list(range(106, 112)), list(range(101, 107)), [100, 101], [7, 8]]
    assert w["hist_fb"].to_list()[0] == list(range(6, 12))  # feedback cut alongside
    targets = [t for h in w.filter(pl.col("user_id") == 1)["hist"].to_list() for t in h[1:]]
    assert sorted(targets) == list(range(101, 112))
    assert all(len(h) <= 6 for h in w["hist"].to_list())


def test_encoding_is_incremental(tiny, ray_local, capsys):
    args = [
        "--dataset-uri",
        tiny["dataset"],
        "--out",
        tiny["out"],
        "--actors",
        "1",
        "--batch-size",
        "16",
        "--max-chars",
        "60",
    ]
    first = run_json(capsys, encode_items.main, args)
    assert (first["encoded"], first["reused"], first["dropped"], first["errors"]) == (60, 0, 0, 0)
    old = storage.read_table(first["out"], "vectors.parquet").to_pandas()
    old_vec = {r.item_id: np.asarray(r.vector) for r in old.itertuples()}

    # the catalog changes: 2 texts edited, item 55 removed, items 60..62 new - one of them
    # holds only control characters and one is too long: both reported, neither fatal
    texts = base_texts()
    texts[7] = "a completely different jazz record"
    texts[8] = "chess manual, revised edition"
    del texts[55]  # no user has it
    texts[60] = "\x07\x07"
    texts[61] = "garden tools " * 10
    texts[62] = "a new space opera"
    prepare(tiny["dir"], tiny["out"], write_catalog(tiny["dir"], texts), tiny["seq"])
    second = run_json(capsys, encode_items.main, args)
    assert (second["encoded"], second["reused"], second["dropped"], second["errors"]) == (
        3,
        57,
        1,
        2,
    )
    errors = storage.read_table(second["out"], "errors.parquet").to_pylist()
    assert sorted((e["item_id"], e["reason"]) for e in errors) == [
        (60, "empty text after cleaning"),
        (61, "text longer than 60 characters"),
    ]
    new = storage.read_table(second["out"], "vectors.parquet").to_pandas()
    items = prepare_data.load_dataset(tiny["dataset"])["items"]
    vid_of = dict(zip(items["item_id"].to_list(), items["vid"].to_list(), strict=True))
    for r in new.itertuples():
        assert r.vid == vid_of[r.item_id]  # vids follow the current catalog
        if r.item_id in old_vec and r.item_id not in (7, 8):
            assert np.array_equal(np.asarray(r.vector), old_vec[r.item_id])  # reused as stored
    assert 55 not in set(new["item_id"])
    from models.encoder import ItemEncoder

    fresh = ItemEncoder().encode([texts[7], texts[62]]).numpy()
    got = {r.item_id: np.asarray(r.vector, dtype=np.float32) for r in new.itertuples()}
    np.testing.assert_allclose(got[7], fresh[0], atol=2e-3)
    np.testing.assert_allclose(got[62], fresh[1], atol=2e-3)
    table, missing = item_table(second["out"], len(items))
    assert missing == 2 and table.shape == (len(items), 384)  # the two errors have no vector
    # --full leaves the stored vectors unread: test_encoding_plan_without_stored_vectors_*


def test_encoding_plan_without_stored_vectors_encodes_every_good_text():
    """What ``--full`` runs (the stored vectors left unread) and a first run: every text that
    cleans to 1..max_chars characters is encoded, the others reported, nothing reused; with
    stored vectors, only new or changed texts are encoded."""
    import pyarrow as pa

    items = pa.table(
        {
            "item_id": pa.array([10, 11, 12, 13], pa.int64()),
            "vid": pa.array([1, 2, 3, 4], pa.int32()),
            "text": ["a jazz record", "\x07\x07", "garden tools " * 10, "a space opera"],
            "content_hash": ["h10", "h11", "h12", "h13"],
        }
    )
    to_encode, reused, errors, dropped = encode_items.plan(items, None, max_chars=60)
    assert to_encode["item_id"].to_pylist() == [10, 13] and reused is None and dropped == 0
    assert errors.select(["item_id", "reason"]).to_pylist() == [
        {"item_id": 11, "reason": "empty text after cleaning"},
        {"item_id": 12, "reason": "text longer than 60 characters"},
    ]
    stored = pa.table(
        {
            "item_id": pa.array([10, 13, 99], pa.int64()),
            "vid": pa.array([7, 8, 9], pa.int32()),
            "content_hash": ["h10", "old", "h99"],
            "vector": pa.array([[1.0], [2.0], [3.0]], pa.list_(pa.float32())),
        }
    )
    to_encode, reused, errors, dropped = encode_items.plan(items, stored, max_chars=60)
    assert to_encode["item_id"].to_pylist() == [13] and dropped == 1  # 13 changed, 99 gone
    assert reused.select(["item_id", "vid", "vector"]).to_pylist() == [
        {"item_id": 10, "vid": 1, "vector": [1.0]}  # the stored vector, under today's vid
    ]


def test_training_rows_come_in_a_new_seeded_order_every_epoch(ray_local, tmp_path):
    import pyarrow as pa

    table = pa.table({"row": np.arange(200)})

    def epochs(seed, root, n=2, split=False):
        ds = training.epoch_shuffled(table, seed, str(root))
        # as a Ray Train worker reads it: alone, the whole dataset; among several, its split
        it = ds.streaming_split(1, equal=True)[0] if split else ds.iterator()
        return [
            [int(x) for b in it.iter_batches(batch_size=50, batch_format="numpy") for x in b["row"]]
            for _ in range(n)
        ]

    first, second = epochs(0, tmp_path / "a")
    assert sorted(first) == sorted(second) == list(range(200))  # each epoch every row once
    assert first != second and first[:50] != second[:50]  # a capped epoch sees other rows
    assert epochs(0, tmp_path / "b") == [first, second]  # a rerun repeats them
    assert epochs(0, tmp_path / "e", split=True) == [first, second]  # split or not
    assert epochs(1, tmp_path / "c")[0] != first
    # a resumed run (a second attempt) does not replay the first run's order
    training.record_attempt(str(tmp_path / "d"))
    assert epochs(0, tmp_path / "d", n=1)[0] not in (first, second)


def test_the_embedded_rays_workers_find_their_own_cluster_and_silence_its_state_api(ray_local):
    """A worker of the embedded Ray resolves an address-less cluster lookup (what Ray Train's
    placement-group cleaner does) to this Ray, not to whatever cluster /tmp/ray names last,
    and the cleaner's every-second State API warnings are off there."""
    import logging

    from ray.train.v2._internal.execution.controller import placement_group_cleaner

    name = placement_group_cleaner.logger.name

    @ray_local.remote(num_cpus=0.1)
    def seen_by_a_worker() -> tuple[str | None, bool, bool]:
        cleaner = logging.getLogger(name)
        return (
            os.environ.get("RAY_ADDRESS"),
            cleaner.isEnabledFor(logging.WARNING),
            cleaner.isEnabledFor(logging.ERROR),
        )

    address, warns, errors = ray_local.get(seen_by_a_worker.remote())
    assert address == ray_local.get_runtime_context().gcs_address
    assert not warns and errors


def test_the_fused_optimizer_steps_as_the_per_tensor_adamw_and_skips_frozen_weights():
    """The ranker's optimizer is AdamW's fused kernel: after steps on the same gradients its
    weights are the per-tensor loop's (float rounding apart); frozen weights (a ``--tune kv``
    fine-tune) are not in it."""
    tc = ranker_training.TrainConfig(lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    b.load_state_dict(a.state_dict())
    start = a[0].weight.detach().clone()
    fused = training.optimizer(a, tc)
    loop = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(20):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, fused), (b, loop)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    assert (a[0].weight - start).abs().max() > 0.05  # they did move
    a[0].requires_grad_(False)
    assert len(training.optimizer(a, tc).param_groups[0]["params"]) == 2


def test_the_weight_average_moves_a_fixed_share_each_step_and_resumes():
    model = torch.nn.Linear(1, 1, bias=False)
    assert training.weight_average(model, 0.0, None) is None  # off
    average = training.weight_average(model, 0.75, None)
    expected = None
    for w in [4.0, 2.0, 8.0, 0.0]:
        model.weight.data.fill_(w)
        average.update_parameters(model)
        expected = w if expected is None else 0.75 * expected + 0.25 * w  # the first one copies
        assert average.module.weight.item() == pytest.approx(expected)
    model.weight.data.fill_(100.0)  # the raw weights a continued run starts from
    saved = {"published": average.module.state_dict(), "averaged_steps": 4}
    again = training.weight_average(model, 0.75, saved)
    assert again.module.weight.item() == pytest.approx(expected)
    again.update_parameters(model)  # and it goes on averaging, not copying
    assert again.module.weight.item() == pytest.approx(0.75 * expected + 25.0)
    assert int(again.n_averaged) == 5


def test_each_epoch_is_one_log_line_with_its_trainers_validation():
    ranker = {"epoch": 1, "loss": 9.55609, "val_ndcg10": 0.05660, "val_hr10": 0.1}
    ranker |= {"best_val_ndcg10": 0.05660, "epoch_seconds": 428.8}
    assert training.epoch_line(ranker) == "1: loss 9.5561, val_ndcg10 0.0566 (best 0.0566), 429 s"
    teacher = {"epoch": 0, "loss": 1.2, "val_sampled_ndcg10": 0.3, "best_val_sampled_ndcg10": 0.4}
    assert training.epoch_line(teacher) == "0: loss 1.2000, val_sampled_ndcg10 0.3000 (best 0.4000)"


def test_resume_without_a_checkpoint_is_a_clear_error(tiny, capsys):
    rc = train_ranker.main(
        [
            "--dataset-uri",
            tiny["dataset"],
            "--out",
            tiny["out"],
            "--run",
            "none",
            "--item-input",
            "id",
            "--resume",
        ]
    )
    assert rc == 2
    assert "--resume: no checkpoint under" in capsys.readouterr().err


def test_metrics_on_a_hand_made_case():
    from models.config import RankerConfig
    from models.metrics import (
        full_catalog_ranks,
        hit_at_k,
        ndcg_at_k,
        ndcg_se,
        sampled_ranks,
        summarize,
    )
    from models.ranker import History, Ranker

    ranks = torch.tensor([0, 1, 9, 10, 500])
    assert ndcg_at_k(ranks).tolist() == pytest.approx([1.0, 1 / np.log2(3), 1 / np.log2(11), 0, 0])
    assert hit_at_k(ranks).tolist() == [1, 1, 1, 0, 0]
    assert summarize(ranks.numpy()) == pytest.approx(
        {"ndcg10": float(ndcg_at_k(ranks).mean()), "hr10": 0.6}
    )
    # standard errors of a mean NDCG@10, alone and paired by user
    assert ndcg_se(np.array([0, 20])) == pytest.approx(0.5)  # NDCG 1 and 0: s.d. 0.707 / sqrt 2
    assert ndcg_se(np.array([0, 20, 0]), paired=np.array([20, 20, 0])) == pytest.approx(
        np.std([1.0, 0.0, 0.0], ddof=1) / np.sqrt(3)
    )
    assert ndcg_se(np.array([3, 3]), paired=np.array([3, 3])) == 0

    # a model whose score of item v is -v: item 5 is beaten by items 0..4, minus the excluded
    model = Ranker(
        RankerConfig(
            item_dim=4, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=8, n_layers=1
        ),
        n_items=20,
    )
    model.candidate_tokens = lambda vids: vids.float()[:, None].expand(-1, 8)
    model.score_tokens = lambda cache, tokens: -tokens[:, 0].expand(len(cache.lengths), -1)
    h = History.from_lists([[1, 2], [3]])
    got = full_catalog_ranks(
        model, h, torch.tensor([5, 5]), [torch.tensor([1, 2]), torch.tensor([5])], 20, chunk=7
    )
    assert got.tolist() == [3, 5]  # user 0: items 0, 3, 4 beat 5; user 1: 0..4 (5 is the target)

    # ties count against the target: a model that scores every item alike ranks it last
    model.score_tokens = lambda cache, tokens: torch.zeros(len(cache.lengths), tokens.shape[-2])
    got = full_catalog_ranks(
        model, h, torch.tensor([5, 5]), [torch.tensor([1, 2]), torch.tensor([5])], 20, chunk=7
    )
    assert got.tolist() == [17, 19] and ndcg_at_k(got).sum() == 0
    tied = sampled_ranks(model, h, torch.tensor([5, 5]), torch.tensor([[0, 1], [2, 3]]))
    assert tied.tolist() == [2, 2]

    users = pl.DataFrame({"input": [[0, 0, 1], [2]], "test": [1, 3], "negatives": [[2, 3], [0, 1]]})
    full, sampled = evaluate.popular_ranks(users, evaluate.input_counts(users, 4))
    # counts: item0 2, item1 1, item2 1, item3 0; user 0's item1 ties with item2 (ranked above it)
    assert full.tolist() == [1, 2] and sampled.tolist() == [1, 2]
    # counted over more users than are evaluated (a sampled evaluation): item3 now leads
    everyone = pl.concat(
        [users, pl.DataFrame({"input": [[3, 3, 3]], "test": [0], "negatives": [[1]]})]
    )
    full, sampled = evaluate.popular_ranks(users, evaluate.input_counts(everyone, 4))
    assert full.tolist() == [2, 0] and sampled.tolist() == [2, 0]


def test_validation_by_the_dot_product_ranks_by_the_user_vector_alone():
    from models.config import RankerConfig
    from models.metrics import dot_catalog_ranks, full_catalog_ranks, ndcg_at_k
    from models.ranker import History, Ranker

    torch.manual_seed(0)
    n_items = 30
    shape = dict(item_dim=4, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=8)
    model = Ranker(RankerConfig(**shape, n_layers=1), n_items=n_items).eval()
    model.set_item_table(torch.randn(n_items, 4))
    rng = np.random.default_rng(0)
    hists = [rng.choice(n_items, size=k, replace=False) for k in (1, 3, 5, 2, 4)]
    val = {
        "hist": hists,
        "hist_fb": [np.zeros(len(h), dtype=np.int64) for h in hists],
        "valid": [int(np.setdiff1d(np.arange(n_items), h)[0]) for h in hists],
    }
    # by hand: <u, item token> for every item, the user's history ranked below everything
    h = History.from_lists([list(x) for x in hists], [[0] * len(x) for x in hists])
    with torch.no_grad():
        scores = model.user_vector(model.prefill(h)) @ model.catalog_tokens().T
    want = []
    for b, hist in enumerate(hists):
        row = scores[b].clone()
        row[torch.as_tensor(hist)] = -float("inf")
        want.append(int((row > scores[b, val["valid"][b]]).sum()))
    exclude = [torch.as_tensor(x) for x in hists]
    got = dot_catalog_ranks(model, h, torch.tensor(val["valid"]), exclude)
    assert got.tolist() == want
    nd, _, n = validation.worker_sums(model, val, n_items, 10, 0, 1, "dot")
    assert n == 5 and nd == pytest.approx(float(ndcg_at_k(torch.tensor(want)).sum()))
    # one worker's sums, averaged over its users: what every epoch records
    assert validation.validate(model, val, n_items, 10, 0, 1, "dot")[::2] == (
        pytest.approx(nd / 5),
        5,
    )
    # two workers split the users and their sums add up to one worker's
    halves = [validation.worker_sums(model, val, n_items, 10, r, 2, "dot") for r in (0, 1)]
    assert sum(x[0] for x in halves) == pytest.approx(nd) and sum(x[2] for x in halves) == 5
    # the served score adds the head: another ranking, and what "served" validation sums
    served = full_catalog_ranks(model, h, torch.tensor(val["valid"]), exclude, n_items)
    assert served.tolist() != want
    nd_served, _, _ = validation.worker_sums(model, val, n_items, 10, 0, 1, "served")
    assert nd_served == pytest.approx(float(ndcg_at_k(served).sum()))
    with pytest.raises(InputError, match="--val-score must be one of"):
        ranker_training.TrainConfig(val_score="mis")


def test_whole_chain_on_s3_on_two_workers_with_checkpoints_and_resume(
    tiny, s3_bucket, ray_local, capsys
):
    """Everything in a bucket: the catalog encoded, the text+id ranker trained on two workers with
    Ray Train's checkpoints stored there, a refused fresh start, a resume that carries the
    first epochs over, and the evaluation of what it published."""
    out = f"{s3_bucket}/kv"
    ds = prepare(tiny["dir"], out, write_catalog(tiny["dir"], base_texts()), tiny["seq"])
    enc = run_json(capsys, encode_items.main, ["--dataset-uri", ds, "--out", out, "--actors", "1"])
    assert enc["out"].startswith("s3://") and enc["encoded"] == 60
    base = ["--dataset-uri", ds, "--vectors-uri", enc["out"], "--out", out, "--run", "r"]
    base += ["--workers", "2", "--patience", "10", *TINY_SHAPE]
    first = run_json(capsys, train_ranker.main, [*base, "--epochs", "2"])
    assert (first["epochs_run"], first["last_epoch"], first["workers"]) == (2, 1, 2)
    # the embedded Ray trains without Ray Train's preemption watcher (ray_runtime's
    # EMBEDDED_TRAIN_ENV); the GCS's actor table, as there is no dashboard for the State API
    from ray._private import state

    ran = {a["ActorClassName"] for a in state.actors().values()}
    assert "RayTrainWorker" in ran and "PreemptionWatcher" not in ran
    root = ranker_training.checkpoint_uri(out, "r")
    assert first["checkpoint"] == root == f"{out}/checkpoints/r"
    marker = storage.read_marker(root)
    assert marker["best_epoch"] in (0, 1)
    history = json.loads(storage.read_file(root, "metrics.json"))
    assert [h["epoch"] for h in history] == [0, 1]
    assert all(h["val_users"] == 8 for h in history)  # validation split across both workers
    assert marker["source"] != marker["latest"] or marker["best_epoch"] == 1
    # a fresh start under the same run name would mix two trainings: refused, nothing touched
    capsys.readouterr()
    assert train_ranker.main([*base, "--epochs", "2"]) == 2
    assert "pass --resume to continue it" in capsys.readouterr().err
    assert storage.read_marker(root)["version"] == marker["version"]
    assert json.loads(storage.read_file(root, "metrics.json")) == history
    # distilling from a base needs a fine-tune's base: train_ranker alone has none
    assert train_ranker.main([*base, "--resume", "--base-distill-weight", "1"]) == 2
    assert "train_kv_pool gives it" in capsys.readouterr().err

    resumed = run_json(capsys, train_ranker.main, [*base, "--epochs", "3", "--resume"])
    assert (resumed["epochs_run"], resumed["last_epoch"]) == (3, 2)
    history2 = json.loads(storage.read_file(root, "metrics.json"))
    assert history2[:2] == history  # the first two epochs are carried over, not redone
    model, marker = data.load_checkpoint(root)
    assert model.cfg.d_model == 32 and model.cfg.item_input == "text+id"
    # published: the best epoch's weight average, not its raw weights
    best = torch.load(training.open_file(marker["source"], "state.pt"), weights_only=True)
    weights = model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in best["published"].items())
    assert any(not torch.equal(best["model"][k], v) for k, v in best["published"].items())
    # the average went on across the resume: it has seen every step of the three epochs
    last = torch.load(training.open_file(marker["latest"], "state.pt"), weights_only=True)
    assert last["averaged_steps"] == sum(h["steps"] for h in history2)
    assert last["history"] == history2
    # Ray Train kept the best epochs by validation NDCG@10 and the latest, no more, in the bucket
    assert marker["latest"].startswith("s3://")
    fs, run_folder = storage.filesystem(marker["latest"].rsplit("/", 1)[0])
    kept = [
        p
        for p in fs.ls(run_folder, detail=False)
        if p.rsplit("/", 1)[-1].startswith("checkpoint_2")
    ]
    assert 1 <= len(kept) <= training.KEEP_CHECKPOINTS + 1

    ev = run_json(
        capsys,
        evaluate.main,
        ["--dataset-uri", ds, "--checkpoint", root, "--out", out, "--actors", "1"],
    )
    assert ev["users"] == N_USERS and ev["report"].startswith("s3://")
    report = json.loads(storage.read_file(ev["report"], "metrics.json"))
    assert set(report["metrics"]) == {"ranker", "most_popular"}
    png = storage.read_file(ev["report"], "ndcg_by_history_length.png")
    assert png[:4] == b"\x89PNG"


def test_an_actor_pool_starts_no_more_actors_than_its_table_makes_batches():
    """An actor that would get no batch is not started (each costs a process and a model load):
    analyze_kv's 10 users in batches of 16 take one actor of the two it asks for."""
    from pipelines.common.ranker_actors import pool_size

    assert pool_size(10, 16, 2) == 1
    assert pool_size(40, 16, 2) == 2  # three batches: the two asked for
    assert pool_size(40, 32, 4) == 2  # build_user_states' 40 users in batches of 32
    assert pool_size(100, 16, 3) == 3
    assert pool_size(0, 16, 3) == 1  # an empty table still gets its (empty) map


def test_a_runs_summary_says_why_it_stopped_and_whether_validation_was_still_rising():
    tc = training.BaseTrainConfig(epochs=6, patience=2)

    def run(scores):
        history = [{"epoch": i, "val_ndcg10": s} for i, s in enumerate(scores)]
        return training.convergence(history, tc, "val_ndcg10")

    still = {"stopped_by": "epochs", "val_still_rising": True}
    assert run([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == still
    assert run([0.1, 0.3, 0.2, 0.2]) == {"stopped_by": "patience", "val_still_rising": False}
    # a tie is not better (as the epoch loop counts it)
    assert run([0.1, 0.3, 0.3, 0.3]) == {"stopped_by": "patience", "val_still_rising": False}
    assert run([0.1, 0.2, 0.3]) == {"stopped_by": "max_minutes", "val_still_rising": True}
    assert run([0.1, 0.3, 0.2, 0.4, 0.5, 0.45]) == {
        "stopped_by": "epochs",
        "val_still_rising": False,
    }


def test_held_out_items_never_reach_training():
    """A dataset's new items (prepare_data --holdout-items) are never in a history, never drawn
    as a negative and out of the catalog softmax: an id ranker's embeddings of them get no
    gradient, so what it scores them is its untrained start."""
    from artifacts.data import negative_pool
    from models.ranker import Ranker
    from pipelines.common.ranker_training import TrainConfig, ranker_batches, ranker_loss
    from tests.test_ranker import N_ITEMS, tiny_config

    torch.manual_seed(0)
    model = Ranker(tiny_config(item_input="id"), n_items=N_ITEMS)
    held = np.arange(0, N_ITEMS, 3)
    pool = negative_pool(held, N_ITEMS)
    assert len(pool) == N_ITEMS - len(held) and not np.isin(pool, held).any()
    rng = np.random.default_rng(0)
    lengths = (3, 8, 12, 5, 9, 2)
    rows = {
        "hist": [rng.choice(pool, size=n) for n in lengths],
        "hist_fb": [rng.integers(0, 5, size=n) for n in lengths],
    }
    tc = TrainConfig(batch_size=2, cuts=4, negatives=20, max_len=10)
    batches = list(ranker_batches(rows, rng, tc, N_ITEMS, pool))
    drawn = np.concatenate([tb.candidates.numpy().ravel() for tb in batches])
    assert len(drawn) == len(lengths) * 4 * 21 and not np.isin(drawn, held).any()
    whole = list(ranker_batches(rows, rng, tc, N_ITEMS))  # the whole catalog draws them
    assert np.isin(np.concatenate([tb.candidates.numpy().ravel() for tb in whole]), held).any()
    for tb in batches:
        loss, _ = ranker_loss(model, tb, tc, "cpu", held_out=torch.from_numpy(held))
        loss.backward()
    grad = model.item_emb.weight.grad
    assert grad[held].abs().max() == 0 and grad[pool].abs().sum() > 0
    model.zero_grad()
    ranker_loss(model, batches[0], tc, "cpu")[0].backward()  # unmasked, the softmax reaches them
    assert model.item_emb.weight.grad[held].abs().sum() > 0

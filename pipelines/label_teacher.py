"""Label the ranker's training examples with a trained teacher, with Ray Data.

    python -m pipelines.label_teacher --dataset-uri out/datasets/ml-latest-small \\
        --teacher out/teachers/ml-latest-small-teacher --out out \\
        [--cuts 4] [--negatives 31] [--max-len 50] [--passes 1] [--max-windows N]
        [--actors N] [--seed 0] [--engine hf|vllm]

The examples are fixed here, so that the teacher's scores and the ranker's meet on the same
candidates: every user's history cut into windows of ``--max-len`` + 1 items (as train_ranker
cuts them), and per window - ``--passes`` times, with different draws - a window, ``--cuts`` cut
points and per cut the positive and ``--negatives`` uniform negatives (``models.batches``, one
seeded generator per row, so a rerun draws the same examples; ``--max-windows`` labels a
seeded sample of the windows when all of them would take too long). An actor pool of teachers scores
every candidate (one prompt each) in batches: Hugging Face forwards (``--engine hf``, the
default) or a vLLM engine per actor (``--engine vllm``, ``pipelines.common.vllm_engine``: the same
logits, with a user's prompts sharing their cached history prefix). Written to
``<out>/teacher_labels/<dataset>/<teacher run>/labels.parquet``: user_id, hist and hist_fb (the
window), cuts, candidates (cuts x (1 + negatives), row-major) and teacher_logits (the same
shape) - what ``train_ranker --teacher-labels`` reads.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pyarrow as pa

from artifacts import storage
from artifacts.data import (
    held_out_vids,
    item_titles,
    negative_pool,
    training_windows,
    user_sequences,
)
from models.errors import InputError
from pipelines.common import cli, jobs


def labels_uri(out: str, dataset: str, teacher_run: str) -> str:
    return storage.join(out, "teacher_labels", dataset, teacher_run)


class TeacherLabeler:
    """Ray Data callable class: the teacher's logit for every candidate of every row."""

    def __init__(
        self, teacher: str, dataset_uri: str, threads: int, batch_size: int, engine: str = "hf"
    ) -> None:
        import torch

        from pipelines.common.teachers import load_teacher

        torch.set_num_threads(max(1, threads))
        with load_teacher(teacher, engine) as loaded:  # weights in memory; a download may go
            self.teacher = loaded
        self.titles = item_titles(dataset_uri)
        self.batch_size = batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        from models.teacher import examples_for

        examples, sizes = [], []
        for v, f, t, c in zip(
            batch["hist"], batch["hist_fb"], batch["cuts"], batch["candidates"], strict=True
        ):
            rows = np.asarray(c).reshape(len(t), -1)
            examples += examples_for(v, f, t, rows, self.titles)
            sizes.append(rows.size)
        scores = self.teacher.score(examples, self.batch_size).numpy().astype(np.float32)
        parts = np.split(scores, np.cumsum(sizes)[:-1])
        # an Arrow table with list columns (numpy object columns would come back as tensors)
        i64 = pa.list_(pa.int64())
        cols = {"user_id": pa.array(batch["user_id"], pa.int64())}
        for name in ("hist", "hist_fb", "cuts", "candidates"):
            cols[name] = pa.array([np.asarray(x).tolist() for x in batch[name]], i64)
        cols["teacher_logits"] = pa.array([p.tolist() for p in parts], pa.list_(pa.float32()))
        return pa.table(cols)


def fixed_examples(
    seqs,
    *,
    n_items: int,
    max_len: int,
    cuts: int,
    negatives: int,
    passes: int,
    seed: int,
    max_windows: int = 0,
    pool: np.ndarray | None = None,
) -> pa.Table:
    """The rows to label: windows, cut points and candidates, drawn once with a seeded
    generator per (pass, window); ``max_windows`` > 0 keeps a seeded sample of the windows (a
    window keeps its draws whether or not others are sampled); ``pool``: the vids negatives
    are drawn from (default: the whole catalog)."""
    from models.batches import sample_candidates, sample_window

    windows = training_windows(seqs, max_len).with_row_index("window")
    if 0 < max_windows < windows.height:
        keep = np.random.default_rng([seed, 1 << 20]).choice(windows.height, max_windows, False)
        windows = windows[np.sort(keep)]
    uid, hv, hf, ct, cd = [], [], [], [], []
    for p in range(passes):
        for i, u, v, f in windows.iter_rows():
            rng = np.random.default_rng([seed, p, i])
            wv, wf = sample_window(np.asarray(v), np.asarray(f), rng, max_len)
            t, cands = sample_candidates(
                wv, rng, n_items=n_items, cuts=cuts, negatives=negatives, pool=pool
            )
            uid.append(u)
            hv.append(wv.tolist())
            hf.append(wf.tolist())
            ct.append(t.tolist())
            cd.append(cands.reshape(-1).tolist())
    i64 = pa.list_(pa.int64())
    return pa.table(
        {
            "user_id": pa.array(uid, pa.int64()),
            "hist": pa.array(hv, i64),
            "hist_fb": pa.array(hf, i64),
            "cuts": pa.array(ct, i64),
            "candidates": pa.array(cd, i64),
        }
    )


def label(
    dataset_uri: str,
    teacher: str,
    out: str,
    *,
    cuts: int = 4,
    negatives: int = 31,
    max_len: int = 50,
    passes: int = 1,
    max_windows: int = 0,
    seed: int = 0,
    actors: int = 0,
    batch_size: int = 64,
    engine: str = "hf",
) -> dict:
    import ray

    from pipelines.common.ranker_actors import map_with_pool, pool_size
    from pipelines.common.ray_runtime import cluster_gpus, init_ray
    from pipelines.common.teachers import teacher_for_engine
    from pipelines.common.vllm_engine import check_engine

    check_engine(engine)  # fail here, not in every actor

    for name, value in (("cuts", cuts), ("negatives", negatives), ("max-len", max_len)):
        if value <= 0:
            raise InputError(f"--{name} must be > 0, got {value}")
    if passes <= 0:
        raise InputError(f"--passes must be > 0, got {passes}")
    if max_windows < 0:
        raise InputError(f"--max-windows must be >= 0 (0: every window), got {max_windows}")
    t0 = time.perf_counter()
    dataset_uri, teacher = storage.pinned(dataset_uri), storage.pinned(teacher)
    out = storage.absolute(out)
    marker = storage.read_marker(dataset_uri)
    tmarker = storage.read_marker(teacher)
    if tmarker.get("kind") != "teacher_checkpoint":
        raise InputError(f"{teacher} is not a published teacher (train_teacher's output)")
    teacher_for_engine(teacher, engine)  # a cross-encoder on vLLM, too
    seqs = user_sequences(dataset_uri)
    users = seqs.filter(seqs["hist"].list.len() >= 2).select("user_id", "hist", "hist_fb")
    if users.height == 0:
        raise InputError(f"{dataset_uri}: no user has 2+ history items")
    rows = fixed_examples(
        users,
        n_items=int(marker["items"]),
        max_len=max_len,
        cuts=cuts,
        negatives=negatives,
        passes=passes,
        seed=seed,
        max_windows=max_windows,
        pool=negative_pool(held_out_vids(dataset_uri), int(marker["items"])),
    )
    init_ray()
    gpu = engine == "vllm" and cluster_gpus() > 0
    default_actors = cluster_gpus() if gpu else int(ray.cluster_resources().get("CPU", 1)) - 1
    actors = actors or max(1, default_actors)
    # rows per batch such that one batch is about batch_size * 8 prompts
    per_row = cuts * (1 + negatives)
    rows_per_batch = max(1, batch_size * 8 // per_row)
    actors = pool_size(rows.num_rows, rows_per_batch, actors)  # the pool map_with_pool starts
    res = map_with_pool(
        rows,
        TeacherLabeler,
        lambda threads: (teacher, dataset_uri, threads, batch_size, engine),
        actors=actors,
        batch_size=rows_per_batch,
        gpu=gpu,
    )
    table = pa.concat_tables(ray.get(res.to_arrow_refs()))
    dest = labels_uri(out, marker["name"], storage.name_of(teacher))
    pub = storage.Publication(dest)
    try:
        pub.put_table("labels.parquet", table)
        pub.publish(
            {
                "kind": "teacher_labels",
                "dataset_uri": dataset_uri,
                "teacher": teacher,
                "rows": table.num_rows,
                "prompts": table.num_rows * per_row,
                "cuts": cuts,
                "negatives": negatives,
                "max_len": max_len,
                "passes": passes,
                "max_windows": max_windows or None,
                "seed": seed,
                "engine": engine,
            }
        )
    except BaseException:
        pub.discard()
        raise
    seconds = time.perf_counter() - t0
    return {
        "job": "label_teacher",
        "rows": table.num_rows,
        "prompts": table.num_rows * per_row,
        "prompts_per_second": round(table.num_rows * per_row / seconds, 1),
        "actors": actors,
        "engine": engine,
        "labels": dest,
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = cli.job_parser("label_teacher", __doc__)
    p.add_argument("--dataset-uri", required=True, help="the prepared dataset to label")
    p.add_argument("--teacher", required=True, help="a published teacher (train_teacher)")
    p.add_argument("--out", required=True, help="labels go to <out>/teacher_labels/<ds>/<run>/")
    p.add_argument("--cuts", type=int, default=4, help="cut points per window")
    p.add_argument("--negatives", type=int, default=31, help="uniform negatives per cut")
    p.add_argument("--max-len", type=int, default=50, help="history items per window")
    p.add_argument("--passes", type=int, default=1, help="draws of examples per window")
    p.add_argument(
        "--max-windows", type=int, default=0, help="label a seeded sample of windows (0: all)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled cuts and negatives")
    p.add_argument(
        "--actors",
        type=int,
        default=0,
        help="teacher actors (0: CPUs - 1; never more than there are batches)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="prompts per teacher forward")
    p.add_argument(
        "--engine",
        default="hf",
        help="hf (PyTorch forwards) or vllm (pipelines.common.vllm_engine)",
    )
    a = cli.parse(p, argv)
    return jobs.run(
        lambda: label(
            a.dataset_uri,
            a.teacher,
            a.out,
            cuts=a.cuts,
            negatives=a.negatives,
            max_len=a.max_len,
            passes=a.passes,
            max_windows=a.max_windows,
            seed=a.seed,
            actors=a.actors,
            batch_size=a.batch_size,
            engine=a.engine,
        )
    )


if __name__ == "__main__":
    sys.exit(main())

"""CollectiveKV sweep: compression ratio vs quality over pool size M and user width d_u, next to
the int8 and low-rank (MLA-style) KV baselines, all from one trained ranker.

    python -m benchmarks.kv_sweep --dataset-uri out/datasets/ml-latest-small \\
        --checkpoint out/checkpoints/ml-latest-small-text-id --out out \\
        [--pool-sizes 256,1024,4096] [--user-dims 1,2,4,8] [--low-ranks 4] [--epochs 1]
        [--max-users 200]

For each (M, d_u): ``train_kv_pool`` fits and fine-tunes the pools, ``build_user_states`` stores
every user's state, and the test users are scored FROM THE STORED STATES (read back from
Parquet, expanded, MIS over the full catalog), as serving will. Router use (distinct entries /
M) and its entropy come from the state build. Baselines on the same users: the uncompressed
ranker (fp16 KV, ratio 1), its KV stored in int8 with a scale per token and head, and the
low-rank KV with R = 2 + 2 d_u fp16 numbers per token and layer (the bytes of CollectiveKV at
that d_u) fine-tuned the same way. Each row carries the standard error of its NDCG@10 and the
paired standard error of its gap to the uncompressed row (same users), so a gap can be told
from the noise of one test item a user. Writes ``benchmarks/results/kv_sweep_<dataset>.json`` and
prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np
import torch

from benchmarks import low_rank
from benchmarks.report import machine, write

log = logging.getLogger("kvrank.kv_sweep")


def quantize_int8(cache):
    """The int8 baseline: K and V of each cached token and KV head quantised symmetrically to
    int8 with one fp16 scale (absmax / 127), and dequantised. Returns the cache a consumer
    would read and the bytes stored for the valid tokens."""
    from models.inputs import KVCache

    def q(t: torch.Tensor) -> torch.Tensor:
        scale = (t.abs().amax(-1, keepdim=True) / 127).to(torch.float16).to(t.dtype)
        scale = scale.clamp(min=torch.finfo(torch.float16).tiny)
        return (t / scale).round().clamp(-127, 127) * scale

    tokens = int(cache.lengths.sum())
    heads, dim = cache.k[0].shape[1], cache.k[0].shape[3]
    nbytes = tokens * len(cache.k) * 2 * heads * (dim + 2)
    return KVCache([q(k) for k in cache.k], [q(v) for v in cache.v], cache.lengths), nbytes


def ranks_for(model, users, max_len: int, n_items: int, cache_fn, batch: int = 32) -> np.ndarray:
    """Full-catalog rank of each test item, with the cache each batch gets from ``cache_fn``."""
    from models.batches import history_batch
    from models.metrics import full_catalog_ranks

    out = []
    inputs, fbs = users["input"].to_list(), users["input_fb"].to_list()
    tests = users["test"].to_list()
    t0, every = time.perf_counter(), max(1, len(tests) // batch // 10) * batch
    for s in range(0, len(tests), batch):
        if s and s % every == 0:
            rate = s / (time.perf_counter() - t0)
            log.info("scored %d/%d test users (%.1f users/s)", s, len(tests), rate)
        hist = [np.asarray(h, dtype=np.int64) for h in inputs[s : s + batch]]
        fb = [np.asarray(f, dtype=np.int64) for f in fbs[s : s + batch]]
        cache = cache_fn(history_batch(hist, fb, max_len), slice(s, s + batch))
        targets = torch.tensor(tests[s : s + batch])
        out.append(
            full_catalog_ranks(model, cache, targets, [torch.as_tensor(h) for h in hist], n_items)
        )
    return torch.cat(out).numpy()


def user_ndcg(ranks: np.ndarray) -> np.ndarray:
    """Per-user NDCG@10 (models.metrics' rule) of 0-based full-catalog ranks (U,) -> (U,)."""
    from models.metrics import ndcg_at_k

    return ndcg_at_k(torch.as_tensor(ranks)).numpy()


def ndcg(ranks: np.ndarray) -> tuple[float, float]:
    return float(user_ndcg(ranks).mean()), float((ranks < 10).mean())


def standard_errors(ranks: np.ndarray, base_ranks: np.ndarray) -> dict:
    """How far a row's NDCG@10 can be read: the standard error of its mean over the test users,
    and the PAIRED standard error of its difference to the uncompressed row on the same users.

    One test item a user makes NDCG@10 noisy (~0.006 on 1,000 amazon users), but two rows
    scored on the same users share most of that noise: the paired error of their gap is what
    says whether a configuration is really below the uncompressed ranker.
    """
    row, base = user_ndcg(ranks), user_ndcg(base_ranks)
    if len(row) != len(base):
        raise ValueError(f"{len(row)} users' ranks against {len(base)} uncompressed ones")

    def se(x: np.ndarray) -> float:
        return round(float(x.std(ddof=1) / np.sqrt(len(x))), 5) if len(x) > 1 else float("nan")

    gap = row - base
    return {
        "ndcg10_se": se(row),
        "ndcg10_gap": round(float(gap.mean()), 5),
        "ndcg10_gap_se": se(gap),
    }


INT8 = "int8 KV (scale per token, head)"
# How far a resumed sweep's checkpoint may score from the uncompressed row it stored: a sixth
# of the standard error of NDCG@10 on 1,000 test users (~0.006). Retrained by the same command
# and seed, a checkpoint scores the same test users alike; a different checkpoint under the
# same path (another recipe, another seed) does not, and its rows would not be comparable.
RESUME_TOLERANCE = 0.001


def read_previous(path: str, settings: dict) -> dict:
    """The sweep to resume (its JSON, as written), checked to have been run with ``settings``;
    raises SystemExit naming what differs."""
    try:
        with open(path) as f:
            before = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"--resume: there is no sweep at {path} to resume") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"--resume: {path} is not a sweep's JSON ({e})") from None
    differ = [
        f"{k}: {before.get(k)!r} there, {v!r} now"
        for k, v in settings.items()
        if before.get(k) != v
    ]
    if differ:
        raise SystemExit(
            f"--resume: {path} was run with other settings, so its rows would not compare "
            "with new ones (" + "; ".join(differ) + ")"
        )
    rows = before.get("rows") or []
    if not rows or rows[0].get("method") != "uncompressed fp16 KV":
        raise SystemExit(f"--resume: {path} has no uncompressed row to compare against")
    return before


def unfinished(path: str) -> bool:
    """Whether ``path`` holds a sweep's JSON that was stopped before its last row."""
    try:
        with open(path) as f:
            return json.load(f).get("complete") is False
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return False


def same_base(previous: dict, scored: tuple[float, float]) -> list[dict]:
    """The previous rows, once the checkpoint has scored its uncompressed row within
    RESUME_TOLERANCE of what was stored (NDCG@10, HR@10 in ``scored``)."""
    stored = previous["rows"][0]
    nd, hr = scored
    if abs(nd - stored["ndcg10"]) > RESUME_TOLERANCE:
        raise SystemExit(
            f"--resume: the checkpoint scores NDCG@10 {nd:.4f} (HR@10 {hr:.4f}) uncompressed, "
            f"the sweep being resumed stored {stored['ndcg10']:.4f} (HR@10 {stored['hr10']:.4f}): "
            "it is not the ranker those rows were fitted to"
        )
    log.info(
        "resuming %d rows: the checkpoint scores uncompressed NDCG@10 %.6f, HR@10 %.4f "
        "(stored: %.6f, %.4f)",
        len(previous["rows"]),
        nd,
        hr,
        stored["ndcg10"],
        stored["hr10"],
    )
    return list(previous["rows"])


def main(argv: list[str] | None = None) -> None:
    import polars as pl

    from artifacts import states, storage
    from artifacts.data import load_ranker
    from pipelines import build_user_states, train_kv_pool
    from pipelines.common.jobs import setup_logging
    from pipelines.common.ranker_training import TrainConfig
    from pipelines.evaluate import eval_users

    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_sweep")
    p.add_argument("--dataset-uri", required=True)
    p.add_argument("--checkpoint", required=True, help="the trained, uncompressed ranker")
    p.add_argument("--out", required=True)
    p.add_argument("--pool-sizes", default="256,1024,4096")
    p.add_argument("--user-dims", default="1,2,4,8")
    p.add_argument(
        "--shares",
        default="kv",
        help="comma list of what the pools carry: kv (both, the method), k or v (an ablation)",
    )
    p.add_argument(
        "--configs",
        default="",
        help="explicit M:d_u[:share] list instead of the grid, e.g. 256:1,1024:1,1024:8",
    )
    p.add_argument("--low-ranks", default="4", help="R of the low-rank baselines (2 + 2 d_u)")
    p.add_argument(
        "--int8",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score the int8 KV baseline (--no-int8: skip it when only fits are compared)",
    )
    p.add_argument("--epochs", type=int, default=1, help="fine-tuning epochs per configuration")
    p.add_argument("--lr", type=float, default=train_kv_pool.FINE_TUNE_LR, help="fine-tuning rate")
    p.add_argument(
        "--base-distill-weight",
        type=float,
        default=train_kv_pool.BASE_DISTILL_WEIGHT,
        help="weight of KL(uncompressed || fitted) in each fine-tune (train_kv_pool's option)",
    )
    p.add_argument(
        "--tune",
        choices=["all", "kv"],
        default="all",
        help="what each fine-tune trains (train_kv_pool's option): all weights, or the cache's",
    )
    p.add_argument(
        "--init-tokens",
        type=int,
        default=0,
        help="cached tokens each configuration's pools are fitted to (train_kv_pool's option; "
        f"0: {train_kv_pool.INIT_TOKENS_PER_ENTRY} a pool entry)",
    )
    p.add_argument(
        "--val-users",
        type=int,
        default=32,
        help="users whose validation NDCG@10 picks the fine-tuning epoch",
    )
    p.add_argument("--max-users", type=int, default=200, help="seeded sample of test users")
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="optimizer steps per fine-tuning epoch (0: a whole epoch; cap it on large datasets)",
    )
    p.add_argument(
        "--sample-states",
        action="store_true",
        help="build states for the sampled test users only (router use is then theirs)",
    )
    p.add_argument(
        "--json", default=None, help="default: benchmarks/results/kv_sweep_<dataset>.json"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep already in --json: keep its rows and fit only the rows it "
        "lacks (its settings must be these, and the checkpoint must score its uncompressed "
        "row again)",
    )
    a = p.parse_args(argv)
    shares = a.shares.split(",") + [
        c.split(":")[2] for c in a.configs.split(",") if c.count(":") == 2
    ]
    bad = set(shares) - {"kv", "k", "v"}
    if bad:
        p.error(f"--shares takes kv, k and v, not {sorted(bad)}")
    setup_logging()  # the fitting jobs' epoch lines and the scoring progress, on stderr
    torch.set_num_threads(2)
    dataset_uri = storage.absolute(a.dataset_uri)
    checkpoint = storage.absolute(a.checkpoint)
    marker = storage.read_marker(dataset_uri)
    users = eval_users(dataset_uri, a.max_users, seed=0)
    base, ck_marker, max_len = load_ranker(checkpoint)
    n_items = int(ck_marker["n_items"])
    tc = TrainConfig(
        epochs=a.epochs,
        patience=a.epochs,
        lr=a.lr,
        val_users=a.val_users,
        negatives=63,
        max_steps=a.max_steps,
        base_distill_weight=a.base_distill_weight,
        tune=a.tune,
        ema_decay=0.0,  # as train_kv_pool: a one-epoch fine-tune, no weight average
    )
    path = a.json or f"benchmarks/results/kv_sweep_{marker['name']}.json"
    # what makes two rows comparable: a resumed sweep must have been run with exactly these
    settings = {
        "dataset": marker["name"],
        "checkpoint": checkpoint,
        "test_users": users.height,
        "fine_tune_epochs": a.epochs,
        "fine_tune_max_steps": a.max_steps or None,
        "fine_tune_lr": a.lr,
        "fine_tune_base_distill_weight": a.base_distill_weight,
        "fine_tune_tune": a.tune,
        "fine_tune_val_users": a.val_users,
        "init_tokens": a.init_tokens or f"{train_kv_pool.INIT_TOKENS_PER_ENTRY} an entry",
        "states_of": "sampled test users" if a.sample_states else "all users",
    }
    previous = read_previous(path, settings) if a.resume else None
    if not a.resume and unfinished(path):
        raise SystemExit(
            f"{path} holds a sweep that did not finish: give --resume to continue it, or "
            "another --json (nothing is overwritten)"
        )
    rows: list[dict] = []
    t0 = time.perf_counter()
    seconds_before = float(previous.get("seconds") or 0) if previous else 0.0

    def report(complete: bool) -> None:
        """The JSON so far: rewritten after every row, so a sweep of hours that is stopped
        keeps the rows it finished (``complete`` false until the last)."""
        write(
            path,
            settings
            | {
                "complete": complete,
                "rows": rows,
                "seconds": round(seconds_before + time.perf_counter() - t0, 1),
                "machine": machine(),
            }
            | ({"resumed_rows": len(previous["rows"])} if previous else {}),
        )

    def add(method: str, ratio: float, ranks: np.ndarray, **extra) -> None:
        nd, hr = ndcg(ranks)
        base_ndcg = rows[0]["ndcg10"] if rows else nd  # the uncompressed row comes first
        vs = round(nd / base_ndcg, 4) if base_ndcg else None
        row = {"method": method, "ratio": round(ratio, 5), "ndcg10": nd, "hr10": hr}
        errors = standard_errors(ranks, full_ranks)
        rows.append(row | {"ndcg_vs_uncompressed": vs} | errors | extra)
        print(
            f"{method:<34} ratio {ratio:8.5f}  NDCG@10 {nd:.4f} +- {errors['ndcg10_se']:.4f}  "
            f"gap {errors['ndcg10_gap']:+.4f} +- {errors['ndcg10_gap_se']:.4f} (paired)  "
            f"HR@10 {hr:.4f}  {extra}",
            flush=True,
        )
        report(complete=False)

    full_ranks = ranks_for(base, users, max_len, n_items, lambda h, _: base.prefill(h))
    if previous:
        rows.extend(same_base(previous, ndcg(full_ranks)))
    else:
        add("uncompressed fp16 KV", 1.0, full_ranks)
    done = {r["method"] for r in rows}
    cfg = base.cfg
    per_token_fp16 = 2 * cfg.kv_width * 2
    int8_ratio = 2 * (cfg.kv_width + 2 * cfg.n_kv_heads) / per_token_fp16
    if a.int8 and INT8 not in done:
        add(
            INT8,
            int8_ratio,
            ranks_for(
                base, users, max_len, n_items, lambda h, _: quantize_int8(base.prefill(h))[0]
            ),
        )

    def fitted(run: str, ckv) -> dict:
        return train_kv_pool.fit(
            dataset_uri, checkpoint, a.out, run=run, ckv=ckv, tc=tc, init_tokens=a.init_tokens
        )

    stamp = time.strftime("%H%M%S")
    for r in [int(x) for x in a.low_ranks.split(",") if x]:
        if f"low-rank KV, R={r}" in done:
            continue
        s = low_rank.fit(
            dataset_uri,
            checkpoint,
            a.out,
            run=f"sweep-{stamp}-lowrank-r{r}",
            rank=r,
            tc=tc,
            init_tokens=a.init_tokens,
        )
        model, _ = low_rank.load(s["checkpoint"])
        add(
            f"low-rank KV, R={r}",
            s["ratio"],
            ranks_for(model, users, max_len, n_items, lambda h, _, m=model: m.prefill(h)),
            start_val_ndcg10=s.get("start_val_ndcg10"),
            val_ndcg10=s["val_ndcg10"],
            init_tokens=s.get("init_tokens"),
            fit_seconds=s["seconds"],
        )
    from models.config import CollectiveKVConfig

    grid = [
        (m, du, share)
        for share in a.shares.split(",")
        for m in [int(x) for x in a.pool_sizes.split(",") if x]
        for du in [int(x) for x in a.user_dims.split(",") if x]
    ]
    if a.configs:  # an explicit list instead of the grid
        grid = [
            (int(c.split(":")[0]), int(c.split(":")[1]), (c.split(":") + ["kv"])[2])
            for c in a.configs.split(",")
        ]
    for m, du, share in grid:
        shared = "" if share == "kv" else f", {share.upper()} shared only"
        method = f"CollectiveKV M={m} d_u={du}{shared}"
        if method in done:
            continue
        run = f"sweep-{stamp}-ckv-m{m}-u{du}" + ("" if share == "kv" else f"-share-{share}")
        ckv = CollectiveKVConfig(pool_size=m, user_dim=du, **CollectiveKVConfig.share_flags(share))
        s = fitted(run, ckv=ckv)
        built = build_user_states.build(
            dataset_uri,
            s["checkpoint"],
            a.out,
            run=run,
            user_ids=users["user_id"].to_list() if a.sample_states else None,
        )
        manifest, table = states.read_states(built["user_states"])
        model, _, _ = load_ranker(s["checkpoint"])
        order = users.join(pl.from_arrow(table), on="user_id", how="left")
        layout = states.Layout.of(model.cfg)

        def from_states(h, sl, order=order, layout=layout):
            return states.from_table(order[sl].to_arrow(), layout)

        use = [u[f"{kv}_use"] for u in manifest["router_use"] for kv in share]
        bits = [u[f"{kv}_entropy_bits"] for u in manifest["router_use"] for kv in share]
        add(
            method,
            manifest["ratio"],
            ranks_for(model, users, max_len, n_items, from_states),
            pool_size=m,
            user_dim=du,
            share=share,
            router_use=round(float(np.mean(use)), 4),
            entropy_bits=round(float(np.mean(bits)), 3),
            collapsed=manifest["collapsed_routers"],
            start_val_ndcg10=s.get("start_val_ndcg10"),
            val_ndcg10=s["val_ndcg10"],
            init_tokens=s.get("init_tokens"),
            fit_seconds=s["seconds"],
        )
    report(complete=True)
    print(
        "| method | ratio | NDCG@10 | vs uncompressed | gap (paired SE) | HR@10 | router use "
        "| entropy (bits) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        # rows resumed from a sweep written before the errors were kept have none
        gap = f"{r['ndcg10_gap']:+.4f} ({r['ndcg10_gap_se']:.4f})" if "ndcg10_gap" in r else ""
        print(
            f"| {r['method']} | {r['ratio']:.3%} | {r['ndcg10']:.4f} | "
            f"{r['ndcg_vs_uncompressed']} | {gap} | {r['hr10']:.4f} | "
            f"{r.get('router_use', '')} | {r.get('entropy_bits', '')} |"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

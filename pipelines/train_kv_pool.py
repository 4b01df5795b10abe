"""Fit the CollectiveKV pools of a trained ranker: initialise them from its KV, then fine-tune.

    python -m pipelines.train_kv_pool --dataset-uri out/datasets/ml-latest-small \\
        --checkpoint out/checkpoints/ml-latest-small-text-id --out out \\
        [--pool-size auto|M] [--user-dim 1] [--share kv|k|v] [--init fit|random]
        [--run NAME] [--resume] [--base-distill-weight W] [--tune all|kv] [--init-tokens N]
        [training options of train_ranker: --epochs, --lr, --negatives, ...]

1. **Collect** (Ray Data): an actor pool runs the trained ranker over a seeded sample of users'
   histories and returns, per layer, the hidden states K and V are projected from
   (``Ranker.kv_inputs``), up to ``--init-tokens`` cached tokens in all. By default it takes
   as many users as those tokens need (``--init-users`` caps the users instead): amazon's
   histories are short, and 512 users gave 1,024 pool entries only ~4,000 tokens to fit. By
   default it asks for 50 tokens a pool entry (the job warns under 20), and ``--pool-size
   auto`` (the default) makes M the largest power of two up to 4,096 that the dataset's cached
   tokens fill with 20 each: 1,024 on ml-latest-small (26,415 tokens), 4,096 on amazon
   (~400,000). The stored index is a uint16 either way, so M costs no state bytes.
2. **Initialise**: per layer the shared part of K and of V is vector-quantised by k-means into
   the pool (``models.collective_kv.init_from_projections``). k-means rather than an SVD
   because a CollectiveKV token reads exactly ONE pool entry: that is a codebook, and k-means is
   the least-squares codebook; an SVD basis is what a low-rank (MLA-style) projection would use,
   where a token mixes all components. Routers start as nearest-centroid classifiers and the user
   projections as the trained projection's last d_u rows; every other weight is the trained
   ranker's. ``--init random`` skips this (the paper's from-scratch pools) for comparison.
3. **Fine-tune** (Ray Train, the ranker job's loop): the whole ranker with CollectiveKV on -
   routers, pools, user projections and the rest - on the same MIS objective plus the peak and
   balance losses; checkpoints every epoch, ``--resume``, validation NDCG@10 computed through
   the compressed cache, best epoch published to ``<out>/checkpoints/<run>/``.
   ``--base-distill-weight W`` adds W x KL(trained ranker || this one) over each cut's
   candidates and the catalog softmax, the trained ranker frozen beside it; ``--tune kv``
   trains only the cache's weights (routers, pools, user projections), the rest frozen.

The published checkpoint is what ``build_user_states`` turns into stored user states.

``--share k`` (or ``v``) switches sharing off for the other half: its cached value is the
layer's plain projection, stored whole in fp16 - the ablation of what the pools carry.

The low-rank (MLA-style) KV it is compared with at equal bytes is a benchmark
(``benchmarks/low_rank.py``, run by ``benchmarks.kv_sweep``), fitted through the same steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from artifacts import storage
from models.config import CollectiveKVConfig
from models.errors import InputError
from pipelines.common import cli, jobs
from pipelines.common.kv_inputs import cached_tokens, collect_kv_inputs

log = logging.getLogger("kvrank.train_kv_pool")

# The fine-tune starts from trained weights, so it steps at a fifth of the ranker's rate: on the
# linear-adapter ml ranker, 5e-4 left the stored states at 98.3% of the uncompressed NDCG@10 and
# 1e-4 at 110% (docs/results.md, "CollectiveKV measured").
FINE_TUNE_LR = 1e-4
# weight of KL(trained ranker || compressed) in the fine-tune (train_ranker's
# --base-distill-weight)
BASE_DISTILL_WEIGHT = 1.0
# cached tokens k-means fits each pool entry to unless --init-tokens says otherwise: M 1024 from
# 50,000 kept 97% of amazon's uncompressed NDCG@10 and 102% of ml's; M 4096 from 200,000 (49
# an entry) halved every layer's k-means error and kept 101% on amazon (docs/results.md,
# "CollectiveKV measured")
INIT_TOKENS_PER_ENTRY = 50
# fewer fitted tokens per pool entry than this and the job says to raise --init-tokens
MIN_TOKENS_PER_ENTRY = 20
# --pool-size auto: the largest power of two in this range that the dataset's cached tokens fill
# with MIN_TOKENS_PER_ENTRY each. The stored index is a uint16 whatever M is, so a larger pool
# costs no state bytes; it costs the routers' d_model x M logits per cached token at prefill and
# the fitting time, and 4096 is the largest M measured (ml's 26,415 tokens fill 1024, amazon's
# ~400,000 fill 4096)
AUTO_POOL_SIZES = (16, 4096)


def auto_pool_size(tokens: int) -> int:
    """The pool size ``--pool-size auto`` picks for ``tokens`` cached tokens to fit it to: the
    largest power of two in AUTO_POOL_SIZES with MIN_TOKENS_PER_ENTRY of them an entry (the
    smallest when even that has fewer)."""
    low, m = AUTO_POOL_SIZES
    while m > low and tokens < MIN_TOKENS_PER_ENTRY * m:
        m //= 2
    return m


def default_init_tokens(pool_size: int) -> int:
    """--init-tokens when not given: INIT_TOKENS_PER_ENTRY per pool entry."""
    return INIT_TOKENS_PER_ENTRY * pool_size


def pool_size_arg(text: str) -> int | str:
    """argparse type of --pool-size: a whole number >= 2, or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        msg = f"expected a whole number or 'auto', got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def thin_pool_advice(pool_size: int, tokens: int, asked: int) -> str | None:
    """What to change when k-means fitted ``pool_size`` entries to fewer than
    MIN_TOKENS_PER_ENTRY ``tokens`` each (None when enough). ``asked``: the --init-tokens the
    job was given (0 when --init-users capped the users instead); fewer came back when the
    dataset holds no more, and then only a smaller pool helps (ml-latest-small's e3 ranker has
    26,415 cached tokens: M=1,320 at most)."""
    if tokens >= MIN_TOKENS_PER_ENTRY * pool_size:
        return None
    share = tokens / pool_size
    fitted = f"k-means fitted {pool_size} pool entries to {tokens} tokens ({share:.1f} an entry)"
    if tokens < asked:
        most = tokens // MIN_TOKENS_PER_ENTRY
        return f"{fitted}: the dataset has no more cached tokens, give --pool-size {most} or less"
    need = MIN_TOKENS_PER_ENTRY * pool_size
    return f"{fitted}: give --init-tokens {need} or more, or a smaller --pool-size"


def fit(
    dataset_uri: str,
    checkpoint: str,
    out: str,
    *,
    run: str | None,
    ckv: CollectiveKVConfig | None,
    tc,
    init: str = "fit",
    init_users: int = 0,
    init_tokens: int = 0,
    resume: bool = False,
    pool_size_auto: bool = False,
) -> dict:
    """Collect, initialise and fine-tune (the module's steps 1-3). ``init_tokens`` 0: the
    default for the pool size (``default_init_tokens``). ``pool_size_auto``: ``ckv``'s pool
    size is replaced by ``auto_pool_size`` of the cached tokens there are to fit to."""
    import torch

    from artifacts.data import load_checkpoint
    from models.collective_kv import compression_ratio, init_from_projections
    from models.ranker import Ranker
    from pipelines.common.ranker_training import train

    t0 = time.perf_counter()
    dataset_uri, checkpoint = storage.pinned(dataset_uri), storage.pinned(checkpoint)
    base, marker = load_checkpoint(checkpoint)
    if base.cfg.collective_kv is not None:
        raise InputError(f"{checkpoint} already has CollectiveKV: give an uncompressed ranker")
    dmarker = storage.read_marker(dataset_uri)
    if int(marker["n_items"]) != int(dmarker["items"]):
        raise InputError(
            f"{checkpoint} was trained on {marker['n_items']} items, "
            f"{dataset_uri} has {dmarker['items']}"
        )
    auto: dict = {}
    if pool_size_auto:
        available = cached_tokens(dataset_uri, checkpoint, users=init_users, seed=tc.seed)
        tokens = min(available, init_tokens) if init_tokens else available
        ckv = dataclasses.replace(ckv, pool_size=auto_pool_size(tokens))
        auto = {"pool_size_auto": True, "cached_tokens": available}
        log.info("--pool-size auto: M=%d for the %d cached tokens to fit to", ckv.pool_size, tokens)
    rc = dataclasses.replace(base.cfg, collective_kv=ckv)
    name = run or f"{dmarker['name']}-ckv-m{ckv.pool_size}-u{ckv.user_dim}" + (
        "" if ckv.share == "kv" else f"-share-{ckv.share}"
    )
    model = Ranker(rc, n_items=int(marker["n_items"]))
    # everything but the compressed cache's new modules, which must be all that is missing
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    new = set(model.compressed_kv_parameters())
    if unexpected or not set(missing) <= new:
        raise InputError(
            f"{checkpoint} does not fit the compressed ranker: unexpected {unexpected}, "
            f"missing {sorted(set(missing) - new)}"
        )
    init_stats: dict = {"init": init}
    init_tokens = init_tokens or default_init_tokens(ckv.pool_size)
    if init == "fit" and not resume:
        t_init = time.perf_counter()
        xs, user = collect_kv_inputs(
            checkpoint,
            dataset_uri,
            users=init_users,
            max_tokens=init_tokens,
            vectors_uri=marker.get("vectors_uri"),
            seed=tc.seed,
        )
        for i, (layer, x) in enumerate(zip(model.layers, xs, strict=True)):
            att = layer.self_attn
            stats = init_from_projections(
                att.ckv, torch.from_numpy(x), att.k_proj, att.v_proj, seed=tc.seed + i
            )
            init_stats |= {f"layer{i}_{k}": round(v, 4) for k, v in stats.items()}
        init_stats["init_tokens"] = len(user)
        advice = thin_pool_advice(ckv.pool_size, len(user), 0 if init_users else init_tokens)
        if advice:
            log.warning(advice)
        init_stats["init_seconds"] = round(time.perf_counter() - t_init, 1)
        log.info("pools initialised from %d tokens: %s", len(user), init_stats)
    summary = train(
        dataset_uri,
        marker.get("vectors_uri"),
        out,
        name,
        rc,
        tc,
        resume=resume,
        init_state=model.state_dict() if not resume else None,
        base_uri=checkpoint,
        extra_meta={
            "base_checkpoint": checkpoint,
            "collective_kv": ckv.to_dict(),
            **init_stats,
        },
    )
    ratio = compression_ratio(ckv, rc.n_layers, rc.kv_width)
    return {
        **summary,
        "job": "train_kv_pool",
        "base_checkpoint": checkpoint,
        "pool_size": ckv.pool_size,
        **auto,
        "user_dim": ckv.user_dim,
        "share": ckv.share,
        "ratio": round(ratio, 5),
        "base_distill_weight": tc.base_distill_weight,
        **init_stats,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    from pipelines.common.ranker_training import add_train_args, train_config

    p = cli.job_parser("train_kv_pool", __doc__)
    p.add_argument("--dataset-uri", required=True, help="the prepared dataset the ranker learned")
    p.add_argument("--checkpoint", required=True, help="the trained (uncompressed) ranker")
    p.add_argument("--out", required=True, help="checkpoints go to <out>/checkpoints/<run>/")
    p.add_argument("--run", default=None, help="default: <dataset>-ckv-m<M>-u<d_u>")
    p.add_argument("--resume", action="store_true", help="continue the run's latest checkpoint")
    g = p.add_argument_group("CollectiveKV")
    g.add_argument(
        "--pool-size",
        type=pool_size_arg,
        default="auto",
        help="M, entries per pool (stored as a uint16 index up to 65,536); auto: the largest "
        f"power of two up to {AUTO_POOL_SIZES[1]} that the cached tokens fill with "
        f"{MIN_TOKENS_PER_ENTRY} each",
    )
    g.add_argument("--user-dim", type=int, default=1, help="d_u, user numbers per K and per V")
    g.add_argument(
        "--share",
        choices=["kv", "k", "v"],
        default="kv",
        help="what the pools carry: kv (both, the method), k or v (the other stored in full)",
    )
    g.add_argument(
        "--peak-weight", type=float, default=0.01, help="weight of the routers' peak loss"
    )
    g.add_argument(
        "--balance-weight",
        type=float,
        default=0.01,
        help="weight of the routers' balance loss (pool entries used evenly)",
    )
    g.add_argument(
        "--init",
        choices=["fit", "random"],
        default="fit",
        help="fit: k-means pools from the trained KV; random: from scratch",
    )
    g.add_argument(
        "--init-users",
        type=int,
        default=0,
        help="users whose KV the pools are fitted to (0: as many as --init-tokens need)",
    )
    g.add_argument(
        "--init-tokens",
        type=int,
        default=0,
        help=f"cached tokens the pools are fitted to (0: {INIT_TOKENS_PER_ENTRY} an entry)",
    )
    add_train_args(p)
    # fine-tuning from a trained ranker needs far fewer epochs than training it; over so few
    # steps a weight average would mostly hold the starting weights, so it is off; the low
    # learning rate keeps the raw weights near the averaged ones the base published instead
    # and it distils from the trained ranker: on amazon's a6 that took the default state from
    # 94% to 97% of the uncompressed NDCG@10 (docs/results.md, "CollectiveKV measured")
    p.set_defaults(
        epochs=4,
        patience=2,
        lr=FINE_TUNE_LR,
        val_users=128,
        ema_decay=0.0,
        base_distill_weight=BASE_DISTILL_WEIGHT,
    )
    a = cli.parse(p, argv)

    def job() -> dict:
        if a.init_users < 0 or a.init_tokens < 0:
            raise InputError("--init-users and --init-tokens must be >= 0")
        auto = a.pool_size == "auto"
        ckv = CollectiveKVConfig(
            # auto: fit() sizes it once it has checked the dataset and checkpoint
            pool_size=CollectiveKVConfig.pool_size if auto else a.pool_size,
            user_dim=a.user_dim,
            peak_weight=a.peak_weight,
            balance_weight=a.balance_weight,
            **CollectiveKVConfig.share_flags(a.share),
        )
        return fit(
            a.dataset_uri,
            a.checkpoint,
            a.out,
            run=a.run,
            ckv=ckv,
            tc=train_config(a),
            init=a.init,
            init_users=a.init_users,
            init_tokens=a.init_tokens,
            resume=a.resume,
            pool_size_auto=auto,
        )

    return jobs.run(job)


if __name__ == "__main__":
    sys.exit(main())

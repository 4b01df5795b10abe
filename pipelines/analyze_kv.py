"""Analyse a trained ranker's history KV: how low-rank it is, and how much of it users share.

    python -m pipelines.analyze_kv --dataset-uri out/datasets/ml-latest-small \\
        --checkpoint out/checkpoints/ml-latest-small-text-id --out out [--users 128] [--rank 8]

Ray Data runs the ranker over a seeded sample of users' histories (``train_kv_pool``'s actor
pool) and collects each layer's K and V of the cached tokens, before rotary (the position-free
part CollectiveKV stores). Per layer, for K and for V:

- **spectrum**: the singular values of all sampled tokens' K (or V), and the share of energy
  (sum of squared singular values) in the top r components, r in 1, 4, 16, 64 and ``rank``;
  also with the mean token removed (the mean alone often carries most of the energy);
- **sharing across users**: each user's own top-``rank`` principal subspace, and the top-``rank``
  subspace of their residual (their K minus its projection on the global top-``rank``
  subspace). For every pair of users, the overlap ||P_a^T P_b||_F^2 / rank of those subspaces
  (1: the same subspace, ``rank / width``: what two random subspaces give). CollectiveKV rests on
  principal parts that overlap much more across users than the residuals do: the shared part
  can come from a pool, the small user-specific rest from d_u numbers.

Writes ``<out>/reports/<name>-kv/``: analysis.json, spectrum.png, sharing.png.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import time

import numpy as np

from artifacts import storage
from models.errors import InputError
from pipelines.common import cli, jobs

log = logging.getLogger("kvrank.analyze_kv")

ENERGY_RANKS = (1, 4, 16, 64)


def subspace(m, rank: int):
    """Top-``rank`` right singular vectors of m (n, width) as rows (rank, width)."""
    import torch

    return torch.linalg.svd(m, full_matrices=False).Vh[:rank]


def mean_pairwise_overlap(bases) -> float:
    """Mean over pairs a < b of ||P_a P_b^T||_F^2 / rank for bases (U, rank, width)."""
    import torch

    u, r, w = bases.shape
    if u < 2:
        return float("nan")
    g = bases.reshape(u * r, w) @ bases.reshape(u * r, w).T
    blocks = (g.reshape(u, r, u, r) ** 2).sum(dim=(1, 3)) / r
    off = ~torch.eye(u, dtype=torch.bool)
    return float(blocks[off].mean())


def analyse_matrix(m, users: np.ndarray, rank: int) -> dict:
    """Spectrum and cross-user sharing of one layer's K or V (tokens, width) in float64."""
    import torch

    def cumulative(a):
        e = torch.linalg.svdvals(a) ** 2
        return torch.cumsum(e / e.sum(), 0)

    s = torch.linalg.svdvals(m)
    cum = torch.cumsum(s**2 / (s**2).sum(), 0)
    # without the mean token, which alone carries much of the energy
    cum_centered = cumulative(m - m.mean(0, keepdim=True))
    global_basis = subspace(m, rank)
    principal, residual = [], []
    for u in np.unique(users):
        mu = m[torch.from_numpy(users == u)]
        if mu.shape[0] < 2 * rank:
            continue
        principal.append(subspace(mu, rank))
        res = mu - (mu @ global_basis.T) @ global_basis
        residual.append(subspace(res, rank))
    width = m.shape[1]
    return {
        "singular_values": (s / s[0]).tolist(),
        "energy_top": {
            str(r): float(cum[min(r, len(cum)) - 1]) for r in sorted({*ENERGY_RANKS, rank})
        },
        "energy_top_centered": {
            str(r): float(cum_centered[min(r, len(cum)) - 1]) for r in sorted({*ENERGY_RANKS, rank})
        },
        "users_compared": len(principal),
        "principal_overlap": mean_pairwise_overlap(torch.stack(principal)) if principal else None,
        "residual_overlap": mean_pairwise_overlap(torch.stack(residual)) if residual else None,
        "random_overlap": rank / width,
    }


def plots(result: dict) -> tuple[bytes, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def png(fig) -> bytes:
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=120)
        plt.close(fig)
        return buf.getvalue()

    fig, ax = plt.subplots(figsize=(7, 4))
    for layer in result["layers"]:
        for kv, style in (("k", "-"), ("v", "--")):
            sv = np.asarray(layer[kv]["singular_values"])
            cum = np.cumsum(sv**2) / np.sum(sv**2)
            ax.plot(np.arange(1, len(cum) + 1), cum, style, label=f"layer {layer['layer']} {kv}")
    ax.set_xscale("log")
    ax.set_xlabel("components")
    ax.set_ylabel("share of energy")
    ax.set_title("K and V spectrum of cached history tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    spectrum = png(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    names, principal, residual = [], [], []
    for layer in result["layers"]:
        for kv in ("k", "v"):
            names.append(f"L{layer['layer']} {kv}")
            principal.append(layer[kv]["principal_overlap"] or 0.0)
            residual.append(layer[kv]["residual_overlap"] or 0.0)
    x = np.arange(len(names))
    ax.bar(x - 0.2, principal, 0.4, label="principal subspace")
    ax.bar(x + 0.2, residual, 0.4, label="residual subspace")
    ax.axhline(result["rank"] / result["kv_width"], color="gray", ls=":", label="random")
    ax.set_xticks(x, names)
    ax.set_ylabel(f"mean overlap across users (rank {result['rank']})")
    ax.legend()
    sharing = png(fig)
    return spectrum, sharing


def analyze(
    dataset_uri: str,
    checkpoint: str,
    out: str,
    *,
    users: int = 128,
    rank: int = 8,
    max_tokens: int = 50_000,
    report: str | None = None,
    seed: int = 0,
) -> dict:
    import torch

    from artifacts.data import load_checkpoint
    from pipelines.common.kv_inputs import collect_kv_inputs

    t0 = time.perf_counter()
    dataset_uri, checkpoint = storage.pinned(dataset_uri), storage.pinned(checkpoint)
    model, marker = load_checkpoint(checkpoint)
    if rank <= 0 or rank * 2 > model.cfg.kv_width:
        raise InputError(f"--rank must be in 1..{model.cfg.kv_width // 2}, got {rank}")
    xs, user = collect_kv_inputs(
        checkpoint,
        dataset_uri,
        users=users,
        max_tokens=max_tokens,
        vectors_uri=marker.get("vectors_uri"),
        min_history=2 * rank,
        seed=seed,
    )
    layers = []
    with torch.no_grad():
        for i, (layer, x) in enumerate(zip(model.layers, xs, strict=True)):
            att = layer.self_attn
            if att.ckv is not None:
                raise InputError(f"{checkpoint} uses CollectiveKV: analyse the uncompressed ranker")
            xt = torch.from_numpy(x)
            row = {"layer": i}
            for kv, proj in (("k", att.k_proj), ("v", att.v_proj)):
                row[kv] = analyse_matrix(proj(xt).double(), user, rank)
            layers.append(row)
            log.info(
                "layer %d: K top-%d energy %.3f, overlap principal %.3f vs residual %.3f",
                i,
                rank,
                row["k"]["energy_top"].get(str(rank), float("nan")),
                row["k"]["principal_overlap"] or float("nan"),
                row["k"]["residual_overlap"] or float("nan"),
            )
    result = {
        "dataset_uri": dataset_uri,
        "checkpoint": checkpoint,
        "tokens": int(len(user)),
        "users": int(len(np.unique(user))),
        "rank": rank,
        "kv_width": model.cfg.kv_width,
        "layers": layers,
    }
    name = report or storage.name_of(checkpoint) + "-kv"
    target = storage.join(out, "reports", name)
    spectrum, sharing = plots(result)
    pub = storage.Publication(target)
    try:
        pub.put_bytes("analysis.json", json.dumps(result, indent=2).encode())
        pub.put_bytes("spectrum.png", spectrum)
        pub.put_bytes("sharing.png", sharing)
        pub.publish({"kind": "kv_analysis", "checkpoint": checkpoint, "tokens": len(user)})
    except BaseException:
        pub.discard()
        raise
    summary = {"job": "analyze_kv", "tokens": result["tokens"], "users": result["users"]}
    for row in layers:
        for kv in ("k", "v"):
            a = row[kv]
            p = f"layer{row['layer']}_{kv}"
            summary[f"{p}_energy_top{rank}"] = round(a["energy_top"].get(str(rank), -1.0), 4)
            summary[f"{p}_principal_overlap"] = round(a["principal_overlap"] or 0.0, 4)
            summary[f"{p}_residual_overlap"] = round(a["residual_overlap"] or 0.0, 4)
    summary["random_overlap"] = round(rank / model.cfg.kv_width, 4)
    summary["report"] = pub.uri  # the version folder: the files to open
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = cli.job_parser("analyze_kv", __doc__)
    p.add_argument("--dataset-uri", required=True, help="the prepared dataset the ranker learned")
    p.add_argument("--checkpoint", required=True, help="a trained, uncompressed ranker")
    p.add_argument("--out", required=True, help="the report goes to <out>/reports/<name>/")
    p.add_argument("--users", type=int, default=128, help="users sampled (with 2*rank+ tokens)")
    p.add_argument("--rank", type=int, default=8, help="r of the principal subspaces")
    p.add_argument("--max-tokens", type=int, default=50_000, help="cached tokens analysed at most")
    p.add_argument("--report", default=None, help="report name (default: <checkpoint>-kv)")
    a = cli.parse(p, argv)
    if a.users < 2 or a.max_tokens <= 0:
        p.error("--users must be >= 2 and --max-tokens > 0")
    return jobs.run(
        lambda: analyze(
            a.dataset_uri,
            a.checkpoint,
            a.out,
            users=a.users,
            rank=a.rank,
            max_tokens=a.max_tokens,
            report=a.report,
        )
    )


if __name__ == "__main__":
    sys.exit(main())

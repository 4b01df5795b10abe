"""The ranker replica's work on one device, checked and timed: pure PyTorch, no Ray, no files.

    python -m benchmarks.gpu_check --device cuda [--out benchmarks/results]
    python -m benchmarks.gpu_check --device cpu  # a few seconds: the CI test runs this

The GPU machines this project is sometimes lent have PyTorch with CUDA and nothing else (no Ray,
no vLLM, no package index) for about 15 minutes, so this is one short script that needs only
``models/`` and synthetic inputs of the default layout. It writes
``<out>/gpu_check_<device>.json`` and prints one JSON line; it exits 1 when a numeric check
fails. What it runs:

1. ``mis``: multi-item scoring in bf16 for one user, history 50 and 200, candidates 16, 100 and
   1000; on CUDA replayed from a captured CUDA graph (the serving call reads nothing back to the
   host, so it captures). Scores/s and the share of this device's measured bf16 matmul peak.
2. ``batch``: 32-4096 users' CollectiveKV states, held on the host as a store holds them, copied
   to the device, expanded from the pools and scored (100 candidates each) in one pass:
   scores/s and the split between expand (copy included) and score.
3. ``train``: optimizer steps of the (plain) ranker with train_ranker's loss - the softmax over
   each cut's candidates plus the user token's full-catalog softmax after every position -
   on windows of up to 50 items: windows/s and the share of real (non-padding) history tokens.
4. ``round_trip_s``: the smallest call's cost (a one-kernel graph replayed and waited for), the
   floor under every per-request figure above.
5. ``checks``: graph replay equals eager scoring (bf16 tolerance; CUDA only), MIS equals
   scoring each candidate alone (fp32), and expand(compress) equals the K/V the forward
   computed on the fly, bit for bit, after a trip through the host.

The ranker is the default ``RankerConfig`` with ``text+id`` item inputs (the measured recipe's
input); its CollectiveKV twin uses M=4096, d_u=1 (what ``train_kv_pool``'s automatic size picks
on amazon-videogames-2018). Weights are random: the figures are costs, not quality.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import report as report_file
from benchmarks.scoring import cuda_graph, peak_matmul, step_flops, timeit
from models.batches import training_batch
from models.config import CollectiveKVConfig, RankerConfig
from models.inputs import CompressedCache, History
from models.ranker import Ranker, ranking_loss

N_ITEMS = 20_000
RECIPE = RankerConfig()  # the defaults are the measured recipe (text+id, width 64)
CKV = dataclasses.replace(RECIPE, collective_kv=CollectiveKVConfig(pool_size=4096, user_dim=1))
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}
SIZES = {  # per device: what a few seconds on a CPU allows, and the sizes on a GPU
    "cpu": {"lengths": [50], "candidates": [16, 100], "users": [32], "train_steps": 3},
    "cuda": {
        "lengths": [50, 200],
        "candidates": [16, 100, 1000],
        "users": [32, 256, 1024, 4096],
        "train_steps": 30,
    },
}


def ranker(cfg: RankerConfig, device: str, dtype: torch.dtype, seed: int = 0) -> Ranker:
    torch.manual_seed(seed)
    model = Ranker(cfg, n_items=N_ITEMS)
    model.set_item_table(torch.randn(N_ITEMS, cfg.item_dim))
    return model.to(device=device, dtype=dtype)


def histories(users: int, max_len: int, device: str, seed: int, full: bool = False) -> History:
    """``users`` random histories of 1..max_len items (all ``max_len`` with ``full``)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (
        [max_len] * users if full else torch.randint(1, max_len + 1, (users,), generator=g).tolist()
    )
    vids = [torch.randint(0, N_ITEMS, (n,), generator=g).tolist() for n in lengths]
    fb = [torch.randint(-1, 5, (n,), generator=g).tolist() for n in lengths]
    return History.from_lists(vids, fb, device=device)


def on(cache: CompressedCache, device: str | torch.device) -> CompressedCache:
    return CompressedCache(
        [s.map(lambda t: t.to(device)) for s in cache.layers], cache.lengths.to(device)
    )


def candidates(users: int, n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, N_ITEMS, (users, n), generator=g).to(device)


@torch.inference_mode()
def mis_rows(device: str, sizes: dict, peak: float, checks: dict) -> list[dict]:
    """Section 1, and the graph-replay check of section 4."""
    model = ranker(RECIPE, device, torch.bfloat16).eval()
    rows, worst, close = [], 0.0, True
    for t in sizes["lengths"]:
        cache = model.prefill(histories(1, t, device, seed=t, full=True))
        for n in sizes["candidates"]:
            cands = candidates(1, n, device, seed=t + n)
            eager = lambda c=cands, kv=cache: model.score(kv, c)  # noqa: E731
            run, graph = eager, device == "cuda"
            if graph:
                run = cuda_graph(eager)
                replayed, expected = run().float().clone(), eager().float()
                close &= torch.allclose(replayed, expected, **BF16_TOL)
                worst = max(worst, (replayed - expected).abs().max().item())
            sec = timeit(run, device)
            rows.append(
                {
                    "history_length": t,
                    "candidates": n,
                    "cuda_graph": graph,
                    "seconds": sec,
                    "scores_per_s": n / sec,
                    "share_of_peak": step_flops(RECIPE, n + 1, t + 2) / sec / peak,
                }
            )
            print(f"mis T={t} N={n}: {n / sec:,.0f} scores/s", file=sys.stderr)
    checks["graph_replay_equals_eager"] = (
        {"ok": close, "max_abs_diff": worst} if device == "cuda" else {"ok": None, "why": "no CUDA"}
    )
    return rows


def expand_then_score(
    model: Ranker, stored: CompressedCache, cands: torch.Tensor, device: str
) -> tuple[float, float]:
    """Seconds of (copy to the device + expand, score) for one pass over the batch."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    kv = model.expand(on(stored, device))
    sync()
    t1 = time.perf_counter()
    model.score(kv, cands)
    sync()
    return t1 - t0, time.perf_counter() - t1


@torch.inference_mode()
def batch_rows(device: str, sizes: dict, per_user: int = 100) -> list[dict]:
    """Section 2: stored states on the host -> device -> expand -> one MIS pass."""
    model = ranker(CKV, device, torch.bfloat16).eval()
    rows = []
    for users in sizes["users"]:
        stored = on(model.prefill(histories(users, 50, device, seed=users)), "cpu")
        cands = candidates(users, per_user, device, seed=users + 1)
        expand_then_score(model, stored, cands, device)  # warm-up
        split = np.median([expand_then_score(model, stored, cands, device) for _ in range(5)], 0)
        expand_s, score_s = map(float, split)
        scored = users * per_user
        rows.append(
            {
                "users": users,
                "candidates_per_user": per_user,
                "tokens": int(stored.lengths.sum()),
                "state_bytes": sum(s.nbytes(stored.lengths) for s in stored.layers),
                "expand_s": expand_s,
                "score_s": score_s,
                "expand_share": expand_s / (expand_s + score_s),
                "scores_per_s": scored / (expand_s + score_s),
            }
        )
        print(f"batch of {users}: {scored / (expand_s + score_s):,.0f} scores/s", file=sys.stderr)
    return rows


def train_row(device: str, steps: int, batch: int = 32, cuts: int = 4, negatives: int = 31) -> dict:
    """Section 3: ``steps`` timed optimizer steps (after two warm-up steps) on windows of up
    to 50 items, fp32 as the trainer runs."""
    model = ranker(RECIPE, device, torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    seconds, real, computed = 0.0, 0, 0
    for step in range(steps + 2):
        seqs = [rng.integers(0, N_ITEMS, rng.integers(2, 52)) for _ in range(batch)]
        fbs = [rng.integers(-1, 5, len(s)) for s in seqs]
        tb = training_batch(
            seqs, fbs, rng, n_items=N_ITEMS, max_len=50, cuts=cuts, negatives=negatives
        )
        h = tb.history
        h = History(h.vids.to(device), h.feedback.to(device), h.lengths.to(device))
        sync()
        t0 = time.perf_counter()
        next_vids = tb.next_vids.to(device)
        rows = next_vids >= 0
        out = model(h, tb.candidates.to(device), cut=tb.cut.to(device), catalog=rows)
        scores = out.scores.view(-1, 1 + negatives)
        loss = ranking_loss(scores, torch.zeros(len(scores), dtype=torch.long, device=device))
        loss = loss + F.cross_entropy(out.catalog, next_vids[rows]) + out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        if step >= 2:
            seconds += time.perf_counter() - t0
            real += int(h.lengths.sum())
            computed += h.vids.numel()
    row = {
        "steps": steps,
        "windows_per_step": batch,
        "seconds": seconds,
        "windows_per_s": steps * batch / seconds,
        "real_token_share": real / computed,
    }
    print(f"train: {row['windows_per_s']:,.0f} windows/s", file=sys.stderr)
    return row


def round_trip(device: str) -> float:
    """Seconds of the smallest call there is: one captured one-kernel graph replayed and waited
    for on CUDA (one trivial op on the CPU). Every scoring call pays at least this."""
    x = torch.zeros(1, device=device)
    op = lambda: x.add_(1)  # noqa: E731
    return timeit(cuda_graph(op) if device == "cuda" else op, device)


@torch.no_grad()
def exactness_checks(device: str, checks: dict) -> None:
    """Section 4: MIS = each candidate alone (fp32), expand(compress) = K/V on the fly."""
    model = ranker(RECIPE, device, torch.float32).eval()
    h = histories(4, 50, device, seed=7)
    cands = candidates(4, 16, device, seed=8)
    together = model.score(model.prefill(h), cands)
    alone = torch.stack([model.score_reference(h, cands[:, j : j + 1])[:, 0] for j in range(16)], 1)
    diff = (together - alone).abs().max().item()
    checks["mis_equals_each_candidate_alone"] = {"ok": diff <= 1e-4, "max_abs_diff": diff}

    model = ranker(CKV, device, torch.float32).eval()
    p = model._prefill(h)
    expanded = model.expand(on(on(p.state, "cpu"), device))  # stored on the host, then back
    valid = p.kv.valid()
    exact = all(
        torch.equal(fly.transpose(1, 2)[valid], got.transpose(1, 2)[valid])
        for fly, got in zip(p.kv.k + p.kv.v, expanded.k + expanded.v, strict=True)
    )
    checks["expand_of_compressed_equals_kv_on_the_fly"] = {"ok": exact}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=sorted(SIZES), default="cuda")
    p.add_argument("--out", default="benchmarks/results", help="folder of the JSON report")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    started = time.perf_counter()
    sizes = SIZES[a.device]
    peak = peak_matmul(torch.bfloat16, a.device, n=8192 if a.device == "cuda" else 512)
    checks: dict[str, dict] = {}
    exactness_checks(a.device, checks)
    report = {
        "benchmark": "gpu_check",
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "machine": report_file.machine(),
        "ranker": RECIPE.to_dict(),
        "collective_kv": CKV.collective_kv.to_dict(),
        "n_items": N_ITEMS,
        "peak_bf16_matmul_gflop_per_s": peak / 1e9,
        "round_trip_s": round_trip(a.device),
        "mis": mis_rows(a.device, sizes, peak, checks),
        "batch": batch_rows(a.device, sizes),
        "train": train_row(a.device, sizes["train_steps"]),
        "checks": checks,
    }
    ok = all(c["ok"] is not False for c in checks.values())
    report["ok"], report["seconds"] = ok, time.perf_counter() - started
    path = f"{a.out.rstrip('/')}/gpu_check_{a.device}.json"
    report_file.write(path, report)
    best = max(report["mis"], key=lambda r: r["scores_per_s"])
    summary = {
        "benchmark": "gpu_check",
        "device": report["device"],
        "ok": ok,
        "mis_scores_per_s_max": round(best["scores_per_s"]),
        "batch_scores_per_s_max": round(max(r["scores_per_s"] for r in report["batch"])),
        "train_windows_per_s": round(report["train"]["windows_per_s"], 1),
        "seconds": round(report["seconds"], 1),
        "out": path,
    }
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

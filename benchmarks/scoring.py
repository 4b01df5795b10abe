"""Candidate scores per second, four ways, for the default ranker (KV width 256).

    python -m benchmarks.scoring [--dtype fp32|bf16] [--device cpu|cuda] [--cuda-graph]
                                 [--out benchmarks/results/scoring.json]

(a) full:      each candidate gets its own full forward over [BOS] history + candidate, batched
               (how a text cross-encoder is usually served);
(b) prefix:    the history is prefilled once and each candidate runs alone against that cache
               (what prefix caching gives a per-candidate request);
(c) mis:       all candidates in one multi-item-scoring pass against the cached history KV;
(d) mis_ckv:   (c) from the CollectiveKV compressed state, expand included.

The history prefill is not timed in (b), (c), (d): in serving it is cached. (a) and (b) cost the
same per candidate whatever N is, so they are timed on at most ``--sample`` candidates and the
rate is candidates / time. FLOPs are counted from the shapes each path actually computes (the
dense path's full S x S attention included), and reported against this machine's measured peak
matmul rate in the same run - a share that holds across noisy machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks import report as report_file
from models.collective_kv import compression_ratio
from models.config import CollectiveKVConfig, RankerConfig
from models.ranker import History, Ranker

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timeit(
    fn: Callable[[], object], device: str, min_time: float = 0.6, min_reps: int = 3
) -> float:
    """Median seconds per call after a warm-up; at least ``min_reps`` calls and ``min_time``."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


def peak_matmul(dtype: torch.dtype, device: str, n: int = 2048) -> float:
    """FLOP/s of a large square matmul: the practical ceiling for this dtype here."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timeit(lambda: a @ b, device, min_time=1.0)


def step_flops(cfg: RankerConfig, n_tokens: int, keys_per_token: float) -> float:
    """FLOPs of the decoder + adapter + head for ``n_tokens`` tokens that each attend to
    ``keys_per_token`` keys."""
    d, qw, kvw = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_width
    per_layer = (
        2 * n_tokens * d * (2 * qw + 2 * kvw)  # q, k, v, o projections
        + 6 * n_tokens * d * cfg.ffn_dim  # SwiGLU
        + 4 * n_tokens * cfg.n_heads * cfg.head_dim * keys_per_token  # QK^T and PV
    )
    adapter = 2 * n_tokens * cfg.item_dim * d
    return cfg.n_layers * per_layer + adapter + 2 * n_tokens * d


def build(cfg: RankerConfig, n_items: int, dtype: torch.dtype, device: str) -> Ranker:
    torch.manual_seed(0)
    model = Ranker(cfg, n_items=n_items).to(device=device, dtype=dtype).eval()
    model.set_item_table(torch.randn(n_items, cfg.item_dim))
    return model


def bench_one(
    model: Ranker,
    ckv_model: Ranker,
    t: int,
    n: int,
    n_items: int,
    sample: int,
    device: str,
    chunk: int,
    graph: bool,
) -> dict:
    cfg = model.cfg
    g = torch.Generator().manual_seed(t * 10_000 + n)
    hist = History.from_lists(
        [torch.randint(0, n_items, (t,), generator=g).tolist()],
        [torch.randint(0, 5, (t,), generator=g).tolist()],
        device=device,
    )
    cands = torch.randint(0, n_items, (1, n), generator=g).to(device)
    k = min(n, sample)
    out: dict[str, dict] = {}
    with torch.inference_mode():
        cache = model.prefill(hist)
        state = ckv_model.prefill(hist)

        def full() -> None:  # (a): one full forward per candidate, in batches of `chunk`
            for i in range(0, k, chunk):
                c = cands[:, i : i + chunk].T  # (b, 1): one sequence per candidate
                b = c.shape[0]
                rep = History(
                    hist.vids.expand(b, -1), hist.feedback.expand(b, -1), hist.lengths.expand(b)
                )
                model.score_reference(rep, c)

        def prefix() -> None:  # (b): the cached history, one candidate per forward
            for j in range(k):
                model.score(cache, cands[:, j : j + 1])

        mis = lambda: model.score(cache, cands)  # noqa: E731 - (c)
        mis_ckv = lambda: ckv_model.score(state, cands)  # noqa: E731 - (d)
        if graph:
            mis, mis_ckv = cuda_graph(mis), cuda_graph(mis_ckv)
        s = t + 2
        runs = {
            "full": (full, k, k * step_flops(cfg, s, s)),
            "prefix": (prefix, k, k * step_flops(cfg, 1, t + 2)),
            "mis": (mis, n, step_flops(cfg, n, t + 2)),
            "mis_ckv": (mis_ckv, n, step_flops(cfg, n, t + 2)),
        }
        for name, (fn, scored, flops) in runs.items():
            sec = timeit(fn, device)
            out[name] = {
                "scores_per_s": scored / sec,
                "seconds": sec,
                "candidates_timed": scored,
                "gflop_per_s": flops / sec / 1e9,
            }
    return out


def cuda_graph(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Capture ``fn`` (fixed shapes) in a CUDA graph and return its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return result

    return replay


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cuda-graph", action="store_true", help="replay (c) and (d) from CUDA graphs")
    p.add_argument("--lengths", default="50,200")
    p.add_argument("--candidates", default="16,100,1000")
    p.add_argument("--sample", type=int, default=64, help="candidates timed for (a) and (b)")
    p.add_argument("--chunk", type=int, default=32, help="sequences per forward in (a)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dtype, device = DTYPES[a.dtype], a.device
    if a.cuda_graph and device != "cuda":
        p.error("--cuda-graph needs --device cuda")
    suffix = "" if (a.dtype, device) == ("fp32", "cpu") else f"_{device}_{a.dtype}"
    out_path = a.out or f"benchmarks/results/scoring{suffix}.json"
    n_items = 20_000
    # a serving-sized ranker, 4x the recipe's width (what the committed results measure)
    cfg = RankerConfig(d_model=256, ffn_dim=768, dropout=0.0, item_input="text")
    ckv_cfg = dataclasses.replace(cfg, collective_kv=CollectiveKVConfig(pool_size=1024, user_dim=1))
    model = build(cfg, n_items, dtype, device)
    ckv_model = build(ckv_cfg, n_items, dtype, device)
    peak = {"fp32": peak_matmul(torch.float32, device)}
    peak[a.dtype] = peak.get(a.dtype) or peak_matmul(dtype, device)
    print(
        f"peak matmul: {', '.join(f'{k} {v / 1e9:.1f} GFLOP/s' for k, v in peak.items())}",
        file=sys.stderr,
    )
    rows = []
    for t in map(int, a.lengths.split(",")):
        for n in map(int, a.candidates.split(",")):
            res = bench_one(
                model, ckv_model, t, n, n_items, a.sample, device, a.chunk, a.cuda_graph
            )
            for r in res.values():
                r["share_of_peak"] = r["gflop_per_s"] * 1e9 / peak[a.dtype]
            rows.append(
                {
                    "history_length": t,
                    "candidates": n,
                    **res,
                    "ratio_mis_over_full": res["mis"]["scores_per_s"] / res["full"]["scores_per_s"],
                    "ratio_mis_over_prefix": res["mis"]["scores_per_s"]
                    / res["prefix"]["scores_per_s"],
                    "ratio_ckv_over_mis": res["mis_ckv"]["scores_per_s"]
                    / res["mis"]["scores_per_s"],
                }
            )
            print(
                f"T={t:4d} N={n:5d} "
                + " ".join(
                    f"{k}={v['scores_per_s']:,.0f}/s({v['share_of_peak']:.0%})"
                    for k, v in res.items()
                ),
                file=sys.stderr,
            )
    per_token_full = cfg.n_layers * 2 * cfg.kv_width * 2
    report = {
        "benchmark": "scoring",
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "dtype": a.dtype,
        "cuda_graph": a.cuda_graph,
        "threads": torch.get_num_threads(),
        "machine": report_file.machine(),
        "ranker": cfg.to_dict(),
        "collective_kv": ckv_cfg.collective_kv.to_dict(),
        "peak_matmul_gflop_per_s": {k: v / 1e9 for k, v in peak.items()},
        "bytes_per_user": {
            str(t): {
                "full_kv_fp16": (t + 1) * per_token_full,
                "collective_kv_state": round(
                    (t + 1)
                    * per_token_full
                    * compression_ratio(ckv_cfg.collective_kv, cfg.n_layers, cfg.kv_width)
                ),
            }
            for t in map(int, a.lengths.split(","))
        },
        "state_over_full_kv": compression_ratio(ckv_cfg.collective_kv, cfg.n_layers, cfg.kv_width),
        "results": rows,
    }
    report_file.write(out_path, report)
    print(
        json.dumps(
            {k: report[k] for k in ("benchmark", "device", "dtype", "state_over_full_kv")}
            | {"out": out_path}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

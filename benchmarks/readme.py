"""The README's results tables, rendered from the committed JSON in ``benchmarks/results/``.

    python -m benchmarks.readme            # rewrite the README's results block
    python -m benchmarks.readme --check    # exit 1 when the README differs from the JSON

The block sits between the two marker lines below; everything else in the README is prose. A
test checks the committed README against this rendering, so a figure in the tables is always
the one in the JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN = "<!-- results: rendered by python -m benchmarks.readme from benchmarks/results/ -->"
END = "<!-- results: end -->"
DATASETS = ("ml-latest-small", "amazon-videogames-2018")


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def quality() -> list[str]:
    out = [
        "| dataset (test users) | ranker | **served: ranker + item prior** | item prior alone "
        "| most popular | target | SASRec | measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ds in DATASETS:
        report = load(f"quality_{ds}.json")
        ev = next(s for s in report["stages"] if s["stage"] == "evaluate")
        ref = report["references"]

        def cell(m: str, ev: dict = ev) -> str:
            return f"{ev[f'{m}_full_ndcg10']:.4f} / {ev[f'{m}_full_hr10']:.3f}"

        gain = ev["served_minus_prior_ndcg10"] / ev["item_prior_full_ndcg10"]
        out.append(
            f"| {ds} ({ev['users']:,}) | {cell('ranker')} | **{cell('ranker_prior')}** "
            f"(weight {ev['fusion_weight']:g}; {gain:+.1%} against the prior, paired s.e. "
            f"{ev['served_minus_prior_se']}) | {cell('item_prior')} | {cell('most_popular')} "
            f"| {ref['target_ndcg10']} | {ref['sasrec_ndcg10']} / {ref['sasrec_hr10']} "
            f"| {report['date']}, `{report['recipe']}` |"
        )
        if (RESULTS / f"quality_{ds}_complementary.json").exists():
            out.append(complementary_row(ds))
    mined = [ds for ds in DATASETS if "--negatives-prior" in train_argv(ds)]
    note = (
        f" The ranker of {', '.join(mined)} mines its negatives from the prior (`train_ranker "
        "--prior-negatives`): trained to order the prior's candidates, it is meant to be served "
        "fused, and alone ranks the whole catalog poorly."
        if mined
        else ""
    )
    return out + [
        "",
        "NDCG@10 / HR@10 over the full catalog minus the user's history (the protocol in "
        "[docs/jobs.md](docs/jobs.md)); a figure on 610 or 1,000 users carries a standard error "
        "of about 0.006." + note,
    ]


def train_argv(ds: str) -> list[str]:
    """The command line the quality table's ranker of ``ds`` was trained with."""
    report = load(f"quality_{ds}.json")
    return next(s for s in report["stages"] if s["stage"] == "train")["argv"]


def complementary_row(ds: str) -> str:
    """The quality table's row of the ranker trained complementary to the prior
    (``benchmarks.quality --complementary``): its served score at the weight it learned, and
    what that adds over the prior alone, paired by user."""
    report = load(f"quality_{ds}_complementary.json")
    ev = next(s for s in report["stages"] if s["stage"] == "evaluate")

    def cell(m: str) -> str:
        return f"{ev[f'{m}_full_ndcg10']:.4f} / {ev[f'{m}_full_hr10']:.3f}"

    gain = ev["served_minus_prior_ndcg10"] / ev["item_prior_full_ndcg10"]
    return (
        f"| {ds}, trained with the prior ({ev['users']:,}) | {cell('ranker')} "
        f"| **{cell('ranker_prior')}** (learned weight {ev['fusion_weight']:.0f}; "
        f"{gain:+.1%} against the prior, paired s.e. {ev['served_minus_prior_se']:.4f}) "
        f"| {cell('item_prior')} | {cell('most_popular')} | | "
        f"| {report['date']}, `--complementary` |"
    )


def cold_start() -> list[str]:
    """New items and the long tail (``benchmarks.cold_start``): a table per dataset measured,
    then one caption for them all (the protocol, and each run's recipe and training)."""
    out, runs = [], []
    for ds in DATASETS:
        if not (RESULTS / f"cold_start_{ds}.json").exists():
            continue
        report = load(f"cold_start_{ds}.json")
        t = report["table"]
        buckets = [
            f"{b} ({n:,})"
            for b, n in zip(t["popularity_buckets"], t["popularity_users"], strict=True)
        ]
        out += [
            f"| {ds}: model | new items ({t['new_item_users']:,} users): NDCG@10 "
            f"| HR@100 | median rank | all ({t['users']:,}) | " + " | ".join(buckets) + " |",
            "|---" * (5 + len(buckets)) + "|",
        ]
        for m, r in t["models"].items():
            if m == "most popular":  # nothing new to rank, its full-catalog figure is above
                continue
            pop = " | ".join(f"{v:.4f}" for v in r["by_popularity"])
            out.append(
                f"| {m} | {r['new_ndcg10']:.4f} ± {r['new_ndcg10_se']:.4f} | {r['new_hr100']:.3f} "
                f"| {r['new_median_rank']:,.0f} | {r['ndcg10']:.4f} "
                f"| {pop} |"
            )
        out.append("")
        trained = [s for s in report["stages"] if s["stage"].startswith("train")]
        epochs = ", ".join(f"{s['item_input']} {s['epochs_run']}" for s in trained)
        cap = report["training_cap"]
        if cap.get("max_minutes"):
            epochs += f", capped at {cap['max_minutes']} minutes"
        if cap.get("epochs"):
            epochs += f", capped at {cap['epochs']} epochs"
        prior = next((s for s in report["stages"] if s["stage"] == "fit prior"), {})
        borrowed = (
            f"; {prior['borrowed_items']:,} items without interactions borrowing the prior's "
            "weights of their nearest items by text"
            if prior.get("borrowed_items")
            else ""
        )
        runs.append(
            f"`--config {report['recipe']}` ({report['date']}; {report['holdout_items']:.0%} of "
            f"the items held out; epochs trained: {epochs}{borrowed})"
        )
    if not runs:
        return []
    return out + [
        "`benchmarks.cold_start` " + ", ".join(runs) + ": the held-out items are out of every "
        "training input (`prepare_data --holdout-items`); full-catalog NDCG@10 of the users "
        "whose test item is one of them (± its standard error), of the seeded sample, and of the "
        "sample by the test item's interactions in the training inputs (users per bucket); "
        "fused weights picked on validation. Most popular, which scores a new item last, is in "
        "the runs' JSON (`benchmarks/results/cold_start_<dataset>.json`)."
    ]


def collective_kv() -> list[str]:
    amazon = {s["step"]: s["summary"] for s in load(f"ckv_default_{DATASETS[1]}.json")["steps"]}
    ml = load(f"kv_sweep_grid_e3_{DATASETS[0]}.json")
    rows = {r["method"]: r for r in ml["rows"]}
    base = rows["uncompressed fp16 KV"]["ndcg10"]
    out = [
        "| cache (test users, full catalog) | bytes vs fp16 KV | NDCG@10 | vs uncompressed |",
        "|---|---|---|---|",
    ]
    for method in (
        "uncompressed fp16 KV",
        "int8 KV (scale per token, head)",
        "low-rank KV, R=4",
        "CollectiveKV M=1024 d_u=1",
    ):
        r = rows[method]
        out.append(
            f"| {DATASETS[0]} ({ml['test_users']}), {method} | {r['ratio']:.2%} "
            f"| {r['ndcg10']:.4f} | {r['ndcg10'] / base:.2f} |"
        )
    ev = amazon["evaluate_states"]
    b = amazon["build_user_states"]
    for label, key, ratio in (
        ("uncompressed fp16 KV", "uncompressed", 1.0),
        (f"CollectiveKV M={amazon['train_kv_pool']['pool_size']} d_u=1 (auto)", "ranker", None),
    ):
        out.append(
            f"| {DATASETS[1]} ({ev['users']:,}), {label} | {ratio or b['ratio']:.2%} "
            f"| {ev[f'{key}_full_ndcg10']:.4f} "
            f"| {ev[f'{key}_full_ndcg10'] / ev['uncompressed_full_ndcg10']:.2f} |"
        )
    return out + [
        "",
        f"All {b['users']:,} amazon users' states take {b['state_bytes'] / 1e6:.1f} MB "
        f"({b['bytes_per_user']:.0f} B a user) where their fp16 KV would take "
        f"{b['full_kv_bytes'] / 1e6:.0f} MB. The low-rank cache at the same bytes loses "
        "almost half the quality; the pools keep all of it.",
    ]


# amazon's M x d_u grid on one trained ranker (a6, the same 1,000 test users): d_u 2-8 in one
# sweep, d_u 1 in three runs along M
AMAZON_GRID = ("grid_a6", "m256", "distill", "m4096")


def grid() -> list[str]:
    """Quality kept (vs uncompressed) over M x d_u on amazon: why M is sized to the tokens."""
    rows = [r for part in AMAZON_GRID for r in load(f"kv_sweep_{part}_{DATASETS[1]}.json")["rows"]]
    cells = {(r["pool_size"], r["user_dim"]): r for r in rows if "pool_size" in r}
    sizes = sorted({m for m, _ in cells})
    dims = sorted({d for _, d in cells})
    out = [
        "| amazon: NDCG@10 kept at | "
        + " | ".join(f"d_u={d} ({cells[sizes[0], d]['ratio']:.2%})" for d in dims)
        + " |",
        "|---|" + "---|" * len(dims),
    ]
    for m in sizes:
        vals = [cells.get((m, d)) for d in dims]
        out.append(
            f"| M={m} | "
            # each run against its own uncompressed row (the same ranker and users)
            + " | ".join(f"{v['ndcg_vs_uncompressed']:.2f}" if v else "" for v in vals)
            + " |"
        )
    return out + [
        "",
        "On amazon quality follows the pool's size, not the user's own numbers: the default "
        "`--pool-size auto` sizes M to the cached tokens (1,024 on ml-latest-small, 4,096 on "
        "amazon).",
    ]


def serving() -> list[str]:
    load_ = load("serve_load.json")
    mis = {r["concurrency"]: r for r in load_["results"]["mis"]}
    full = {r["concurrency"]: r for r in load_["results"]["full_forward_baseline"]}
    teacher = load("serve_load_teacher.json")
    t_mis = {r["concurrency"]: r for r in teacher["results"]["mis"]}
    t_llm = {r["concurrency"]: r for r in teacher["results"]["teacher_vllm"]}
    out = [
        "| concurrency | MIS scores/s (p99 ms) | full-forward baseline (p99 ms) | ratio |"
        " vLLM text teacher (p99 ms) | MIS over teacher |",
        "|---|---|---|---|---|---|",
    ]
    for c in sorted(mis):
        m, f = mis[c], full[c]
        row = (
            f"| {c} | {m['candidate_scores_per_s']:,.0f} ({m['p99_ms']:.0f}) "
            f"| {f['candidate_scores_per_s']:,.0f} ({f['p99_ms']:.0f}) "
            f"| **{load_['mis_over_baseline_scores_per_s'][str(c)]}x** |"
        )
        if c in t_llm:
            row += (
                f" {t_llm[c]['candidate_scores_per_s']:,.0f} ({t_llm[c]['p99_ms']:.0f}) "
                f"| {teacher['mis_over_teacher_scores_per_s'][str(c)]}x "
                f"(MIS {t_mis[c]['candidate_scores_per_s']:,.0f}) |"
            )
        else:
            row += " | |"
        out.append(row)
    return out + [
        "",
        f"{load_['candidates_per_request']} candidates a request over HTTP against `make serve` "
        "(`benchmarks.serve_load`), client and server on the same two cores; errors: "
        f"{sum(r['errors'] for r in load_['results']['mis'])}. A request names candidates by "
        f"id: {load_['request_payload']['ids_bytes']} bytes where their text vectors would be "
        f"{load_['request_payload']['vectors_bytes']:,}.",
    ]


def state_store() -> list[str]:
    report = load("state_store.json")
    out = [
        "| engine | users | load | per user: packed / on disk / in memory | lookup of 32 users "
        "p50 / p99 | durable events/s, 1 / 64 clients | serving again after kill -9 "
        "| acknowledged lost | peak RSS of the data's process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        memory = r.get("memory_bytes_per_user")
        out.append(
            f"| {r['engine']} | {r['users']:,} | {r['load_s']:,.0f} s "
            f"| {r['packed_bytes_per_user']:,} / {r['disk_bytes_per_user']:,.0f} / "
            f"{'-' if memory is None else f'{memory:,.0f}'} B "
            f"| {r['lookup32_p50_ms']} / {r['lookup32_p99_ms']} ms "
            f"| {r['events_per_s_c1']:,} / {r['events_per_s_c64']:,} "
            f"| {r['kill9_to_serving_s']:.3g} s | {r['acked_lost']} of {r['kill9_acked']} "
            f"| {r['rss_peak_mib']:,} MiB |"
        )
    return out + [
        "",
        f"`benchmarks.state_store`: synthetic users of {report['rows'][0]['tokens_per_user']} "
        "cached tokens in the default layout (2 layers, M 1,024, d_u 1), one shard on this "
        f"machine ({report['machine']}): sqlite's database on its disk, redis a local "
        "redis-server (its append-only file on the same disk); events are fsynced before they "
        "are acknowledged, 64 clients share commits (group commit). kill -9 hits the process "
        "that holds the data: the writer for sqlite (reopened), the server for redis "
        "(restarted, replaying its append-only file)." + cluster_restart(report) + one_user(),
        "",
        *store_end_to_end(),
    ]


def cluster_restart(report: dict) -> str:
    """A sentence on one Redis Cluster node's restart, when the report has one."""
    c = report.get("cluster_restart")
    if not c:
        return ""
    per_node = ", ".join(f"{k:,}" for k in c["keys_per_node"])
    return (
        f" A restart costs what one node holds: {c['users']:,} users in {c['shards']} shards on "
        f"a {c['masters']}-primary Redis Cluster ({per_node} keys per node), the node "
        f"holding {c['restarted_node_users']:,} of them killed with "
        f"kill -9 served again after {c['kill9_to_serving_s']:.1f} s."
    )


def one_user() -> str:
    """A sentence on one user's many events (benchmarks.one_user), when it was run."""
    try:
        r = load("one_user.json")
    except FileNotFoundError:
        return ""
    return (
        f" One user sending {r['events']:,} events (`benchmarks.one_user`: the engine's "
        f"extend and a durable commit each) never held more than {r['history_length_max']} "
        f"history items ({r['max_len']} + slack {r['slack_items']}) or "
        f"{r['packed_bytes_max']:,} packed bytes, rebuilt {r['rebuilds']:,} times; RSS "
        f"{r['rss_mib_start']:,.0f} MiB before, {r['rss_mib_end']:,.0f} MiB after."
    )


def store_end_to_end() -> list[str]:
    report = load("serve_load_store.json")
    cells = []
    for r in report["rows"]:
        top = r["results"][-1]
        cells.append(
            f"{r['store_users']:,} users in the store: {top['candidate_scores_per_s']:,.0f} "
            f"scores/s, p99 {top['p99_ms']:,.0f} ms, {top['errors']} errors"
        )
    ratio = report["largest_over_first_at_top_concurrency"]
    top = report["rows"][0]["results"][-1]
    return [
        f"End to end (`benchmarks.serve_load --store-users`): `/v1/rank` at concurrency "
        f"{top['concurrency']} ({report['candidates_per_request']} candidates, a random user "
        f"each request, the embedded engine, {report['shards']} shards): "
        + "; ".join(cells)
        + f" - {ratio['scores_per_s']:.2f}x the scores/s and {ratio['p99_ms']:.2f}x the p99 "
        "of the smallest store, in one run. Each stored user is a copy of one of "
        "ml-latest-small's states.",
    ]


def scoring() -> list[str]:
    out = [
        "| device | history | candidates | MIS scores/s | full forward per candidate | MIS "
        "over full | CollectiveKV over plain cache |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("scoring.json", "scoring_cuda_bf16.json"):
        report = load(name)
        device = f"{report['device']}, {report['dtype']}"
        for r in (r for r in report["results"] if r["candidates"] >= 100):
            out.append(
                f"| {device} | {r['history_length']} | {r['candidates']} "
                f"| {r['mis']['scores_per_s']:,.0f} | {r['full']['scores_per_s']:,.0f} "
                f"| {r['ratio_mis_over_full']:.1f}x | {r['ratio_ckv_over_mis']:.2f} |"
            )
    bf16 = [r for r in load("scoring_cpu_bf16.json")["results"] if r["candidates"] >= 100]
    cpu_bf16 = "; ".join(
        f"history {r['history_length']}, {r['candidates']} candidates: "
        f"{r['mis']['scores_per_s']:,.0f} scores/s ({r['ratio_mis_over_full']:.1f}x the full "
        "forward)"
        for r in bf16
    )
    enc = load("encode.json")
    first, inc = enc["encode_items_first"], enc["encode_items_incremental"]
    train = "; ".join(
        throughput(r) for r in load("train_throughput.json")["rows"] if r["label"] == "default"
    )
    prep = load("prepare_data.json")["datasets"]
    return out + [
        "",
        "`benchmarks.scoring`: a width-256 ranker, every candidate scored by one MIS pass "
        "against scoring each by its own forward over history + candidate; in bf16 on the "
        f"same CPU (`--dtype bf16`): {cpu_bf16}. "
        f"`benchmarks.encode`: `encode_items` encodes {enc['items']:,} items at "
        f"{first['items_per_second_job']:.0f} items/s end to end (a plain loop: "
        f"{enc['plain_loop']['items_per_second']:.0f}); after editing {inc['edited_items']} "
        f"texts it re-encodes exactly those in {inc['job_seconds']} s. "
        "`benchmarks.prepare_data`: "
        + ", ".join(
            f"{name} {d['interactions']:,} interactions in {d['job_seconds_median']} s"
            for name, d in prep.items()
        )
        + f". `benchmarks.train_throughput` (each recipe's ranker): {train}.",
    ]


def throughput(r: dict) -> str:
    """One dataset's training throughput row, as the README quotes it."""
    mined = (
        f", {r['prior_negatives']} of them mined from the prior" if r.get("prior_negatives") else ""
    )
    out = (
        f"{r['dataset']} (batches of {r['batch_size']}, {r['negatives']} negatives a cut{mined}): "
        f"{r['ray_train']['windows_per_second']:.0f} windows/s through Ray Train (one process: "
        f"{r['bucketed']['windows_per_second']:.0f} with windows grouped by length, "
        f"{r['bucketed']['real_token_share']:.0%} of the computed tokens real, against "
        f"{r['mixed']['windows_per_second']:.0f} in batches of mixed lengths, "
        f"{r['mixed']['real_token_share']:.0%} real)"
    )
    if "baseline" in r:
        out += (
            f", {r['baseline_speedup']:.2f}x the training step of 2026-12-05 timed in the same "
            f"run ({r['baseline']['windows_per_second']:.0f} windows/s: batches of 32 of mixed "
            "lengths, 31 uniform negatives)"
        )
    return out


def gpu() -> list[str]:
    report = load("gpu_check_cuda.json")
    lengths = sorted({r["history_length"] for r in report["mis"]})
    mis = {(r["history_length"], r["candidates"]): r for r in report["mis"]}
    out = [
        "| one user, graph replay | " + " | ".join(f"history {t}" for t in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for n in sorted({r["candidates"] for r in report["mis"]}):
        cells = [
            f"{mis[t, n]['scores_per_s']:,.0f} scores/s ({mis[t, n]['seconds'] * 1e3:.2f} ms)"
            for t in lengths
        ]
        out.append(f"| {n} candidates | " + " | ".join(cells) + " |")
    batches = "; ".join(
        f"{r['users']:,} users: {r['scores_per_s']:,.0f} scores/s (expand {r['expand_share']:.0%})"
        for r in report["batch"]
    )
    checks = report["checks"]
    return out + [
        "",
        f"`benchmarks.gpu_check` on one {report['device']} (torch {report['torch']}): the "
        f"default recipe's ranker ({report['ranker']['n_layers']} layers of width "
        f"{report['ranker']['d_model']}, random weights: costs, not quality) in bf16, its "
        f"CollectiveKV twin (M {report['collective_kv']['pool_size']:,}, "
        f"d_u {report['collective_kv']['user_dim']}) "
        "for the batches. Many users in one pass (100 candidates each, states expanded from "
        f"the host): {batches}. A call waited for costs at least "
        f"{report['round_trip_s'] * 1e6:.0f} µs here. Training: "
        f"{report['train']['windows_per_s']:,.0f} windows/s (fp32, 32 windows a step). "
        "Checks: graph replay equals eager scoring (max difference "
        f"{checks['graph_replay_equals_eager']['max_abs_diff']:g}), MIS equals scoring each "
        "candidate alone (max difference "
        f"{checks['mis_equals_each_candidate_alone']['max_abs_diff']:.1e}), expand(compress) "
        "exact. For scale: DuoLM reports about 26,400 scores/s on one H100 for its ranker, "
        "SGLang's multi-item scoring about 1,000 items/s per H100 (p99 under 500 ms) for a 0.6B "
        "model; those compare model size and method together, not serving engines.",
    ]


def recommend() -> list[str]:
    r = load("recommend.json")
    ex = r["exact"]
    out = [
        "| /v1/recommend, retrieval of | keeps of the exact top 10 | NDCG@10 / HR@10 as served "
        "| the same, whole history left out | ms per user (CPU) |",
        "|---|---|---|---|---|",
        f"| the whole catalog ({r['catalog_items']:,} items: exact) | 100% | {ex['ndcg10']:.4f} / "
        f"{ex['hr10']:.4f} | {ex['ndcg10_all_seen']:.4f} / {ex['hr10_all_seen']:.4f} | "
        f"{ex['ms_per_user']:,.0f} |",
    ]
    shown = (100, 500)  # the cheapest that keeps the exact top 10, and the served default
    for t in (t for t in r["two_stage"] if t["retrieve"] in shown):
        out.append(
            f"| {t['retrieve']:,} items | {t['recall_of_exact_top10']:.1%} | {t['ndcg10']:.4f} / "
            f"{t['hr10']:.4f} | {t['ndcg10_all_seen']:.4f} / {t['hr10_all_seen']:.4f} | "
            f"{t['ms_per_user']:,.1f} |"
        )
    ix = r.get("index")
    if ix:
        t = min(ix["rows"], key=lambda row: row["nprobe"])
        out.append(
            f"| {ix['retrieve']:,} items through the index ({t['nprobe']} of {ix['nlist']} "
            f"groups) | {t['recall_of_exact_top10']:.1%} | {t['ndcg10']:.4f} / "
            f"{t['hr10']:.4f} | {t['ndcg10_all_seen']:.4f} / {t['hr10_all_seen']:.4f} | "
            f"{t['ms_per_user']:,.1f} |"
        )
    return out + [
        "",
        f"`benchmarks.recommend` over the {r['users']} test users of the served states (ranker "
        f"+ prior at weight {r['prior_weight']:g}), in batches of 16 on this machine's CPU: "
        "retrieval by the user vector plus the weighted prior, then the full score over what "
        "it retrieved. As served, the history left out is what the state holds (the ranker's "
        "window); with the whole history left out, the exact row is evaluate's full-catalog "
        "figure for the served score." + catalog_sizes(r.get("catalog_sizes", [])),
    ]


def catalog_sizes(rows: list[dict]) -> str:
    """A sentence on retrieval alone as the catalog grows, exact and through the index."""
    if not rows:
        return ""
    cells = "; ".join(
        f"{c['items']:,} items: {c['exact_ms_per_user']:.2f} ms exact, "
        f"{c['index_ms_per_user']:.2f} ms through the index (built in {c['index_build_s']:.0f} "
        f"s), which keeps {c['index_recall_top10']:.0%} of the exact top 10"
        for c in rows
    )
    return (
        f" Retrieval alone per user (top {rows[0]['retrieve']}, synthetic clustered catalogs, "
        f"tokens {rows[0]['width']} wide, nprobe {rows[0]['nprobe']}): {cells}. "
        "`build_user_states` builds the index for catalogs of 200,000 items or more "
        "(`--index-items`), where exact retrieval would cost as much as the ranking."
    )


def ramp() -> list[str]:
    r = load("serve_ramp.json")
    s, cfg = r["summary"], r["settings"]
    phases = ", ".join(
        f"{ph['concurrency']} client{'s' if ph['concurrency'] > 1 else ''} for "
        f"{ph['seconds']:.0f} s: {ph['candidate_scores_per_s']:,.0f} scores/s, p99 "
        f"{ph['p99_ms']:,.0f} ms"
        for ph in s["phases"]
    )
    lo, hi = s["replicas_min_max"]
    return [
        "![the ramp](benchmarks/results/serve_ramp.png)",
        "",
        f"`benchmarks.serve_ramp`: {phases}. The Ranker, between "
        f"{cfg['ranker_min_replicas']} and {cfg['ranker_max_replicas']} replicas of "
        f"{cfg['ranker_num_cpus']:g} CPU (target {cfg['ranker_target_ongoing_requests']:g} "
        f"ongoing requests each, up after {cfg['ranker_upscale_delay_s']:g} s, down after "
        f"{cfg['ranker_downscale_delay_s']:g} s below it), went from {lo} to {hi} replicas and "
        f"back to {s['replicas_at_end']}; {s['requests']:,} requests, {s['errors']} failed. On "
        "one 2-core machine more replicas share the same cores: the mechanism, not capacity.",
    ]


def render() -> str:
    sections = [
        ("### Quality", quality()),
        ("### New items and the long tail", cold_start()),
        ("### CollectiveKV: the stored state and what it keeps", collective_kv() + [""] + grid()),
        ("### Serving throughput", serving()),
        ("### Recommending from the whole catalog", recommend()),
        ("### Autoscaling under a load ramp", ramp()),
        ("### State store", state_store()),
        ("### Scoring, encoding and training", scoring()),
        ("### The ranker replica on a GPU", gpu()),
    ]
    body = [BEGIN, ""]
    for title, lines in sections:
        if lines:  # a section whose benchmark has not run yet is left out
            body += [title, "", *lines, ""]
    return "\n".join(body + [END])


def rendered_readme(text: str) -> str:
    """``text`` (the README) with its results block replaced by a fresh rendering."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no results block ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + render() + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    a = p.parse_args(argv)
    path = ROOT / "README.md"
    text = path.read_text()
    fresh = rendered_readme(text)
    if a.check:
        if fresh != text:
            print(
                "README.md's results differ from benchmarks/results/: run python -m "
                "benchmarks.readme",
                file=sys.stderr,
            )
            return 1
        return 0
    path.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())

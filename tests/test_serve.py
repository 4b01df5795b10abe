"""The Serve application over real HTTP on 127.0.0.1, to a proxy bound to every interface (so
the app needs its API tokens): ranking equals scoring the stored state directly, bad input gets
a 4xx naming the field, events extend a user's state durably (they survive the shard's replica
being killed). The store here is the Redis engine on a real redis-server; the embedded engine
serves the cluster tests (tests/test_ray_job.py)."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest
import torch

from artifacts import states, storage
from artifacts.prior import read_prior
from pipelines import fit_item_prior
from services import auth
from tests.conftest import free_port

PRIOR_WEIGHT = 0.5  # the served score: ranker + 0.5 x the item-to-item prior
RANKER_HOLDS = 2  # the Ranker's max_ongoing_requests, and as many queued at the ingress
MAX_LEN, SLACK = 10, 3  # the tiny ranker's window; a state is rebuilt past 13 history items
# the app's API tokens (services.auth): one with every scope, one per scope
TOKENS = {
    "all": "t-all-6f1d0c",
    "read": "t-read-93be2a",
    "write": "t-write-5c07e1",
    "admin": "t-admin-0a4f9d",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_trained, redis_server):
    """A tiny CollectiveKV ranker's states behind the app: {"url", "states"}."""
    from ray import serve

    from services.app import build_app

    d = tmp_path_factory.mktemp("serve")
    out, ds, built = str(d / "out"), tiny_trained["dataset"], tiny_trained["states"]
    prior = fit_item_prior.fit_item_prior(
        ds, out, l2s=[1.0], neighbours=8, recents=[3], decays=[0.7], val_users=0
    )["out"]
    port = free_port()
    # every interface, as a platform team runs it: the app refuses to start there without API
    # tokens (test_an_open_api_is_refused_beyond_loopback); the clients here use 127.0.0.1
    serve.start(http_options={"host": "0.0.0.0", "port": port})
    tokens = d / "tokens"
    tokens.write_text(
        "# hash, scopes, name\n"
        + "".join(
            f"{auth.digest(t)} {'read,write,admin' if n == 'all' else n} {n}\n"
            for n, t in TOKENS.items()
        )
    )
    settings = {
        "manifest_uri": built["user_states"],
        "api_tokens_file": str(tokens),
        # the events this module sends, on the Redis server (the embedded engine serves the
        # cluster tests: tests/test_ray_job.py); the states stay shared
        "store_uri": redis_server.uri(),
        "shards": 2,
        "max_candidates": 50,
        "max_body_bytes": 4096,
        "state_slack_items": SLACK,
        "item_prior_uri": prior,
        "item_prior_weight": PRIOR_WEIGHT,
        # short queues, so that a burst of requests shows the overload answer
        "ranker_max_ongoing_requests": RANKER_HOLDS,
        "ranker_max_queued_requests": RANKER_HOLDS,
        "ranker_max_replicas": 1,
    }
    serve.run(build_app(settings), name="kvrank", route_prefix="/")
    yield {
        "url": f"http://127.0.0.1:{port}",
        "states": built["user_states"],
        "prior": prior,
        "settings": settings,
    }
    serve.shutdown()


def post(served, path: str, body=None, token: str = TOKENS["all"], **kw) -> httpx.Response:
    return httpx.post(served["url"] + path, json=body, timeout=60, headers=bearer(token), **kw)


def get(url: str, token: str = TOKENS["all"], **kw) -> httpx.Response:
    return httpx.get(url, headers=bearer(token), **kw)


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_rank_matches_scoring_the_stored_state(served):
    from services.engine import RankEngine

    assert get(served["url"] + "/healthz").json() == {"status": "ok"}
    manifest, table = states.read_states(served["states"])
    row = table.to_pylist()[3]
    engine = RankEngine(served["states"])
    items_table = storage.read_table(manifest["dataset_uri"], "items.parquet")
    vid_of = dict(zip(*items_table.select(["item_id", "vid"]).to_pydict().values(), strict=True))
    prior, _ = read_prior(served["prior"])
    user_prior = prior.scores([torch.as_tensor(row["hist"])])[0]
    item_of = {v: i for i, v in vid_of.items()}
    # two candidates the prior favours for this user, so that it moves the ranking
    items = [5, 17, 23, 42, 8, 31]
    items += [item_of[v] for v in user_prior.argsort(descending=True).tolist()[:8]]
    items = list(dict.fromkeys(items))[:8]
    r = post(served, "/v1/rank", {"user_id": row["user_id"], "candidate_item_ids": items, "k": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["known_user"] and body["history_length"] == len(row["hist"])
    cache = states.from_table(table.slice(3, 1), engine.layout)
    vids = torch.tensor([[vid_of[i] for i in items]])
    want = engine.model.score(cache, vids)[0]
    # the app serves the ranker's score plus the weighted prior of the user's newest items
    assert engine.prior is None  # a manifest alone serves the ranker alone
    assert user_prior[vids[0]].abs().sum() > 0
    want = want + PRIOR_WEIGHT * user_prior[vids[0]]
    order = torch.argsort(want, descending=True)[:4]
    assert [x["item_id"] for x in body["items"]] == [items[i] for i in order]
    assert [x["score"] for x in body["items"]] == pytest.approx(want[order].tolist(), abs=1e-5)


def test_the_full_forward_baseline_app_ranks_as_the_ranker_from_the_same_state(served):
    """benchmarks.serve_baselines, beside the app: each candidate by its own full forward over
    the user's stored history - the ranker's scores (no prior) at the cost MIS avoids."""
    from ray import serve

    from benchmarks.serve_baselines import APP_NAME, ROUTE_PREFIX, build_baselines
    from services.engine import RankEngine

    serve.run(build_baselines(served["states"], shards=2), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    try:
        _, table = states.read_states(served["states"])
        row = table.to_pylist()[2]
        items = [5, 17, 23, 42, 8, 31]
        body = {"user_id": row["user_id"], "candidate_item_ids": items, "k": 6}
        r = post(served, f"{ROUTE_PREFIX}/v1/rank_full", body)
        assert r.status_code == 200, r.text
        assert r.json()["known_user"] and r.json()["history_length"] == len(row["hist"])
        engine = RankEngine(served["states"])
        vid_of = engine_vids(served["states"])
        ((top, scores),) = engine.rank([row], [[vid_of[i] for i in items]], [6])
        item_of = {v: i for i, v in vid_of.items()}
        assert [x["item_id"] for x in r.json()["items"]] == [item_of[v] for v in top]
        assert [x["score"] for x in r.json()["items"]] == pytest.approx(scores, abs=1e-4)
        assert post(served, f"{ROUTE_PREFIX}/v1/rank_teacher", body).status_code == 404
    finally:
        serve.delete(APP_NAME)


def test_recommend_over_http_ranks_the_users_unseen_catalog_with_the_prior(served):
    """/v1/recommend (its retrieval covers this catalog: exact) equals ranking every item the
    user has not seen with the served score (ranker + prior); it needs the read scope."""
    from services.engine import RankEngine

    _, table = states.read_states(served["states"])
    row = table.to_pylist()[6]
    assert get(f"{served['url']}/v1/users/{row['user_id']}").json()["history_length"] == len(
        row["hist"]
    )  # no events sent to this user by other tests
    vid_of = engine_vids(served["states"])
    item_of = {v: i for i, v in vid_of.items()}
    engine = RankEngine(
        served["states"], item_prior_uri=served["prior"], item_prior_weight=PRIOR_WEIGHT
    )
    unseen = [v for v in range(len(vid_of)) if v not in set(row["hist"])]
    ((want, scores),) = engine.rank([row], [unseen], [7])
    r = post(served, "/v1/recommend", {"user_id": row["user_id"], "k": 7})
    assert r.status_code == 200, r.text
    assert [x["item_id"] for x in r.json()["items"]] == [item_of[v] for v in want]
    assert [x["score"] for x in r.json()["items"]] == pytest.approx(scores, abs=1e-5)
    seen = {item_of[v] for v in row["hist"]}
    all_items = post(served, "/v1/recommend", {"user_id": row["user_id"], "k": 1000})
    assert len(all_items.json()["items"]) == len(unseen)
    assert not {x["item_id"] for x in all_items.json()["items"]} & seen
    body = {"user_id": row["user_id"], "k": 3}
    assert post(served, "/v1/recommend", body, token=TOKENS["write"]).status_code == 403
    assert post(served, "/v1/recommend", body | {"k": 0}).status_code == 422
    unknown = post(served, "/v1/recommend", {"user_id": 10**12, "k": 3}).json()
    assert not unknown["known_user"] and len(unknown["items"]) == 3


def engine_vids(states_uri: str) -> dict[int, int]:
    manifest = storage.read_marker(states_uri)
    items = storage.read_table(manifest["dataset_uri"], "items.parquet")
    return dict(zip(*items.select(["item_id", "vid"]).to_pydict().values(), strict=True))


def test_each_route_wants_its_scope_and_refusals_say_nothing_more(served):
    """No token or a wrong one: 401 (with WWW-Authenticate); a token without the route's scope:
    403; the scope's token: served. /healthz and the OpenAPI schema stay open."""
    url = served["url"]
    rank = ("POST", "/v1/rank", {"user_id": 1, "candidate_item_ids": [1, 2], "k": 1})
    event = ("POST", "/v1/events", {"user_id": 2**40, "item_id": 3})  # a user of its own
    routes = [
        (*rank, "read"),
        (*event, "write"),
        ("GET", "/v1/users/1", None, "admin"),
        ("GET", "/v1/stats", None, "admin"),
        ("GET", "/v1/no-such-route", None, "admin"),  # unknown /v1/ paths: no enumeration
    ]
    for method, path, body, scope in routes:
        for who, headers in [
            ("none", {}),
            ("wrong", bearer("not-a-token")),
            ("basic", {"Authorization": f"Basic {TOKENS['all']}"}),
            *[(s, bearer(TOKENS[s])) for s in ("read", "write", "admin")],
        ]:
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=60)
            if who == scope:
                assert r.status_code == (404 if "no-such" in path else 200), (path, who, r.text)
            elif who in ("none", "wrong", "basic"):
                assert (r.status_code, r.json()) == (401, {"detail": "unauthorized"}), (path, who)
                assert r.headers["www-authenticate"] == "Bearer"
            else:
                assert (r.status_code, r.json()) == (403, {"detail": "forbidden"}), (path, who)
    assert httpx.get(url + "/healthz").status_code == 200
    assert httpx.get(url + "/openapi.json").status_code == 200


def test_an_open_api_is_refused_beyond_loopback(served):
    """Serve listens on every interface here: without api_tokens_file the ingress refuses to
    start, and says why where an operator reads it (serve status); the app beside it, which has
    its tokens, serves only requests that bring one."""
    from ray import serve

    from services.app import Ingress

    settings = {k: v for k, v in served["settings"].items() if k != "api_tokens_file"}
    # the ingress's constructor refuses before it looks at the ranker or the stores: alone here,
    # on no CPU (the app beside it holds this machine's), and tried once (each try is a new
    # replica process; the refusal is the same every time)
    lone = Ingress.options(ray_actor_options={"num_cpus": 0}, max_constructor_retry_count=1)
    lone = lone.bind(settings, None)
    with pytest.raises(RuntimeError, match=r"Failed to update the deployments \['Ingress'\]"):
        serve.run(lone, name="open", route_prefix="/open")
    try:
        why = serve.status().applications["open"].deployments["Ingress"].message
        assert "Serve listens on '0.0.0.0' and no api_tokens_file is set" in why, why
    finally:
        serve.delete("open")
    body = {"user_id": 1, "candidate_item_ids": [1, 2, 3], "k": 2}
    assert httpx.post(served["url"] + "/v1/rank", json=body, timeout=60).status_code == 401
    assert post(served, "/v1/rank", body, token=TOKENS["read"]).status_code == 200


def test_unknown_user_ranks_from_an_empty_history(served):
    r = post(served, "/v1/rank", {"user_id": 10**9, "candidate_item_ids": [1, 2, 3], "k": 10})
    assert r.status_code == 200, r.text
    body = r.json()
    assert not body["known_user"] and body["history_length"] == 0
    assert "unknown user" in body["note"] and len(body["items"]) == 3


@pytest.mark.parametrize(
    "body, field",
    [
        ({"user_id": 1, "candidate_item_ids": [1, 999], "k": 2}, "candidate_item_ids"),
        ({"user_id": 1, "candidate_item_ids": [1, 1], "k": 2}, "candidate_item_ids"),
        ({"user_id": 1, "candidate_item_ids": [], "k": 2}, "candidate_item_ids"),
        ({"user_id": 1, "candidate_item_ids": list(range(51)), "k": 2}, "candidate_item_ids"),
        ({"user_id": 1, "candidate_item_ids": [1, 2], "k": 0}, "k"),
        ({"user_id": 1, "candidate_item_ids": [1, 2], "k": 100_000}, "k"),
        ({"user_id": "one", "candidate_item_ids": [1, 2], "k": 2}, "user_id"),
        ({"user_id": 1, "candidate_item_ids": ["1"], "k": 2}, "candidate_item_ids"),
        ({"user_id": 1, "candidate_item_ids": [1], "k": 2, "extra": 1}, "extra"),
    ],
)
def test_bad_rank_requests_get_a_4xx_naming_the_field(served, body, field):
    r = post(served, "/v1/rank", body)
    assert r.status_code == 422, r.text
    assert field in str(r.json()["detail"])


@pytest.mark.parametrize(
    "path, body, field",
    [
        # feedback at the model's class count (5 here) and past it, up to 2^63
        *[
            ("/v1/events", {"user_id": 1, "item_id": 1, "feedback": fb}, "feedback")
            for fb in (5, 6, 99, 2**31 - 1, 2**31, 2**63)
        ],
        *[("/v1/events", {"user_id": uid, "item_id": 1}, "user_id") for uid in (2**63, 2**64, -1)],
        *[
            ("/v1/rank", {"user_id": uid, "candidate_item_ids": [1], "k": 1}, "user_id")
            for uid in (2**63, 2**64, -1)
        ],
        ("/v1/rank", {"user_id": 1, "candidate_item_ids": [2**64], "k": 1}, "candidate_item_ids"),
        ("/v1/events", {"user_id": 1, "item_id": 2**64}, "item_id"),
    ],
)
def test_boundary_inputs_get_a_422_naming_the_field(served, path, body, field):
    """The eight inputs that once answered 500 (feedback past the model's classes, ids past
    int64) and their neighbours: each a 422 naming its field, nothing stored."""
    before = get(f"{served['url']}/v1/users/1").json()
    r = post(served, path, body)
    assert r.status_code == 422, r.text
    assert field in str(r.json()["detail"])
    assert get(f"{served['url']}/v1/users/1").json() == before
    assert get(f"{served['url']}/v1/users/{2**64}").status_code == 422


def test_unknown_candidates_are_skipped_and_listed_when_asked(served):
    body = {"user_id": 1, "candidate_item_ids": [1, 999, 2, 10**12], "k": 5}
    assert post(served, "/v1/rank", body).status_code == 422  # by default: refused
    r = post(served, "/v1/rank", body | {"skip_unknown": True})
    assert r.status_code == 200, r.text
    assert sorted(x["item_id"] for x in r.json()["items"]) == [1, 2]
    assert r.json()["unknown_item_ids"] == [999, 10**12]
    only_unknown = {"user_id": 1, "candidate_item_ids": [999], "skip_unknown": True}
    assert post(served, "/v1/rank", only_unknown).status_code == 422


def test_a_burst_past_the_queues_gets_503_with_retry_after_and_the_rest_are_served(served):
    """64 rank requests at once against a Ranker that holds 2 and queues 2 more: the excess is
    refused at once with 503 and Retry-After (no queue grows without end), the rest are
    ranked, and the replica serves on afterwards."""
    import asyncio

    body = {"user_id": 3, "candidate_item_ids": list(range(1, 41)), "k": 5}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, headers=bearer(TOKENS["read"])) as client:
            calls = [client.post(served["url"] + "/v1/rank", json=body) for _ in range(64)]
            return await asyncio.gather(*calls)

    answers = asyncio.run(burst())
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= RANKER_HOLDS and 503 in codes
    assert all(r.headers.get("retry-after") == "1" for r in answers if r.status_code == 503)
    assert post(served, "/v1/rank", body).status_code == 200


def test_malformed_and_oversized_bodies(served):
    r = httpx.post(
        served["url"] + "/v1/rank",
        content=b"{not json",
        headers={"content-type": "application/json", **bearer(TOKENS["read"])},
    )
    assert r.status_code == 422
    big = {"user_id": 1, "candidate_item_ids": [1], "k": 1, "pad": "x" * 5000}
    assert post(served, "/v1/rank", big).status_code == 413
    r = post(served, "/v1/events", {"user_id": 1, "item_id": 12345})
    assert r.status_code == 422 and "item_id" in str(r.json()["detail"])


def test_events_change_the_stored_state_and_start_new_users(served):
    """Events move a user's history and state, and a user the states never had starts from
    its first event (that both outlive a killed store replica: the test under load)."""
    user = 4
    before = get(f"{served['url']}/v1/users/{user}").json()
    for item, fb in ((7, 4), (12, 2), (33, 0), (9, 3)):
        r = post(served, "/v1/events", {"user_id": user, "item_id": item, "feedback": fb})
        assert r.status_code == 200, r.text
    after = get(f"{served['url']}/v1/users/{user}").json()
    assert after["history_length"] == before["history_length"] + 4
    assert after["state_bytes"] > before["state_bytes"]
    new_user = post(served, "/v1/events", {"user_id": 10**6, "item_id": 3}).json()
    assert new_user["history_length"] == 1
    assert get(f"{served['url']}/v1/users/{10**6}").json()["history_length"] == 1
    assert get(served["url"] + "/v1/stats").json()["store"]["users"] >= 41  # the 40, and one


def test_an_event_sent_again_with_its_id_is_applied_once(served):
    user = 6
    body = {"event_id": "client-42", "user_id": user, "item_id": 5, "feedback": 1}
    before = get(f"{served['url']}/v1/users/{user}").json()["history_length"]
    first = post(served, "/v1/events", body)
    assert first.status_code == 200 and not first.json()["duplicate"]
    again = post(served, "/v1/events", body)  # the client's retry
    assert again.status_code == 200 and again.json()["duplicate"]
    assert {k: v for k, v in again.json().items() if k != "duplicate"} == {
        k: v for k, v in first.json().items() if k != "duplicate"
    }
    assert get(f"{served['url']}/v1/users/{user}").json()["history_length"] == before + 1


def test_a_state_is_rebuilt_from_the_newest_items_past_its_ceiling(served):
    """However many events a user sends, the cached history stays within max_len + slack
    items: past it the state is rebuilt from the newest max_len (what the ranker trained on),
    and it still ranks as a state built from those items would."""
    user = 8
    lengths = []
    for i in range(3 * (MAX_LEN + SLACK)):
        r = post(served, "/v1/events", {"user_id": user, "item_id": 1 + i % 50, "feedback": 2})
        assert r.status_code == 200, r.text
        lengths.append(r.json()["history_length"])
    assert max(lengths) == MAX_LEN + SLACK and MAX_LEN in lengths
    assert all(
        b == a + 1 or (a == MAX_LEN + SLACK and b == MAX_LEN)
        for a, b in itertools.pairwise(lengths)
    )
    ranked = post(served, "/v1/rank", {"user_id": user, "candidate_item_ids": [3, 4, 5], "k": 3})
    assert ranked.status_code == 200 and ranked.json()["history_length"] == lengths[-1]


def test_settings_reject_unknown_and_bad_values():
    from models.errors import InputError
    from services.settings import ServeSettings

    with pytest.raises(InputError, match=r"ServeSettings: unknown field\(s\) shardz"):
        ServeSettings.from_args({"manifest_uri": "m", "shardz": 2})
    with pytest.raises(InputError, match="shards must be > 0"):
        ServeSettings.from_args({"manifest_uri": "m", "shards": "0"})
    with pytest.raises(InputError, match="max_k: 'many' is not a int"):
        ServeSettings.from_args({"manifest_uri": "m", "max_k": "many"})
    with pytest.raises(InputError, match="item_prior_uri needs item_prior_weight > 0"):
        ServeSettings.from_args({"manifest_uri": "m", "item_prior_uri": "p"})
    with pytest.raises(InputError, match="item_prior_weight is set but item_prior_uri is not"):
        ServeSettings.from_args({"manifest_uri": "m", "item_prior_weight": "0.5"})


def test_fuzzing_the_openapi_schema_gives_no_server_errors(served):
    """Schemathesis generates requests from the app's own OpenAPI schema - valid ones and ones
    that break it (wrong types, missing fields, out-of-range values): none may get a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(served["url"] + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/rank",
        "POST /v1/events",
        "GET /v1/users/{user_id}",
        "GET /healthz",
        "GET /v1/stats",
    }
    calls = []
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=25,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call(
                    base_url=served["url"], timeout=60, headers=bearer(TOKENS["all"])
                )
                calls.append(response.status_code)
                assert response.status_code < 500, (
                    case.method,
                    case.path,
                    case.body,
                    response.text,
                )

            try:
                check()
            except Unsatisfiable:  # no invalid input exists: the operation takes no parameters
                assert mode == GenerationMode.NEGATIVE and op.path in ("/healthz", "/v1/stats")
    assert len(calls) > 100 and any(c == 200 for c in calls) and any(c == 422 for c in calls)


def test_killed_ranker_and_store_replicas_under_load(served):
    """Clients keep ranking and sending events while a Ranker replica and a store replica are
    killed: Serve replaces both, failures are few and each is retried by the client (with the
    event's id), and every acknowledged event was applied exactly once."""
    import threading

    import ray

    url = served["url"]
    user = 2  # shard 0
    # what shard 0 holds before its replica is killed: a user the load leaves alone, with
    # events of its own, and a user that only events made
    for item in (7, 12):
        assert post(served, "/v1/events", {"user_id": 4, "item_id": item}).status_code == 200
    assert post(served, "/v1/events", {"user_id": 2 * 10**6, "item_id": 3}).status_code == 200
    kept = {u: get(f"{url}/v1/users/{u}").json() for u in (4, 2 * 10**6)}
    assert kept[2 * 10**6]["history_length"] == 1
    events_before = get(f"{url}/v1/stats").json()["store"]["events"]
    acked: list[int] = []
    ranked: list[int] = []
    first_failures: list[str] = []
    gave_up: list[str] = []
    stop = threading.Event()

    def call(path: str, body: dict) -> bool:
        for attempt in range(20):  # the client's retry policy: back off, try again
            try:
                r = httpx.post(url + path, json=body, timeout=30, headers=bearer(TOKENS["all"]))
                if r.status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            if attempt == 0:
                first_failures.append(path)
            time.sleep(0.5)
        gave_up.append(path)
        return False

    def events() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"event_id": f"load-{n}", "user_id": user, "item_id": n % 50 + 1}
            if call("/v1/events", body | {"feedback": 1}):  # a retry resends the same event_id
                acked.append(n)

    def ranks() -> None:
        while not stop.is_set():
            if call("/v1/rank", {"user_id": 5, "candidate_item_ids": [1, 2, 3, 4], "k": 2}):
                ranked.append(1)

    def served_more(n: int, within: float, what: str) -> None:
        """Wait until both clients have had ``n`` more answers than now: the app serves again."""
        events_then, ranks_then = len(acked), len(ranked)
        deadline = time.time() + within
        while len(acked) < events_then + n or len(ranked) < ranks_then + n:
            assert time.time() < deadline and not gave_up, f"{what}: {gave_up}"
            time.sleep(0.1)

    threads = [threading.Thread(target=events), threading.Thread(target=ranks)]
    for t in threads:
        t.start()
    try:  # a failed wait must still stop the clients, or their threads outlive the test
        served_more(3, 60, "the load never got going")
        for target in ("Ranker", "UserStateStore0"):
            for a in ray.util.list_named_actors(all_namespaces=True):
                if f"#{target}#" in a["name"]:
                    ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
            served_more(3, 120, f"the app did not serve again after its {target} was killed")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not gave_up, f"requests failed even after retries: {gave_up}"
    assert len(acked) > 5
    assert len(first_failures) <= 40, first_failures  # in flight during the kills, bounded
    # exactly once: the store applied each acknowledged event once - retries of an event whose
    # answer was lost with a killed replica included - and has every one of them
    events_after = get(f"{url}/v1/stats").json()["store"]["events"]
    assert events_after - events_before == len(acked)
    # the replaced store replica reopened the shard's database: what it held is all there
    assert {u: get(f"{url}/v1/users/{u}").json() for u in kept} == kept
    for n in acked[-20:]:
        again = post(
            {"url": url},
            "/v1/events",
            {"event_id": f"load-{n}", "user_id": user, "item_id": n % 50 + 1, "feedback": 1},
        )
        assert again.status_code == 200 and again.json()["duplicate"], again.text

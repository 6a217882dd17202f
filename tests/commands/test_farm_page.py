"""The dashboard's Farm page with Flask's test client on a real Redis and a real echo farm:
its JSON follows the load (the decode queue growing and emptying, the workers' running
counts), the page links both ways with rq-dashboard's, one basic auth covers everything, and
a dead-lettered job requeued from the page completes."""

from __future__ import annotations

import time

import pytest
import redis
from syshax.broker.keys import DEVICE_CLASSES, KEYS
from syshax.broker.schemas import PrefillJob
from syshax.broker.worker_io import WorkQueues
from syshax.shared.sampling import SamplingParams

from syshax.farm_page import FarmPageSettings, make_app
from syshax.farm_page.views import ACTION_HEADER

from ..conftest import wait_for

AUTH = {"Authorization": "Basic YWRtaW46czNjcjN0"}  # admin:s3cr3t


def _client(redis_url: str, keys=KEYS, **kw):
    return make_app(FarmPageSettings(redis_url=redis_url, keys=keys, **kw)).test_client()


def _state(client) -> dict:
    reply = client.get("/farm/state.json")
    assert reply.status_code == 200 and reply.headers["Cache-Control"] == "no-store"
    return reply.get_json()


def _stream(state: dict, name: str) -> dict:
    return next(s for s in state["streams"] if s["name"] == name)


def test_the_state_follows_a_farm_under_load(thread_farm, redis_url):
    farm = thread_farm(gateway=False, workers="echo", slots=2, step_delay=0.03)
    client = _client(redis_url, farm.keys)
    names = {s["name"] for s in _state(client)["streams"]}
    assert names == {"prefill", "prefill:batch"} | {f"decode:{c}" for c in DEVICE_CLASSES}
    rids = [farm.submit(list(range(5, 25)), 30) for _ in range(10)]
    seen = {"decode": 0, "running": {}}

    def loaded() -> bool:
        state = _state(client)
        decode = sum(_stream(state, f"decode:{c}")["length"] for c in DEVICE_CLASSES)
        seen["decode"] = max(seen["decode"], decode)
        for w in state["workers"]:
            seen["running"][w["id"]] = max(seen["running"].get(w["id"], 0), w["running"])
        return seen["decode"] > 0 and all(seen["running"].values())

    assert wait_for(loaded, 10), seen
    state = _state(client)
    assert {w["id"] for w in state["workers"]} == {"xpu", "cpu0"}
    for w in state["workers"]:
        assert w["capacity"] == 2 and w["heartbeat_age_s"] < 5 and w["kv_blocks"] > 0
        assert w["engine"] == "echo"
    assert state["dispatcher"]["decisions"] and all(
        d["device"] in DEVICE_CLASSES and d["reason"] for d in state["dispatcher"]["decisions"]
    )
    assert any(w["step_ms"] for w in state["workers"])  # the decoding worker's fitted step
    busy = [s for s in state["streams"] if s["pending"]]
    assert busy and all(s["oldest_pending_age_s"] is not None for s in busy)
    assert any(c["pending"] for s in busy for c in s["consumers"])
    for rid in rids:
        assert farm.events(rid, 30)[-1].finish_reason == "length"

    def emptied() -> bool:
        state = _state(client)
        return all(s["length"] == 0 for s in state["streams"]) and not any(
            w["running"] for w in state["workers"]
        )

    assert wait_for(emptied, 10), _state(client)


def test_the_pages_link_both_ways(redis_url):
    client = _client(redis_url)
    page = client.get("/farm/").get_data(as_text=True)
    assert 'data-state-url="/farm/state.json"' in page and "farm.js" in page
    for rq_page in ("/", "/0/view/jobs", "/0/view/workers"):
        assert f'href="{rq_page}"' in page
        rq_html = client.get(rq_page).get_data(as_text=True)
        assert '<a href="/farm/" class="nav-link" id="farm-link">Farm</a>' in rq_html, rq_page
    assert client.get("/farm/static/farm.js").status_code == 200


def test_a_url_prefix_prefixes_both(redis_url):
    client = _client(redis_url, url_prefix="/ops")
    assert client.get("/ops/farm/").status_code == 200
    assert 'href="/ops/farm/"' in client.get("/ops/").get_data(as_text=True)
    assert client.get("/farm/").status_code == 404


def test_one_password_guards_both_pages_their_data_and_the_actions(redis_url):
    client = _client(redis_url, username="admin", password="s3cr3t")
    wrong = {"Authorization": "Basic YWRtaW46d3Jvbmc="}  # admin:wrong
    pages = ("/", "/0/view/jobs", "/0/data/queues.json", "/farm/", "/farm/state.json")
    for url in (*pages, "/farm/static/farm.js"):  # the app's check: static files too
        assert client.get(url).status_code == 401, url
        assert client.get(url, headers=wrong).status_code == 401, url
        assert client.get(url, headers=AUTH).status_code == 200, url
    post = client.post("/farm/dead/1-0/drop", headers={ACTION_HEADER: "drop"})
    assert post.status_code == 401
    post = client.post("/farm/dead/1-0/drop", headers={ACTION_HEADER: "drop", **AUTH})
    assert post.status_code == 409 and "no dead letter" in post.get_json()["error"]


def _dead_letter(r: redis.Redis, reason: str, deadline_in: float = -5.0) -> tuple[str, str]:
    """A prefill job dead-lettered as a worker does it (the broker's own call); its deadline
    already past by default, as a dead letter's usually is. Returns (request id, letter id)."""
    now = time.time()
    params = SamplingParams(max_tokens=6, temperature=0.0).to_dict()
    job = PrefillJob(
        request_id="req-dead-1",
        prompt_ids=list(range(7, 19)),
        params=params,
        created=now - 10,
        deadline=now + deadline_in,
    )
    queues = WorkQueues(r, [KEYS.prefill_stream], "gone-worker", KEYS)
    queues.ensure_groups()
    r.xadd(KEYS.prefill_stream, {"j": job.pack()})
    (entry,) = queues.read(1, None)
    queues.dead_letter(entry, reason)
    (letter_id,) = [i.decode() for i, _ in r.xrange(KEYS.dead_letter_stream)]
    return job.request_id, letter_id


def test_a_dead_letter_requeued_from_the_page_completes(thread_farm, redis_url, r):
    rid, letter = _dead_letter(r, "engine error: injected for the test")
    client = _client(redis_url)
    (shown,) = _state(client)["dead_letters"]["entries"]
    assert shown["id"] == letter and shown["request_id"] == rid and shown["requeueable"]
    assert shown["reason"] == "engine error: injected for the test"
    url = f"/farm/dead/{letter}/requeue"
    assert client.get(url).status_code == 405  # an action is never a GET
    assert client.post(url).status_code == 403  # nor a POST without the page's confirmation
    assert r.xlen(KEYS.dead_letter_stream) == 1
    reply = client.post(url, headers={ACTION_HEADER: "requeue"})
    assert reply.status_code == 200 and reply.get_json()["ok"], reply.get_json()
    assert r.xlen(KEYS.dead_letter_stream) == 0
    farm = thread_farm(gateway=False, workers="echo")
    events = farm.events(rid, 15)
    assert events[-1].finish_reason == "length" and len(events) == 6
    again = client.post(url, headers={ACTION_HEADER: "requeue"})
    assert again.status_code == 409  # requeued once, not twice


def test_an_undecodable_dead_letter_can_be_dropped_not_requeued(redis_url, r):
    r.xadd(
        KEYS.dead_letter_stream,
        {"stream": KEYS.prefill_stream, "id": "1-0", "reason": "undecodable job: x", "j": b"\x00"},
    )
    (letter,) = [i.decode() for i, _ in r.xrange(KEYS.dead_letter_stream)]
    client = _client(redis_url)
    (shown,) = _state(client)["dead_letters"]["entries"]
    assert not shown["requeueable"] and shown["request_id"] == ""
    reply = client.post(f"/farm/dead/{letter}/requeue", headers={ACTION_HEADER: "requeue"})
    assert reply.status_code == 409 and "drop it instead" in reply.get_json()["error"]
    assert r.xlen(KEYS.prefill_stream) == 0
    reply = client.post(f"/farm/dead/{letter}/drop", headers={ACTION_HEADER: "drop"})
    assert reply.status_code == 200 and r.xlen(KEYS.dead_letter_stream) == 0


def test_redis_unreachable_is_a_503_with_a_reason():
    client = _client("redis://127.0.0.1:1/0")
    reply = client.get("/farm/state.json")
    assert reply.status_code == 503 and "Redis unreachable" in reply.get_json()["error"]


@pytest.mark.parametrize("action", ["requeue", "drop"])
def test_the_cli_acts_on_dead_letters(redis_url, r, capsys, action):
    from syshax.cli import main

    rid, letter = _dead_letter(r, "job for model 'other'")
    assert main(["dead-letters", "--redis-url", redis_url, "list"]) == 0
    out = capsys.readouterr().out
    assert letter in out and rid in out and "job for model 'other'" in out
    # not a terminal and no --yes: nothing happens
    assert main(["dead-letters", "--redis-url", redis_url, action, letter]) == 1
    assert r.xlen(KEYS.dead_letter_stream) == 1
    assert main(["dead-letters", "--redis-url", redis_url, action, letter, "--yes"]) == 0
    assert r.xlen(KEYS.dead_letter_stream) == 0
    assert r.xlen(KEYS.prefill_stream) == (1 if action == "requeue" else 0)


def test_rq_dashboards_own_assets_are_served(redis_url):
    client = _client(redis_url)
    for asset in ("/static/css/bootstrap.min.css", "/static/js/jquery-3.5.1.min.js"):
        assert client.get(asset).status_code == 200, asset
    assert "/static/css/bootstrap.min.css" in client.get("/farm/").get_data(as_text=True)


def test_kv_leases_and_delivered_tails_are_shown(redis_url, r):
    from syshax.broker import itl_tails
    from syshax.broker.kv_store import KVStore

    KVStore(r, KEYS, ttl=120.0, worker_id="cpu0").put(b"x" * 100, {"num_tokens": 5}, "req-kv")
    now = time.time()
    r.hset(KEYS.itl_tails, "cpu:gw-a", itl_tails.pack(1.7, 400, now))
    r.hset(KEYS.itl_tails, "xpu:gw-a", itl_tails.pack(1.2, 300, now - 60))  # a stopped gateway
    state = _state(_client(redis_url, kv_ttl=120.0))
    (lease,) = state["kv"]["held"]
    assert state["kv"]["count"] == 1 and (lease["owner"], lease["worker"]) == ("req-kv", "cpu0")
    assert lease["bytes"] == 100 and lease["tokens"] == 5
    assert 0 <= lease["age_s"] < 5 and 115 < lease["expires_in_s"] <= 120
    tails = {t["device_class"]: t for t in state["itl_tails"]}
    assert (
        tails["cpu"]["ratio"] == 1.7 and tails["cpu"]["fresh"] and tails["cpu"]["gateway"] == "gw-a"
    )
    assert not tails["xpu"]["fresh"] and tails["xpu"]["age_s"] >= 60

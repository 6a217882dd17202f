"""Offline batches: JSONL -> rq jobs -> the farm -> results, against a real Redis with real
forking rq workers (`syshax batch worker` subprocesses) and a farm of worker threads running
the zero-cost EchoEngine (output token i = prompt token i), so a batch runs in seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from rq import Worker
from rq.job import Job
from syshax.batch import batches, jobs
from syshax.batch.farm_client import FarmClient, settings_from_config
from syshax.batch.lines import parse_lines
from syshax.broker.keys import KEYS
from syshax.broker.schemas import PrefillJob, TokenEvent
from syshax.shared.config import Config, save_config
from syshax.shared.sampling import SamplingParams

from ..conftest import wait_for

MODEL = "SmolLM2-135M-Instruct"
CLI = [sys.executable, "-m", "syshax.cli"]


def echo_farm(thread_farm, slots: int = 8, step_delay: float = 0.002):
    """The farm the batch jobs reach: two echo workers in threads, xpu (prefill + decode) and
    cpu0 (decode), on the default keys."""
    return thread_farm(
        gateway=False,
        workers="echo",
        slots=slots,
        step_delay=step_delay,
        detokenize=True,
        drain=2.0,
    )


class BatchWorkers:
    """`syshax batch worker` (a supervisor forking rq workers) as a subprocess."""

    def __init__(self, config: Path, concurrency: int = 2, extra: tuple[str, ...] = ()):
        argv = CLI + ["batch", "worker", "--config", str(config)]
        argv += ["--concurrency", str(concurrency), "--heartbeat", "1", "--abandon-after", "2"]
        argv += ["--maintenance-interval", "1", "--drain-timeout", "5", *extra]
        self.proc = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def __enter__(self) -> BatchWorkers:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _lines(n: int, max_tokens: int = 4) -> list[str]:
    """n chat requests in the Batch API shape, custom_ids req-0 .. req-{n-1}."""
    url = "/v1/chat/completions"
    messages = [{"role": "user", "content": "hello"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    return [json.dumps({"custom_id": f"req-{i}", "url": url, "body": body}) for i in range(n)]


def _wait(r: redis.Redis, bid: str, timeout: float) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = batches.status(r, bid)
        if st["complete"]:
            return st
        time.sleep(0.5)
    raise AssertionError(f"batch did not complete: {batches.status(r, bid)}")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


# ---- parsing (no Redis) ----------------------------------------------------------------------
def test_parse_lines_reports_bad_lines_and_keeps_the_others():
    lines = [
        json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": []}}),
        "{not json",
        json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions"}),
        json.dumps({"custom_id": "c", "url": "/v1/embeddings", "body": {"input": "x"}}),
        "",
        json.dumps({"custom_id": "d", "model": MODEL, "prompt": "hi"}),
        json.dumps({"custom_id": "a", "model": MODEL, "prompt": "again"}),
        json.dumps({"custom_id": "e", "model": MODEL}),
    ]
    items = parse_lines(lines)
    assert [i.line for i in items] == [1, 2, 3, 4, 6, 7, 8]
    err = {i.line: i.error for i in items}
    assert err[1] is None and err[6] is None
    assert "invalid JSON" in err[2] and "missing body" in err[3]
    assert "unsupported url" in err[4] and "duplicate custom_id" in err[7]
    assert "missing body" in err[8]
    assert items[4].url == "/v1/completions" and items[4].body == {"model": MODEL, "prompt": "hi"}


# ---- the farm client -------------------------------------------------------------------------
def test_farm_client_answers_like_the_gateway(redis_url, config, tokenizer, thread_farm):
    from syshax.shared.config import load_config

    client = FarmClient.from_settings(settings_from_config(load_config(config)), tokenizer)
    with echo_farm(thread_farm):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        res = client.request("/v1/chat/completions", {**body, "n": 2}, priority=1)
        assert res.status_code == 200, res.body
        assert [c["index"] for c in res.body["choices"]] == [0, 1]
        assert res.body["usage"]["completion_tokens"] == 10 and res.tokens == 10
        assert all(c["finish_reason"] == "length" for c in res.body["choices"])
        res = client.request(
            "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
        )
        assert res.status_code == 200 and res.body["object"] == "text_completion"
        assert res.body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    bad = client.request("/v1/chat/completions", {**body, "max_tokens": "5"})
    assert bad.status_code == 400 and bad.body["error"]["param"] == "max_tokens"
    assert client.request("/v1/chat/completions", {**body, "model": "x"}).status_code == 404
    long = client.request("/v1/completions", {"model": MODEL, "prompt": [1] * 600})
    assert long.body["error"]["code"] == "context_length_exceeded"


def test_interactive_request_is_served_before_waiting_batch_requests(
    redis_url, config, tokenizer, thread_farm
):
    from syshax.shared.config import load_config

    client = FarmClient.from_settings(settings_from_config(load_config(config)), tokenizer)
    r = client.r
    plans = []
    for i in range(12):  # queued while the farm is down
        body = {"model": MODEL, "prompt": f"batch request {i}", "max_tokens": 3}
        plans.append(client.prepare("/v1/completions", body))
        client.submit(plans[-1], priority=1)
    rid = "interactive-1"
    params = SamplingParams(max_tokens=3, temperature=0.0).to_dict()
    job = PrefillJob(request_id=rid, prompt_ids=[1, 2, 3], params=params, deadline=time.time() + 60)
    r.xadd(KEYS.prefill_stream, {"j": job.pack()})  # arrives last
    with echo_farm(thread_farm, slots=4, step_delay=0.01):
        for p in plans:
            client.collect(p, timeout=30)
        deadline = time.monotonic() + 10
        while r.xlen(KEYS.output_stream(rid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)

    def first_token_ms(request_id: str) -> int:
        entry_id, fields = r.xrange(KEYS.output_stream(request_id), count=1)[0]
        assert TokenEvent.unpack(fields[b"e"]).seq == 0
        return int(entry_id.split(b"-")[0])

    interactive = first_token_ms(rid)
    batch_firsts = [first_token_ms(p.request_id) for p in plans]
    assert interactive < min(batch_firsts), (interactive, sorted(batch_firsts)[:3])


# ---- whole batches through rq ----------------------------------------------------------------
def test_batch_with_bad_lines_gives_every_result_once_in_input_order(
    redis_url, r, config, thread_farm, tmp_path
):
    lines = _lines(10)
    ids = [f"req-{i}" for i in range(10)]
    wrong_model = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    extra = [
        (2, "{oops", "line-3"),
        (5, json.dumps({"custom_id": "no-body", "url": "/v1/chat/completions"}), "no-body"),
        (7, json.dumps({"custom_id": "bad-url", "url": "/v1/images", "body": {}}), "bad-url"),
        (
            13,
            json.dumps(
                {"custom_id": "wrong-model", "body": wrong_model, "url": "/v1/chat/completions"}
            ),
            "wrong-model",
        ),
        (
            14,
            json.dumps({"custom_id": "bare", "model": MODEL, "prompt": "hi", "max_tokens": 2}),
            "bare",
        ),
    ]
    for pos, text, cid in extra:
        lines.insert(pos, text)
        ids.insert(pos, cid)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with echo_farm(thread_farm), BatchWorkers(config):
        t0 = time.monotonic()
        sub = subprocess.run(
            CLI + ["batch", "submit", str(src), "--out", str(out), "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        elapsed = time.monotonic() - t0
    assert sub.returncode == 1, sub.stderr  # some lines failed
    bid = sub.stdout.strip()
    assert f"{src}:3: invalid JSON" in sub.stderr and f"{src}:6: missing body" in sub.stderr
    assert f"{src}:8: unsupported url" in sub.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in results] == ids
    by_id = {x["custom_id"]: x for x in results}
    assert len(by_id) == len(lines)
    for i in range(10):
        res = by_id[f"req-{i}"]
        assert res["error"] is None and res["response"]["status_code"] == 200
        assert res["response"]["body"]["usage"]["completion_tokens"] == 4
    assert by_id["line-3"]["error"]["message"].startswith("line 3: invalid JSON")
    assert by_id["no-body"]["response"] is None and "line 6" in by_id["no-body"]["error"]["message"]
    assert by_id["wrong-model"]["response"]["status_code"] == 404
    assert by_id["bare"]["response"]["body"]["object"] == "text_completion"
    st = batches.status(r, bid)
    assert (st["total"], st["finished"], st["failed"], st["invalid"]) == (15, 11, 4, 3)
    job = Job.fetch(batches.job_id(bid, 1), connection=r, serializer=jobs.SERIALIZER)
    assert job.meta["tokens"] == 4 and job.meta["attempts"] == 1 and job.meta["request_id"]
    show = subprocess.run(
        CLI + ["batch", "status", bid, "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(show.stdout)["finished"] == 11
    print(f"15-line batch: {elapsed:.1f}s")


def _run_batch(redis_url, r, config, thread_farm, n: int, concurrency: int) -> float:
    with echo_farm(thread_farm, slots=16, step_delay=0.0), BatchWorkers(config, concurrency):
        t0 = time.monotonic()
        bid = batches.submit(r, parse_lines(_lines(n, max_tokens=2)))
        _wait(r, bid, timeout=600)
        elapsed = time.monotonic() - t0
    results = list(batches.results(r, bid))
    assert [line for line, _, _ in results] == list(range(1, n + 1))
    assert [x["custom_id"] for _, _, x in results] == [f"req-{i}" for i in range(n)]
    assert all(x["response"]["status_code"] == 200 for _, _, x in results)
    print(f"{n} requests, concurrency {concurrency}: {elapsed:.1f}s ({n / elapsed:.0f} req/s)")
    return elapsed


def test_batch_of_200_short_requests_completes_with_every_result_once(
    redis_url, r, config, thread_farm
):
    _run_batch(redis_url, r, config, thread_farm, 200, concurrency=4)


@pytest.mark.slow
def test_batch_of_1000_short_requests_completes_with_every_result_once(
    redis_url, r, config, thread_farm
):
    _run_batch(redis_url, r, config, thread_farm, 1000, concurrency=4)


def test_batch_survives_a_killed_rq_worker(redis_url, r, config, thread_farm):
    n = 24
    with echo_farm(thread_farm, slots=8, step_delay=0.02), BatchWorkers(config, 2):
        bid = batches.submit(r, parse_lines(_lines(n, max_tokens=30)))
        victim = None
        end = time.monotonic() + 60
        while victim is None and time.monotonic() < end:
            for w in Worker.all(connection=r):
                if w.get_current_job_id() and _children(w.pid):
                    victim = w
                    break
            time.sleep(0.05)
        assert victim is not None, "no rq worker got busy"
        job_id = victim.get_current_job_id()
        horses = _children(victim.pid)
        os.kill(victim.pid, signal.SIGKILL)  # the rq worker and its work horse die at once
        for pid in horses:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        st = _wait(r, bid, timeout=120)
        recovered = time.monotonic() - t0
    assert st["finished"] == n, st
    results = list(batches.results(r, bid))
    assert [x["custom_id"] for _, _, x in results] == [f"req-{i}" for i in range(n)]
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 30 for _, _, x in results)
    job = Job.fetch(job_id, connection=r, serializer=jobs.SERIALIZER)
    assert job.meta["attempts"] == 2, job.meta  # retried once, after rq found it abandoned
    print(f"batch completed {recovered:.1f}s after the kill")


# ---- rq-dashboard ----------------------------------------------------------------------------
def test_dashboard_shows_batch_jobs_behind_basic_auth(redis_url, r, config):
    import httpx
    from syshax.broker.embedded import free_port

    bid = batches.submit(r, parse_lines(_lines(3)))  # no worker: they stay queued
    port = free_port()
    argv = CLI + ["dashboard", "--config", str(config), "--port", str(port)]
    env = {**os.environ, "RQ_DASHBOARD_PASSWORD": "s3cret"}
    proc = subprocess.Popen(argv + ["--username", "ops"], env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(base + "/", timeout=2).status_code == 401
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < end
                time.sleep(0.2)
        auth = ("ops", "s3cret")
        queues = httpx.get(base + "/0/data/queues.json", auth=auth).json()["queues"]
        assert {q["name"]: q["count"] for q in queues}[KEYS.batch_queue] == 3
        job = httpx.get(f"{base}/0/data/job/{batches.job_id(bid, 1)}.json", auth=auth).json()
        assert job["status"] == "queued" and bid in job["description"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_dashboard_without_redis_url_is_a_clear_error(tmp_path):
    cfg = tmp_path / "empty.yaml"
    save_config(Config(), cfg)
    res = subprocess.run(
        CLI + ["dashboard", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "no Redis URL" in res.stderr


def test_cancel_stops_waiting_and_running_requests(redis_url, r, config, thread_farm, tmp_path):
    n = 12
    with echo_farm(thread_farm, slots=4, step_delay=0.02), BatchWorkers(config, 2):
        bid = batches.submit(r, parse_lines(_lines(n, max_tokens=400)))  # ~8 s each
        end = time.monotonic() + 30
        while batches.status(r, bid)["started"] < 2 and time.monotonic() < end:
            time.sleep(0.1)
        res = subprocess.run(
            CLI + ["batch", "cancel", bid, "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0 and "stopping 2 running" in res.stdout, res
        st = _wait(r, bid, timeout=30)
        running = [
            j
            for j in Job.fetch_many(
                [batches.job_id(bid, i) for i in range(1, n + 1)], r, serializer=jobs.SERIALIZER
            )
            if j.meta.get("request_id")
        ]
        assert len(running) == 2
        rid = running[0].meta["request_id"]
        n_tokens = r.xlen(KEYS.output_stream(rid))
        time.sleep(0.5)
        assert r.xlen(KEYS.output_stream(rid)) == n_tokens < 400, "the farm stopped generating"
    assert st["cancelled"] == n and st["finished"] == 0, st
    out = tmp_path / "out.jsonl"
    res = subprocess.run(
        CLI + ["batch", "results", bid, "--out", str(out), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in results] == [f"req-{i}" for i in range(n)]
    assert all(x["error"]["code"] == "batch_cancelled" for x in results)


# ---- queued work is data, never code ---------------------------------------------------------
def test_a_job_naming_another_function_never_runs(redis_url, r, config, thread_farm, tmp_path):
    from rq import Queue
    from rq.registry import FailedJobRegistry

    planted_json = tmp_path / "planted-json"
    planted_pickle = tmp_path / "planted-pickle"
    # Anyone who can write to the queue could name any function: as JSON (our serializer)...
    Queue(KEYS.batch_queue, connection=r, serializer=jobs.SERIALIZER).enqueue(
        "os.system", f"touch {planted_json}", job_id="planted-json"
    )
    # ... or as a pickle (rq's default serializer: unpickling alone would run its code).
    Queue(KEYS.batch_queue, connection=r).enqueue(
        "os.system", f"touch {planted_pickle}", job_id="planted-pickle"
    )
    with echo_farm(thread_farm), BatchWorkers(config):
        bid = batches.submit(r, parse_lines(_lines(3)))  # the real jobs still run
        st = _wait(r, bid, timeout=120)
        failed = FailedJobRegistry(KEYS.batch_queue, connection=r, serializer=jobs.SERIALIZER)
        assert wait_for(lambda: len(failed.get_job_ids()) == 2, 30), failed.get_job_ids()
    assert st["finished"] == 3, st
    assert not planted_json.exists() and not planted_pickle.exists(), "a planted job ran"
    reasons = {
        jid: Job.fetch(jid, connection=r, serializer=jobs.SERIALIZER).latest_result().exc_string
        for jid in ("planted-json", "planted-pickle")
    }
    assert "function 'os.system' is not a farm batch function" in reasons["planted-json"]
    assert "not JSON (pickled jobs are never loaded)" in reasons["planted-pickle"]

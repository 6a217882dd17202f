"""Soak run: a mixed OpenAI workload through a launched farm for a while, then what is left.

A farm as `syshax run` lays it out (embedded Redis, gateway, workers; the bundled model unless
--load) serves --concurrency clients for --seconds. Each request is one of these kinds, drawn at
random (seeded), through the official `openai` client, and checked as a user would:

* stream: sampled chat, streamed, with usage: text arrives, `finish_reason` stop or length,
  usage matches the chunks' count of tokens at most;
* n2: two sampled choices in one response: two choices, indexes 0 and 1;
* json: `response_format` json_schema (strict): the text parses as JSON of the schema's keys
  and types whenever it ended with `stop`;
* tools: one function tool, `tool_choice` required: a call to it whose arguments parse as JSON
  with the required key;
* logprobs: greedy, `logprobs` with 3 top logprobs: one entry per completion token, the chosen
  token the first of its top ones;
* stop: streamed, `stop` ["."]: no "." in the text;
* abort: streamed, the client hangs up after 3 chunks (the farm must let go of it);
* completions: legacy endpoint, `logprobs` 2;
* penalties: presence / frequency / repetition penalties and a logit_bias;
* bad: a malformed request (wrong type, out of range, unknown field, unknown role): a 400 in
  OpenAI's error format, never a 5xx.

With --kill-every S, a CPU decode worker that is running requests is SIGKILLed every ~S
seconds and replaced at once (as `syshax run` restarts a child; --cpu-workers sets how many
there are): the requests it held resume on another worker and must still pass their checks
(a grammar or a tool call rebuilt from the tokens so far, no stop string let through); the
table counts, per kind, the requests served by more than one decode worker.

Then, once the farm is idle: KV leases and shared-memory segments, stream and pending entries,
running sequences and held KV blocks (bench/chaos.py's `leftovers`; all should be 0), Redis
keys without a TTL against before the run, and each farm process's resident memory after a
warm-up against after the run. Exits 1 if any check failed or anything was left.

    python bench/soak.py                         # 6 clients, 300 s, the bundled model
    python bench/soak.py --seconds 60 --concurrency 4
    python bench/soak.py --seconds 120 --cpu-workers 2 --kill-every 3
    python bench/soak.py --set speculative.method=ngram --set kv.cache_dtype=q8_0
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import redis
from syshax.broker.keys import KEYS
from syshax.broker.schemas import entry_events

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from chaos import leftovers  # noqa: E402
from serve_launch import config_setting, launched_farm  # noqa: E402

KINDS = (
    "stream",
    "n2",
    "json",
    "tools",
    "logprobs",
    "stop",
    "abort",
    "completions",
    "penalties",
    "bad",
)
TOPICS = ["rivers", "bread", "the moon", "a red bicycle", "winter", "bees", "the sea", "old maps"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
BAD = [
    {"temperature": "hot"},
    {"n": 99},
    {"max_tokens": -1},
    {"frobnicate": True},
    {"messages": [{"role": "robot", "content": "hi"}]},
    {"logit_bias": {"99999999": 5}},
    {"top_logprobs": 3},  # without logprobs
]


def user(rng: random.Random, ask: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{ask} {rng.choice(TOPICS)}."}]


def one(client: openai.OpenAI, model: str, kind: str, rng: random.Random, ids: list[str]) -> str:
    """Runs one request of `kind`; returns "" if it behaved, else what was wrong. The
    completion's id goes into `ids` (its output record tells which workers served it)."""
    seed = rng.randrange(1 << 30)
    if kind == "stream":
        n_tokens, text, finish, usage = 0, "", None, None
        for ch in client.chat.completions.create(model=model, messages=user(rng, "Write two sentences about"), max_tokens=rng.randint(16, 64), temperature=0.8, top_p=0.9, seed=seed, stream=True, stream_options={"include_usage": True}):  # fmt: skip
            usage = ch.usage or usage
            ids[-1:] = [ch.id]
            for c in ch.choices:
                text += c.delta.content or ""
                n_tokens += bool(c.delta.content)
                finish = c.finish_reason or finish
        if finish not in ("stop", "length") or not text or usage is None:
            return f"finish {finish}, {len(text)} chars, usage {usage}"
        return (
            ""
            if usage.completion_tokens >= n_tokens
            else f"usage {usage.completion_tokens} < {n_tokens} chunks"
        )
    if kind == "n2":
        r = client.chat.completions.create(model=model, messages=user(rng, "Name a colour for"), n=2, max_tokens=24, temperature=1.0, seed=seed)  # fmt: skip
        ids.extend(f"{r.id}-{i}" for i in range(2))  # each choice runs as a job of its own
        return (
            ""
            if sorted(c.index for c in r.choices) == [0, 1]
            else f"choices {[c.index for c in r.choices]}"
        )
    if kind == "json":
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        }
        r = client.chat.completions.create(model=model, messages=user(rng, "Invent a person who likes"), response_format=fmt, max_tokens=96, temperature=0.7, seed=seed)  # fmt: skip
        ids.append(r.id)
        c = r.choices[0]
        if c.finish_reason != "stop":
            return ""  # cut by max_tokens: allowed to be incomplete
        try:
            obj = json.loads(c.message.content)
        except ValueError as exc:
            return f"not JSON ({exc}): {c.message.content!r}"
        ok = (
            set(obj) == {"name", "age"}
            and isinstance(obj["name"], str)
            and isinstance(obj["age"], int)
        )
        return "" if ok else f"not the schema: {obj!r}"
    if kind == "tools":
        r = client.chat.completions.create(model=model, messages=user(rng, "What is the weather like in the city of"), tools=[TOOL], tool_choice="required", max_tokens=96, temperature=0.5, seed=seed)  # fmt: skip
        ids.append(r.id)
        c = r.choices[0]
        if c.finish_reason == "length":
            return ""
        calls = c.message.tool_calls or []
        if c.finish_reason != "tool_calls" or not calls:
            return f"finish {c.finish_reason}, calls {calls}"
        for call in calls:
            args = json.loads(call.function.arguments)
            if call.function.name != "get_weather" or not isinstance(args.get("city"), str):
                return f"bad call {call.function.name} {args!r}"
        return ""
    if kind == "logprobs":
        r = client.chat.completions.create(model=model, messages=user(rng, "Say one word about"), logprobs=True, top_logprobs=3, max_tokens=16, temperature=0)  # fmt: skip
        ids.append(r.id)
        entries = r.choices[0].logprobs.content or []
        if len(entries) != r.usage.completion_tokens:
            return f"{len(entries)} logprob entries for {r.usage.completion_tokens} tokens"
        bad = [e for e in entries if not e.top_logprobs or e.top_logprobs[0].token != e.token or len(e.top_logprobs) > 3]  # fmt: skip
        return f"{len(bad)} entries whose chosen token is not the first top one" if bad else ""
    if kind == "stop":
        text = ""
        for ch in client.chat.completions.create(model=model, messages=user(rng, "Write three sentences about"), stop=["."], max_tokens=64, temperature=0.7, seed=seed, stream=True):  # fmt: skip
            text += "".join(c.delta.content or "" for c in ch.choices)
            ids[-1:] = [ch.id]
        return f"stop string in the text: {text!r}" if "." in text else ""
    if kind == "abort":
        stream = client.chat.completions.create(model=model, messages=user(rng, "Write a long story about"), max_tokens=200, temperature=0.8, seed=seed, stream=True)  # fmt: skip
        for i, ch in enumerate(stream):
            ids[-1:] = [ch.id]
            if i >= 2:
                break
        stream.close()  # the client hangs up mid-answer
        return ""
    if kind == "completions":
        r = client.completions.create(model=model, prompt=f"A short note on {rng.choice(TOPICS)}:", max_tokens=24, logprobs=2, temperature=0.7, seed=seed)  # fmt: skip
        ids.append(r.id)
        lp = r.choices[0].logprobs
        return "" if lp and len(lp.tokens) == r.usage.completion_tokens else f"logprobs {lp}"
    if kind == "penalties":
        r = client.chat.completions.create(model=model, messages=user(rng, "List words about"), max_tokens=32, temperature=0.7, seed=seed, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"13": -100}, extra_body={"repetition_penalty": 1.1})  # fmt: skip
        ids.append(r.id)
        return (
            ""
            if r.choices[0].finish_reason in ("stop", "length")
            else f"finish {r.choices[0].finish_reason}"
        )
    if kind == "bad":
        body = {
            "model": model,
            "messages": user(rng, "Hi about"),
            "max_tokens": 8,
            **rng.choice(BAD),
        }
        try:
            client.post("/chat/completions", body=body, cast_to=object)
        except openai.BadRequestError as exc:
            err = (exc.body or {}) if isinstance(exc.body, dict) else {}
            return (
                ""
                if err.get("message") and err.get("type")
                else f"400 without OpenAI's error fields: {exc.body}"
            )
        except openai.APIStatusError as exc:
            return f"HTTP {exc.status_code} for {body}"
        return f"accepted: {body}"
    raise ValueError(kind)


def farm_processes() -> dict[str, int]:
    """Resident KiB of this process's children (the farm: Redis, gateway, workers) by name."""
    me, out = os.getpid(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != me:
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except (OSError, ValueError):
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        name = next((words[i + 1] for i, a in enumerate(words[:-1]) if a == "--id"), None)
        name = name or next(
            (w for w in ("gateway", "redis-server") if any(w in a for a in words)), f"pid{pid}"
        )
        rss = next(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
        )
        out[name] = rss
    return out


def busy_worker(r: redis.Redis, name: str) -> bool:
    """Whether worker `name`'s heartbeat says it runs or queues sequences."""
    h = r.hgetall(KEYS.worker(name))
    return bool(h) and int(h.get(b"running", 0)) + int(h.get(b"waiting", 0)) > 0


def served_by_several(r: redis.Redis, request_id: str) -> bool:
    """Whether the output record of `request_id` holds decode events of more than one worker
    (it was resumed after its worker died; the first event is the prefill's)."""
    evs = [ev for _, f in r.xrange(KEYS.output_stream(request_id)) for ev in entry_events(f)]
    return len({e.worker for e in evs[1:]}) > 1


def keys_without_ttl(r: redis.Redis) -> Counter:
    """Redis keys that never expire, counted by their name up to the last ':' segment."""
    counts: Counter = Counter()
    for key in r.scan_iter(count=1000):
        if r.ttl(key) == -1:
            counts[key.decode(errors="replace").rsplit(":", 1)[0]] += 1
    return counts


def run(args: argparse.Namespace) -> int:
    info: dict[str, Any] = {}
    with launched_farm(args, info) as base_url:
        r = redis.Redis.from_url(info["redis_url"])
        shm_glob = "/dev/shm/*syshax*"
        shm_before = set(glob.glob(shm_glob))
        client = openai.OpenAI(
            base_url=base_url, api_key="none", max_retries=0, timeout=args.timeout
        )
        model = client.models.list().data[0].id
        results: list[tuple[str, str, float, list[str]]] = []  # kind, problem, seconds, ids
        warm = random.Random(args.seed)
        for kind in KINDS:  # each path once, so what it allocates for good counts as the base
            t0, ids = time.monotonic(), []
            results.append((kind, one(client, model, kind, warm, ids), time.monotonic() - t0, ids))
        keys_before, rss_before = keys_without_ttl(r), farm_processes()
        lock, end = threading.Lock(), time.monotonic() + args.seconds

        def client_loop(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < end:
                kind, ids = rng.choice(KINDS), []
                t0 = time.monotonic()
                try:
                    problem = one(client, model, kind, rng, ids)
                except openai.APIStatusError as exc:
                    problem = f"HTTP {exc.status_code}: {str(exc)[:200]}"
                except Exception as exc:  # noqa: BLE001 - counted, not raised
                    problem = f"{type(exc).__name__}: {str(exc)[:200]}"
                with lock:
                    results.append((kind, problem, time.monotonic() - t0, ids))

        kills: list[str] = []
        stop = threading.Event()

        def killer() -> None:
            rng = random.Random(args.seed + 7)
            while not stop.wait(args.kill_every * rng.uniform(0.5, 1.5)):
                busy = [
                    n
                    for n in info["farm"].worker_names()
                    if n.startswith("cpu-worker") and busy_worker(r, n)
                ]
                if busy:
                    name = rng.choice(sorted(busy))
                    info["farm"].kill(name)
                    kills.append(name)
                    info["start_cpu_worker"](
                        f"cpu-worker-r{len(kills)}"
                    )  # the replacement, at once

        if args.kill_every:
            threading.Thread(target=killer, daemon=True).start()
        print(f"# soak: {args.concurrency} clients for {args.seconds:.0f} s against {base_url} ({model}); logs in {info['logdir']}", file=sys.stderr)  # fmt: skip
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(client_loop, range(args.concurrency)))
        stop.set()
        deadline, left = time.monotonic() + args.settle, leftovers(r, shm_glob, shm_before)
        while any(left.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
            left = leftovers(r, shm_glob, shm_before)
        keys_after, rss_after = keys_without_ttl(r), farm_processes()
        resumed = Counter(
            kind for kind, _, _, ids in results if any(served_by_several(r, i) for i in ids)
        )

    by_kind: dict[str, Counter] = {k: Counter() for k in KINDS}
    problems: Counter = Counter()
    for kind, problem, _, _ in results:
        by_kind[kind]["ok" if not problem else "failed"] += 1
        if problem:
            problems[f"{kind}: {problem[:160]}"] += 1
    print(
        f"{len(results)} requests in {args.seconds:.0f} s, {args.concurrency} clients, {len(kills)} CPU decode workers killed"
    )
    print(f"{'kind':<12} {'ok':>5} {'failed':>6} {'resumed':>7} {'p50 s':>6} {'max s':>6}")
    for kind in KINDS:
        secs = sorted(s for k, _, s, _ in results if k == kind) or [0.0]
        print(f"{kind:<12} {by_kind[kind]['ok']:>5} {by_kind[kind]['failed']:>6} {resumed[kind]:>7} {secs[len(secs) // 2]:>6.2f} {secs[-1]:>6.2f}")  # fmt: skip
    for text, count in problems.most_common(20):
        print(f"  {count} x {text}")
    print("left once idle:", json.dumps(left))
    grown = {
        k: keys_after[k] - keys_before[k] for k in keys_after if keys_after[k] > keys_before[k]
    }
    print(f"Redis keys without a TTL: {sum(keys_before.values())} before, {sum(keys_after.values())} after; grown: {grown or 'none'}")  # fmt: skip
    for name in sorted(rss_after):
        before = rss_before.get(name)
        delta = f"{(rss_after[name] - before) / 1024:+.1f} MiB" if before else "(new)"
        print(f"  RSS {name}: {rss_after[name] / 1024:.1f} MiB ({delta} since the warm-up)")
    return 1 if problems or any(left.values()) or grown else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--seconds", type=float, default=300, help="how long the clients send requests (default %(default)s)")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=6, help="clients sending at once (default %(default)s)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default %(default)s)")  # fmt: skip
    p.add_argument("--load", type=Path, default=None, help="model file to serve (default: the bundled SmolLM2)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=300, help="per-request client timeout, s (default %(default)s)")  # fmt: skip
    p.add_argument("--settle", type=float, default=30, help="how long to wait for the farm to be idle, s (default %(default)s)")  # fmt: skip
    p.add_argument("--cpu-workers", type=int, default=None, help="CPU decode workers beside the xPU-role one (default: syshax run's layout)")  # fmt: skip
    p.add_argument("--kill-every", type=float, default=0, help="SIGKILL a busy CPU decode worker about every this many seconds, and replace it (default 0: never)")  # fmt: skip
    p.add_argument("--set", type=config_setting, action="append", metavar="KEY=VALUE", help="a config key of the launched farm (dotted for sections: speculative.method=ngram), repeatable; checked as `syshax config KEY VALUE` checks it")  # fmt: skip
    args = p.parse_args(argv)
    # what serve_launch.launched_farm reads: the product's layout, engines and defaults
    args.launch, args.threads, args.max_batch_size, args.launch_timeout = "native", None, 16, 300
    return args


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(parse_args(argv)))


if __name__ == "__main__":
    main()

"""Hostile input gets a 4xx in OpenAI's error shape, never a 5xx: schemathesis cases from the
gateway's own OpenAPI schema, hypothesis-made bodies (raw bytes, lone surrogates, absurd
numbers), oversize bodies (413), invalid UTF-8 (400). Malformed messages written straight onto
the work streams go to the dead-letter stream, and the queue keeps flowing."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from syshax.broker.keys import KEYS

from ..farm_procs import ProcFarm
from .conftest import MODEL, expected_text, messages

schemathesis = pytest.importorskip("schemathesis")

FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def farm(tmp_path_factory) -> Iterator[ProcFarm]:
    farm = ProcFarm(tmp_path_factory.mktemp("hostile"), max_model_len=256, request_timeout=20)
    try:
        farm.start_gateway()
        farm.start_worker("xpu", roles="prefill,decode", device_class="xpu")
        farm.wait_registered(["xpu"])
        farm.wait_healthy()
        yield farm
    finally:
        farm.stop()


def assert_error_shape(r: httpx.Response | object, status: int | None = None) -> None:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    if status is not None:
        assert r.status_code == status, (r.status_code, body)


def test_schemathesis_cases_never_get_a_5xx(farm):
    schema = schemathesis.openapi.from_url(farm.url() + "/openapi.json")
    modes = schemathesis.GenerationMode
    cases = schema.as_strategy(modes.POSITIVE) | schema.as_strategy(modes.NEGATIVE)
    seen: dict[int, int] = {}

    @FUZZ
    @given(case=cases, served=st.booleans())
    def fuzz(case, served: bool) -> None:
        if served and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # else nearly every valid body is a 404 (unknown model)
        r = case.call(base_url=farm.url(), timeout=30)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (case.method, case.path, case.body, r.text[:300])
        if r.status_code >= 400:
            assert_error_shape(r)

    fuzz()
    print("schemathesis statuses", seen)
    assert any(s < 300 for s in seen) and any(400 <= s < 500 for s in seen), seen
    assert farm.alive("gateway") and "Traceback" not in farm.log("gateway")


# Any JSON value, strings with lone surrogates included (json.dumps escapes them as \udXXX).
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(codec=None, exclude_categories=()), max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stop"]
FIELDS += ["temperature", "top_p", "top_k", "seed", "stream", "stream_options", "logprobs"]
FIELDS += ["top_logprobs", "echo", "suffix", "best_of", "ignore_eos", "user"]


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["fields", "fields", "json", "bytes"]))
    if kind == "bytes":  # raw bytes: invalid UTF-8, truncated JSON, NUL bytes...
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    base = {"model": MODEL, "messages": messages(0), "prompt": "hi", "max_tokens": 4}
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        base[key] = draw(JSON)
    return json.dumps(base).encode()


def test_hypothesis_bodies_never_get_a_5xx(farm):
    client = httpx.Client(base_url=farm.url(), timeout=30)

    @FUZZ
    @given(body=bodies(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def fuzz(body: bytes, path: str) -> None:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code < 500, (body[:300], r.text[:300])
        if r.status_code != 200:
            assert_error_shape(r)

    try:
        fuzz()
    finally:
        client.close()


@pytest.mark.parametrize(
    "patch",
    [
        {"max_tokens": 10**30},
        {"max_tokens": 0},
        {"max_tokens": 1e400},  # json.dumps writes Infinity
        {"n": 10**30},
        {"n": 0},
        {"top_k": 2**70},
        {"seed": 2**70},
        {"temperature": float("nan")},
        {"messages": [{"role": "user", "content": "\ud800 lone surrogate"}]},
        {"stop": ["\udfff"]},
    ],
)
def test_absurd_values_are_400(farm, patch):
    body = {"model": MODEL, "messages": messages(0), "max_tokens": 4, **patch}
    r = httpx.post(farm.url() + "/v1/chat/completions", content=json.dumps(body), timeout=10)
    assert_error_shape(r, 400)


@pytest.mark.parametrize(
    "raw", [b'{"model": "\xff\xfe"}', b"\xc3\x28", '{"model": "\u00e9"}'.encode("latin-1")]
)
def test_invalid_utf8_is_400(farm, raw):
    r = httpx.post(farm.url() + "/v1/chat/completions", content=raw, timeout=10,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert_error_shape(r, 400)
    assert r.json()["error"]["code"] == "invalid_json"


def test_oversize_body_is_413_declared_or_chunked(farm):
    big = b'{"model": "m", "prompt": "' + b"a" * (11 * 2**20) + b'"}'
    url = farm.url() + "/v1/completions"
    r = httpx.post(url, content=big, timeout=30)  # Content-Length: refused before reading
    assert_error_shape(r, 413)
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 2**20):
            yield big[i : i + 2**20]

    r = httpx.post(url, content=chunks(), timeout=30)
    assert_error_shape(r, 413)
    ok = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def job(**fields) -> bytes:
    base = {"v": 1, "request_id": "poison", "prompt_ids": [1, 2], "params": {}}
    return msgpack.packb({**base, **fields})


POISON = {
    "no job field": {"x": b"1"},
    "not msgpack": {"j": b"\xc1\xc1"},
    "not a map": {"j": msgpack.packb([1, 2, 3])},
    "wrong version": {"j": job(v=99)},
    "unknown field": {"j": job(zzz=1)},
    "wrong type": {"j": job(request_id=5)},
    "str token ids": {"j": job(prompt_ids=["a"])},
    "bytes for str": {"j": job(request_id=b"\xff")},
    "param type": {"j": job(params={"max_tokens": "x"})},
    "param unknown": {"j": job(params={"bogus": 1})},
    "param float seed": {"j": job(params={"seed": 1.5})},
    "param str stop id": {"j": job(params={"stop_token_ids": ["a"]})},
    "param bad compare": {"j": job(params={"temperature": "hot"})},
    "int map key": {"j": msgpack.packb({1: 2})},
    "deep nesting": {"j": b"\x91" * 100_000 + b"\xc0"},
    "huge garbage": {"j": b"\xc1" * (4 * 2**20)},
}
POISON_DECODE = {
    "kv unknown key": {"j": job(output_ids=[1], kv={"foo": 1})},
    "kv wrong type": {"j": job(output_ids=[1], kv={"handle_id": 5})},
}


def test_malformed_messages_go_to_dead_letter_and_the_queue_keeps_flowing(farm, tokenizer):
    farm.r.delete(KEYS.dead_letter_stream)
    for fields in POISON.values():
        farm.r.xadd(KEYS.prefill_stream, fields)
    for fields in POISON_DECODE.values():
        farm.r.xadd(KEYS.decode_stream("xpu"), fields)
    # Valid types, absurd sizes: refused with an error event for that request only.
    farm.r.xadd(KEYS.prefill_stream, {"j": job(request_id="huge", prompt_ids=[7] * 200_000)})
    client = farm.client()
    resp = client.chat.completions.create(model=MODEL, messages=messages(3), max_tokens=8)
    assert resp.choices[0].message.content == expected_text(tokenizer, messages(3), 8)
    dead = farm.r.xrange(KEYS.dead_letter_stream)
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert len(dead) == len(POISON) + len(POISON_DECODE), reasons
    assert all("undecodable" in r for r in reasons)
    huge = farm.events("huge")
    assert len(huge) == 1 and huge[0].error["type"] == "invalid_request_error"
    assert farm.alive("xpu") and "Traceback" not in farm.log("xpu"), farm.log("xpu")[-3000:]
    assert farm.wait_quiescent()["entries"] == 0

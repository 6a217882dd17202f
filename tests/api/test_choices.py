"""`Choice.apply`: the one rule that turns a choice's token events into its answer (the
gateway's streams, its resumed streams and the batch client all use it), and the
non-streaming body built from the choices."""

from __future__ import annotations

from syshax.api.choices import Choice, completion_body
from syshax.api.prepare import CHAT, TEXT
from syshax.broker.schemas import TokenEvent

from ..lightness import assert_loads_without


def ev(seq: int, token_id: int = -1, text: str = "", **kw) -> TokenEvent:
    return TokenEvent(request_id="r", seq=seq, token_id=token_id, text=text, **kw)


def test_events_build_the_choice_and_repeats_are_dropped() -> None:
    c = Choice(0, "r")
    assert c.apply(ev(0, 5, "Hi", logprob=-0.5))
    assert not c.apply(ev(0, 5, "Hi"))  # at least once: the repeat of a resumed worker
    assert c.apply(ev(1, 6, " there"))
    assert c.apply(ev(2, 2, "", finish_reason="stop"))  # the eos counts as a token
    assert (c.text, c.token_ids, c.logprobs) == (
        ["Hi", " there", ""],
        [5, 6, 2],
        [-0.5, None, None],
    )
    assert (c.tokens, c.last_seq, c.finish_reason, c.done) == (3, 2, "stop", True)
    assert not c.apply(ev(3, 7, "late"))  # nothing after the end
    assert c.tokens == 3 and c.text[-1] == ""


def test_an_error_ends_the_choice_and_a_final_event_may_carry_no_token() -> None:
    c = Choice(1, "r-1")
    c.apply(ev(0, 5, "a"))
    assert c.apply(ev(1, error={"message": "boom", "type": "server_error", "code": 500}))
    assert c.done and c.error == {"message": "boom", "type": "server_error", "code": 500}
    assert c.finish_reason is None and c.tokens == 1 and c.token_ids == [5]


def test_a_choice_resumed_after_a_cursor_takes_only_newer_events() -> None:
    c = Choice(0, "r", last_seq=1)
    assert not c.apply(ev(1, 6, "old"))
    assert c.apply(ev(2, 7, "new", finish_reason="length"))
    assert c.text == ["new"] and c.tokens == 1


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_completion_body_of_finished_choices() -> None:
    a, b = Choice(0, "r-0"), Choice(1, "r-1")
    for c, words in ((a, ["x", "y"]), (b, ["z"])):
        for i, w in enumerate(words):
            c.apply(ev(i, 10 + i, w, logprob=-1.0))
        c.apply(ev(len(words), finish_reason="length"))
    body = completion_body(CHAT, "r", 7, "m", [a, b], 4, True, _Tok())
    assert body["object"] == "chat.completion" and body["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}  # fmt: skip
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "xy"}
    assert [t["token"] for t in body["choices"][0]["logprobs"]["content"]] == ["<10>", "<11>"]
    text = completion_body(TEXT, "r", 7, "m", [a], 4, False, _Tok())
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "xy"
    assert text["choices"][0]["logprobs"] is None
    assert text["choices"][0]["finish_reason"] == "length"


def test_the_api_layer_loads_without_torch_or_a_web_framework() -> None:
    code = "import syshax.api.prepare, syshax.api.choices, syshax.api.errors, syshax.api.settings"
    assert_loads_without(code, ("torch", "fastapi", "starlette", "uvicorn"))

"""Errors in OpenAI's shape, worded once for the gateway and batch/: a body the schemas refuse
(validated by FastAPI or by hand) and a worker's error event."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from syshax.api.errors import body_error, validation_error, worker_error
from syshax.api.schemas import ChatCompletionRequest, CompletionRequest


def refused(schema, body) -> ValidationError:
    with pytest.raises(ValidationError) as err:
        schema.model_validate(body)
    return err.value


def test_a_body_validated_by_hand_is_worded_as_fastapi_locates_it() -> None:
    exc = refused(ChatCompletionRequest, {"messages": [{"role": 1}]})
    located = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    err = body_error(exc)
    assert err.body() == validation_error(located).body()
    assert (err.status, err.param, err.code) == (400, "messages[0].role", "invalid_value")
    assert err.message.startswith("messages[0].role: ")


def test_a_union_field_names_its_members_together() -> None:
    err = body_error(refused(CompletionRequest, {"prompt": 5}))
    assert err.param == "prompt" and "; or " in err.message


@pytest.mark.parametrize(
    "error, status",
    [
        ({"message": "m", "type": "invalid_request_error", "code": 400}, 400),
        ({"message": "m", "type": "overloaded"}, 503),
        ({"message": "m", "type": "timeout"}, 504),
        ({"message": "m", "type": "server_error", "code": True}, 500),
        (None, 500),
    ],
)
def test_a_worker_error_has_the_status_its_code_or_type_says(error, status) -> None:
    err = worker_error(error)
    assert err.status == status and set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert ("Retry-After" in err.headers) == (status == 503)

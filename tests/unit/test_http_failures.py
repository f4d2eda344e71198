"""The HTTP edge of the failure type (node/http/failures.py): once the entry has done what it could, each kind leaves
the API with the status that tells the client what to do, in an OpenAI error object: 503 with Retry-After when later
may work, 400 when the request as sent can't be served, 500 only for an internal error."""

import json

import pytest

from node.core.failures import Failure, FailureKind
from node.http.failures import ANSWERS, api_error


@pytest.mark.parametrize(
    "kind, status, retry_after, code, type_",
    [
        (FailureKind.BUSY, 503, "2", "server_overloaded", "server_error"),
        (FailureKind.PREFIX_GONE, 503, "2", "server_overloaded", "server_error"),
        (FailureKind.LOST, 503, "1", "generation_failed", "server_error"),
        (FailureKind.REFUSED, 400, None, "request_refused", "invalid_request_error"),
        (FailureKind.ERROR, 500, None, "internal_error", "server_error"),
    ],
)
def test_each_kind_leaves_as_its_status_with_an_openai_error_object(kind, status, retry_after, code, type_):
    response = api_error(Failure(kind, "KV cache memory is full", "b")).response()
    assert (response.status, response.headers.get("Retry-After")) == (status, retry_after)
    error = json.loads(response.body)["error"]
    assert (error["code"], error["type"]) == (code, type_)
    assert error["message"].endswith(": node b: KV cache memory is full")  # what happened, and where


def test_every_kind_has_an_answer_and_only_an_internal_error_is_a_500():
    assert set(ANSWERS) == set(FailureKind)
    assert [k for k, a in ANSWERS.items() if a.status >= 500 and a.retry_after is None] == [FailureKind.ERROR]

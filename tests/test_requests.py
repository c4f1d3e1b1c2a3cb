"""Request validation (pure)."""

from __future__ import annotations

import pytest

from engine.errors import RequestError
from engine.types import ChatRequest


def test_valid_request_is_copied_and_frozen():
    raw = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    req = ChatRequest.of(raw, index=0)
    raw[0]["content"] = "changed"
    assert req.messages[0]["content"] == "s"
    assert ChatRequest.of(req, index=1) == req


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ([], "requests[2].messages"),
        ("hello", "requests[2].messages"),
        ([42], "requests[2].messages[0]"),
        ([{"role": "robot", "content": "x"}], "requests[2].messages[0].role"),
        ([{"role": "user"}], "requests[2].messages[0].content"),
        ([{"role": "user", "content": ["x"]}], "requests[2].messages[0].content"),
    ],
)
def test_invalid_requests_name_the_request(raw, field):
    with pytest.raises(RequestError) as info:
        ChatRequest.of(raw, index=2)
    assert info.value.field == field
    assert "Fix:" in str(info.value)

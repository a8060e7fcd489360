"""The Responses API behind keys (in-process server): a key's quota refuses with a 429 in OpenAI's
error shape (openai.RateLimitError, with the retry headers), and stored responses belong to the
key that made them: another key gets the same 404 as an unknown id for GET, DELETE and as a
previous_response_id, while the admin key sees all."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

ADMIN = "admin-secret-0123456789"


def test_quota_429_in_openai_shape(in_process: Any, make_key: Any, tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    _kid, secret = make_key(db, "small", rpm=1)
    srv = in_process(db)
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key=secret, max_retries=0, timeout=120)
    client.responses.create(model="demo", input="hi", max_output_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.responses.create(model="demo", input="hi", max_output_tokens=1)
    err = e.value.body
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    assert "retry-after" in e.value.response.headers
    with pytest.raises(openai.RateLimitError):  # the stream is refused the same way, before it starts
        client.responses.create(model="demo", input="hi", max_output_tokens=1, stream=True)


def test_stored_responses_belong_to_their_key(in_process: Any, make_key: Any, tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    _a, alice = make_key(db, "alice")
    _b, bob = make_key(db, "bob")
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN)
    srv = in_process(db, admin_key_file=str(admin_file))

    def client(secret: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=srv.base + "/v1", api_key=secret, max_retries=0, timeout=120)

    r = client(alice).responses.create(model="demo", input="hi", max_output_tokens=2)
    assert client(alice).responses.retrieve(r.id).id == r.id
    for call in (lambda c: c.responses.retrieve(r.id), lambda c: c.responses.delete(r.id),
                 lambda c: c.responses.create(model="demo", input="x", previous_response_id=r.id,
                                              max_output_tokens=1)):
        with pytest.raises(openai.NotFoundError) as e:
            call(client(bob))
        assert e.value.body["code"] == "response_not_found"
    assert client(ADMIN).responses.retrieve(r.id).id == r.id
    assert httpx.get(f"{srv.base}/v1/responses/{r.id}").status_code == 401
    client(alice).responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client(ADMIN).responses.retrieve(r.id)

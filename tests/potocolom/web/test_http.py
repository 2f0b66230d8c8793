"""The HTTP side's body limit: over MAX_REQUEST_BYTES answers 413 `request_too_large`, from the
Content-Length before any of the body is read, or as soon as a body sent without one passes it."""
from __future__ import annotations

import json

import pytest
from asgiref.testing import ApplicationCommunicator

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 4096


@pytest.fixture(autouse=True)
def small_limit(settings):
    settings.MAX_REQUEST_BYTES = LIMIT


def scope(headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/api/v1/jobs/", "raw_path": b"/api/v1/jobs/", "query_string": b"",
            "root_path": "", "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                                         *headers],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}


async def answer(communicator: ApplicationCommunicator) -> tuple[int, dict[bytes, bytes], bytes]:
    start = await communicator.receive_output(5)
    body = await communicator.receive_output(5)
    return start["status"], dict(start["headers"]), body["body"]


async def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read():
    from potocolom.asgi import application

    communicator = ApplicationCommunicator(application, scope([(b"content-length", str(LIMIT + 1).encode())]))

    status, headers, body = await answer(communicator)  # nothing of the body was sent at all

    assert status == 413 and headers[b"content-type"] == b"application/json"
    assert json.loads(body)["error"] == "request_too_large"
    await communicator.wait(5)


async def test_a_body_without_a_length_is_refused_once_it_passes_the_limit():
    from potocolom.asgi import application

    communicator = ApplicationCommunicator(application, scope([(b"transfer-encoding", b"chunked")]))
    for _ in range(4):
        await communicator.send_input({"type": "http.request", "body": b" " * 1024, "more_body": True})
    assert await communicator.receive_nothing(0.2)  # 4096 bytes: at the limit, still read
    await communicator.send_input({"type": "http.request", "body": b" ", "more_body": True})

    status, _, body = await answer(communicator)

    assert status == 413 and json.loads(body)["error"] == "request_too_large"
    await communicator.wait(5)


async def test_a_body_within_the_limit_reaches_the_api():
    from potocolom.asgi import application

    content = b'{"params": {"prompt": "x"}}'
    communicator = ApplicationCommunicator(application, scope([(b"content-length", str(len(content)).encode())]))
    await communicator.send_input({"type": "http.request", "body": content, "more_body": False})

    status, _, body = await answer(communicator)

    assert status == 401  # past the guard: the API itself answered (no token given)
    await communicator.wait(5)

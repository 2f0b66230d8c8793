"""Requests in parallel: within one API process a request that waits (a webhook host's lookup, a
row lock another connection holds) holds up only itself; another account's requests answer
meanwhile. Through the process's ASGI application, as Daphne calls it."""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from django.db import connection

from tests.helpers import eventually, register_model

pytestmark = pytest.mark.django_db(transaction=True)


@database_sync_to_async
def token_of(account) -> str:
    from rest_framework.authtoken.models import Token

    return Token.objects.get(user=account).key


async def request(account, method: str, path: str, body: dict | None = None) -> ApplicationCommunicator:
    """An HTTP request of `account` (its API token) to the process's application, not yet answered."""
    from potocolom.asgi import application

    content = json.dumps(body).encode() if body is not None else b""
    headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
               (b"content-length", str(len(content)).encode()),
               (b"authorization", f"Token {await token_of(account)}".encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    communicator = ApplicationCommunicator(application, scope)
    communicator.input_queue.put_nowait({"type": "http.request", "body": content, "more_body": False})
    assert communicator.future  # the application starts now, not on the first read of its answer
    return communicator


async def answer(communicator: ApplicationCommunicator, timeout: float = 10) -> tuple[int, dict]:
    start = await communicator.receive_output(timeout)
    body = await communicator.receive_output(timeout)
    await communicator.wait(timeout)
    return start["status"], json.loads(body["body"] or b"null")


async def wait_for(event: threading.Event, timeout: float = 10) -> None:
    assert await asyncio.to_thread(event.wait, timeout), "not within the timeout"


@pytest.fixture
def model(db):
    return register_model("tiny-a")


async def test_a_lookup_under_way_holds_up_only_its_own_request(model, alice, bob, settings):
    looking, released = threading.Event(), threading.Event()

    def slow_resolver(host: str, port: int) -> list[str]:
        looking.set()
        released.wait(10)
        return ["127.0.0.1"]

    settings.WEBHOOK_RESOLVER = slow_resolver
    settings.WEBHOOK_ALLOW_PRIVATE = True
    alices = await request(
        alice, "POST", "/api/v1/jobs/", {"params": {"prompt": "x"}, "webhook_url": "http://hooks.example/"})
    await wait_for(looking)
    try:
        bobs = await request(bob, "GET", "/api/v1/models/")
        status, models = await answer(bobs)
        assert status == 200 and [entry["model_id"] for entry in models] == ["tiny-a"]
        assert await alices.receive_nothing(0), "alice's request had ended: bob's waited for it"
    finally:
        released.set()
    status, job = await answer(alices)
    assert status == 201 and job["webhook"]["url"] == "http://hooks.example/"


@contextmanager
def row_locked(table: str, row_id: str) -> Iterator[None]:
    """Another connection holds `SELECT … FOR UPDATE` on one row of `table`."""
    import psycopg

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params) as holder:
        holder.execute(f'SELECT 1 FROM "{table}" WHERE id = %s FOR UPDATE', [row_id])
        try:
            yield
        finally:
            holder.rollback()


@database_sync_to_async
def waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                       "AND datname = current_database()")
        return cursor.fetchone()[0] > 0


@pytest.mark.skipif(connection.vendor != "postgresql", reason="a row lock of another connection: PostgreSQL")
async def test_a_request_behind_a_row_lock_holds_up_only_itself(model, alice, bob):
    from tests.helpers import submit_jobs

    [job_id] = await submit_jobs(alice, 1)
    with row_locked("scheduling_job", job_id):
        cancel = await request(alice, "POST", f"/api/v1/jobs/{job_id}/cancel/")
        await eventually(waiting_on_a_lock)
        for path in ("/api/v1/models/", "/api/v1/jobs/"):
            status, _ = await answer(await request(bob, "GET", path))
            assert status == 200
        assert await cancel.receive_nothing(0), "alice's cancel had ended: the lock was not held"
    status, job = await answer(cancel)
    assert status == 200 and job["state"] == "cancelled"


async def test_many_waiting_requests_of_one_caller_hold_only_its_lane(model, alice, bob, settings):
    """Alice's lookups that wait fill her lane (HTTP_THREADS_PER_CALLER of the HTTP_THREADS), the
    rest of hers wait without a thread, one more is refused; bob's request takes a thread left free."""
    from potocolom.runtime import runtime
    from potocolom.web.http import CALLER_LANES, CallerLanes

    runtime.reset()  # made again with these settings: 2 threads, 1 a caller, 2 waiting
    settings.HTTP_THREADS, settings.HTTP_THREADS_PER_CALLER, settings.HTTP_WAITING_PER_CALLER = 2, 1, 2
    assert runtime.get(CALLER_LANES).per_caller == 1 and isinstance(runtime.get(CALLER_LANES), CallerLanes)
    looking, released = threading.Event(), threading.Event()
    lookups: list[str] = []

    def slow_resolver(host: str, port: int) -> list[str]:
        lookups.append(host)
        looking.set()
        released.wait(10)
        return ["127.0.0.1"]

    settings.WEBHOOK_RESOLVER = slow_resolver
    settings.WEBHOOK_ALLOW_PRIVATE = True
    submit = {"params": {"prompt": "x"}, "webhook_url": "http://hooks.example/"}
    alices = [await request(alice, "POST", "/api/v1/jobs/", submit)]
    await wait_for(looking)
    alices += [await request(alice, "POST", "/api/v1/jobs/", submit) for _ in range(2)]  # wait, no thread
    try:
        status, refused = await answer(await request(alice, "GET", "/api/v1/models/"))
        assert status == 429 and refused["error"] == "throttled"
        status, _ = await answer(await request(bob, "GET", "/api/v1/models/"))
        assert status == 200  # the second thread was free for him
        assert lookups == ["hooks.example"]  # alice's others never reached a thread
    finally:
        released.set()
    for communicator in alices:
        status, _ = await answer(communicator)
        assert status == 201

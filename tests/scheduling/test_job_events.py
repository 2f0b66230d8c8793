"""The account's job socket /ws/jobs/, driven with channels' WebsocketCommunicator beside fake
workers: job events in order, the owner only, the job_id filter, refusals, progress with its preview."""
from __future__ import annotations

import base64

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone
from rest_framework.authtoken.models import Token

from potocolom.asgi import application
from scheduling.services import JobRequest, job_submit
from tests.helpers import api_client, close_sync_thread_connections, register_model, tiny_png

pytestmark = pytest.mark.django_db(transaction=True)

PNG_B64 = base64.b64encode(tiny_png(2, 2)).decode()
PREVIEW = base64.b64encode(b"\xff\xd8\xff a tiny jpeg").decode()


@pytest.fixture
def token(db) -> str:
    from workers.services import worker_token_create

    register_model("tiny-a")
    return worker_token_create(name="hosts")


@database_sync_to_async
def submit(account, *, prompt: str = "a red circle") -> str:
    job = job_submit(account=account, now=timezone.now(),
                     request=JobRequest(params={"prompt": prompt}, model_id="tiny-a"))
    return str(job.id)


@database_sync_to_async
def token_of(account) -> str:
    return Token.objects.get(user=account).key


@database_sync_to_async
def rest_job(account, job_id: str) -> dict:
    response = api_client(account).get(f"/api/v1/jobs/{job_id}/")
    assert response.status_code == 200
    return response.json()


@database_sync_to_async
def pause(account, job_id: str) -> None:
    assert api_client(account).post(f"/api/v1/jobs/{job_id}/pause/").status_code == 200


@pytest.fixture
async def job_sockets():
    """Factory of /ws/jobs/ communicators (Host testserver, as REST's test client); closed at the end."""
    made: list[WebsocketCommunicator] = []

    async def make(query: str = "", *, headers: list[tuple[bytes, bytes]] | None = None) -> WebsocketCommunicator:
        socket = WebsocketCommunicator(application, "/ws/jobs/" + (f"?{query}" if query else ""),
                                       headers=[(b"host", b"testserver"), *(headers or [])])
        connected, _ = await socket.connect()
        assert connected
        made.append(socket)
        return socket

    yield make
    for socket in made:
        await socket.disconnect()
    await close_sync_thread_connections()


async def events_of(account, job_sockets, query: str = ""):
    return await job_sockets(f"token={await token_of(account)}" + (f"&{query}" if query else ""))


async def next_job_event(socket) -> dict:
    message = await socket.receive_json_from(timeout=5)
    assert message["type"] == "job", message
    return message["job"]


async def test_alice_hears_of_her_job_at_every_state_in_order(alice, token, workers, job_sockets):
    events = await events_of(alice, job_sockets)
    job_id = await submit(alice)
    queued = await next_job_event(events)
    assert (queued["id"], queued["state"], queued["position"]) == (job_id, "queued", 1)
    worker = workers()
    await worker.join(["tiny-a"])
    order = await worker.receive()
    assert order["type"] == "job" and order["job_id"] == job_id
    dispatched = await next_job_event(events)
    assert (dispatched["state"], dispatched["worker_id"], dispatched["position"]) == ("dispatched", "host-a:0", None)
    await worker.started(job_id)
    assert (await next_job_event(events))["state"] == "running"
    await worker.send({"type": "job_progress", "job_id": job_id, "step": 1, "steps": 2, "preview": PREVIEW})
    progress = await events.receive_json_from(timeout=5)
    assert progress == {"type": "job_progress", "job_id": job_id, "step": 1, "steps": 2,
                        "preview": "data:image/jpeg;base64," + PREVIEW}
    await worker.result(job_id, [PNG_B64])
    succeeded = await next_job_event(events)
    assert succeeded["state"] == "succeeded"
    assert succeeded == await rest_job(alice, job_id)  # exactly as GET /api/v1/jobs/ID/ shows it
    assert succeeded["images"][0].startswith("http://testserver/api/v1/jobs/")


async def test_progress_without_a_preview_is_relayed_without_one(alice, token, workers, job_sockets):
    events = await events_of(alice, job_sockets)
    job_id = await submit(alice)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.receive()
    await worker.progress(job_id, 3, 20)
    states = []
    while True:
        message = await events.receive_json_from(timeout=5)
        if message["type"] == "job_progress":
            break
        states.append(message["job"]["state"])
    assert message == {"type": "job_progress", "job_id": job_id, "step": 3, "steps": 20}
    assert states == ["queued", "dispatched", "running"]  # progress before job_started means running


async def test_bob_hears_nothing_of_alices_jobs_even_naming_them(alice, bob, token, workers, job_sockets):
    alice_job = await submit(alice)
    bob_events = await events_of(bob, job_sockets, f"job_id={alice_job}")
    bob_all = await events_of(bob, job_sockets)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.receive()
    await worker.started(alice_job)
    await worker.progress(alice_job, 1, 2)
    await worker.result(alice_job, [PNG_B64])
    bob_job = await submit(bob)  # sent after all of alice's: the first bob hears is his own
    assert (await next_job_event(bob_all))["id"] == bob_job
    assert await bob_events.receive_nothing(timeout=0.1)


async def test_a_job_id_filter_narrows_the_stream(alice, token, job_sockets):
    first = await submit(alice, prompt="first")
    only_first = await events_of(alice, job_sockets, f"job_id={first}")
    everything = await events_of(alice, job_sockets)
    second = await submit(alice, prompt="second")
    await pause(alice, first)
    heard = await next_job_event(only_first)
    assert (heard["id"], heard["state"], heard["position"]) == (first, "paused", None)
    assert [(job["id"], job["state"]) for job in [await next_job_event(everything) for _ in range(2)]] == [
        (second, "queued"), (first, "paused")]


async def test_a_header_token_is_heard(alice, token, job_sockets):
    events = await job_sockets(headers=[(b"authorization", f"Token {await token_of(alice)}".encode())])
    job_id = await submit(alice)
    assert (await next_job_event(events))["id"] == job_id


@pytest.mark.parametrize("query", ["", "token=wrong", "token="])
async def test_a_socket_without_an_account_is_closed_with_4001(query, alice, job_sockets):
    socket = await job_sockets(query)
    closed = await socket.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": 4001, "reason": "not authenticated"}


async def test_a_job_id_that_is_no_id_is_closed_with_4000(alice, job_sockets):
    socket = await events_of(alice, job_sockets, "job_id=not-a-job")
    closed = await socket.receive_output(timeout=5)
    assert closed["type"] == "websocket.close" and closed["code"] == 4000


# --- ACCOUNT_SOCKET_LIMIT ---------------------------------------------------------------------------

@pytest.fixture
def socket_counts(settings) -> str:
    """ACCOUNT_SOCKET_LIMIT 2, counted where this run's settings count: in Redis for every API process
    with REDIS_URL (the PostgreSQL + Redis run), else in the process (tests/potocolom/web/
    test_socket_limit.py tests both backends whenever a Redis answers)."""
    settings.ACCOUNT_SOCKET_LIMIT = 2
    return "redis" if settings.REDIS_URL else "process"


async def placed(account, *sockets) -> None:
    """Wait until each socket has its place in the account's count: it hears the account's job
    events only from then on (a connect returns at the accept, before the count)."""
    job_id = await submit(account)
    assert [(await next_job_event(socket))["id"] for socket in sockets] == [job_id] * len(sockets)


async def test_a_socket_past_the_accounts_limit_is_closed_with_4003(alice, bob, token, job_sockets, socket_counts):
    first, second = await events_of(alice, job_sockets), await events_of(alice, job_sockets)
    await placed(alice, first, second)

    third = await job_sockets(headers=[(b"authorization", f"Token {await token_of(alice)}".encode())])

    closed = await third.receive_output(timeout=5)
    assert (closed["type"], closed["code"]) == ("websocket.close", 4003)
    await placed(bob, await events_of(bob, job_sockets))  # per account
    await placed(alice, first, second)  # the two open ones go on


async def test_of_sockets_opened_one_after_another_the_one_past_the_limit_is_closed(alice, token, job_sockets,
                                                                                    socket_counts):
    sockets = [await events_of(alice, job_sockets) for _ in range(3)]  # each returns at its accept

    assert (await sockets[2].receive_output(timeout=5))["code"] == 4003
    await placed(alice, *sockets[:2])


async def test_a_closed_socket_frees_its_place(alice, token, job_sockets, socket_counts):
    first, second = await events_of(alice, job_sockets), await events_of(alice, job_sockets)
    await placed(alice, first, second)
    await first.disconnect()  # returns once the consumer has handled the close

    again = await events_of(alice, job_sockets)

    await placed(alice, second, again)
    refused = await events_of(alice, job_sockets)
    assert (await refused.receive_output(timeout=5))["code"] == 4003


def test_the_socket_limit_is_the_setting_s_default(settings):
    assert settings.ACCOUNT_SOCKET_LIMIT == 20


def changes_in_one_call(*named: list[str]) -> int:
    """Each list of job ids changed, one after another, within one batched call (as a worker's
    report or a submission makes them); the reads of job rows by id the events made."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from scheduling.events import batched, jobs_changed

    with CaptureQueriesContext(connection) as queries, batched():
        for ids in named:
            jobs_changed(ids)
    return sum(1 for query in queries.captured_queries
               if query["sql"].startswith("SELECT") and '"scheduling_job"."id" IN' in query["sql"])


async def test_the_events_of_one_call_go_together_in_order_each_job_once_as_last_named(alice, token, job_sockets):
    first, second = await submit(alice), await submit(alice)
    events = await events_of(alice, job_sockets)

    reads = await database_sync_to_async(changes_in_one_call)([first], [second], [first])

    assert [(await next_job_event(events))["id"] for _ in range(2)] == [second, first]
    assert reads == 1  # one read of the rows for every change of the call
    assert await events.receive_nothing(timeout=0.1)


async def test_a_submissions_answer_places_the_job_as_its_event_did(alice, token, job_sockets):
    events = await events_of(alice, job_sockets)
    await submit(alice)  # first in line, ahead of the one watched

    response = await database_sync_to_async(
        lambda: api_client(alice).post("/api/v1/jobs/", {"model_id": "tiny-a", "params": {"prompt": "x"}},
                                       format="json"))()

    assert response.status_code == 201
    await next_job_event(events)
    said = await next_job_event(events)
    answer = response.json()
    assert said["id"] == answer["id"] and said["state"] == answer["state"] == "queued"
    assert (said["position"], said["eta_seconds"]) == (answer["position"], answer["eta_seconds"]) == (2, None)

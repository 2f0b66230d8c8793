"""Who a worker is: a worker_id belongs to the worker token that first said hello with it; revoking
a token closes its sockets within a heartbeat period and ends its bindings; the token may come in
the handshake's Authorization header; the admin's "last seen" moves with the worker's messages."""
from __future__ import annotations

import time
from datetime import timedelta
from io import StringIO

import pytest
from channels.db import database_sync_to_async
from django.core.management import CommandError, call_command
from django.utils import timezone

from scheduling.services import JobRequest, job_submit
from tests.helpers import eventually, hello, job_row, register_model
from workers.services import worker_token_create

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def token(db) -> str:
    register_model("tiny-a")
    return worker_token_create(name="host-a")


@pytest.fixture
def other_token(token) -> str:
    return worker_token_create(name="intruder")


@database_sync_to_async
def submit(account) -> str:
    return str(job_submit(account=account, now=timezone.now(),
                          request=JobRequest(params={"prompt": "a red circle"}, model_id="tiny-a")).id)


@database_sync_to_async
def worker_row(worker_id: str) -> dict:
    from workers.models import Worker

    return Worker.objects.values("token__name", "connected", "last_seen", "channel_name").get(worker_id=worker_id)


@database_sync_to_async
def revoke(name: str) -> list[str]:
    out = StringIO()
    call_command("revoke_worker_token", name, stdout=out)
    return out.getvalue().splitlines()


async def held(job_id: str) -> tuple[str, str | None, int]:
    row = await job_row(job_id)
    return row["state"], row["worker_id"], row["attempts"]


# --- a worker_id belongs to the first token ---------------------------------------------------------

async def test_a_hello_with_a_worker_id_of_another_token_is_closed_with_4003_and_the_live_one_stays(
        alice, workers, other_token):
    owner = workers("host-a:0")
    await owner.join(["tiny-a"])
    intruder = workers("host-a:0", token=other_token)
    await intruder.connect()

    await intruder.send(hello("host-a:0", ["tiny-a"]))

    assert await intruder.expect_close() == 4003
    assert await owner.silent()  # not replaced (4002)
    row = await worker_row("host-a:0")
    assert (row["token__name"], row["connected"]) == ("host-a", True)
    job_id = await submit(alice)  # and the owner's connection still gets the work
    assert (await owner.receive())["job_id"] == job_id
    assert await held(job_id) == ("dispatched", "host-a:0", 1)


async def test_the_binding_outlives_the_connection(workers, other_token):
    owner = workers("host-a:0")
    await owner.join(["tiny-a"])
    await owner.close()

    intruder = workers("host-a:0", token=other_token)
    await intruder.connect()
    await intruder.send(hello("host-a:0", ["tiny-a"]))

    assert await intruder.expect_close() == 4003
    assert (await worker_row("host-a:0"))["token__name"] == "host-a"


async def test_the_same_token_may_say_hello_again_with_its_worker_id(workers):
    first = workers("host-a:0")
    await first.join(["tiny-a"])

    again = workers("host-a:0")
    await again.join(["tiny-a"])

    assert await first.expect_close() == 4002  # a newer connection of the same worker took over


async def test_revoking_a_token_ends_its_bindings(workers, other_token):
    owner = workers("host-a:0")
    await owner.join(["tiny-a"])
    await owner.close()

    assert (await revoke("host-a"))[-1] == "revoked 1"
    newcomer = workers("host-a:0", token=other_token)
    welcome = await newcomer.join(["tiny-a"])

    assert welcome["type"] == "welcome"
    assert (await worker_row("host-a:0"))["token__name"] == "intruder"


# --- revoking closes the token's sockets --------------------------------------------------------

async def test_revoke_worker_token_closes_its_sockets_with_4001_within_a_heartbeat_period_and_requeues_their_jobs(
        alice, workers, other_token, settings):
    settings.WORKER_HEARTBEAT_SECONDS = 0.5
    ids = [await submit(alice) for _ in range(3)]
    revoked = workers("host-a:0")
    await revoked.join(["tiny-a"])
    await revoked.jobs(2)
    bystander = workers("host-b:0", token=other_token)
    await bystander.join(["tiny-a"])
    assert (await bystander.receive())["job_id"] == ids[2]

    started = time.monotonic()
    assert (await revoke("host-a"))[-1] == "revoked 1"

    # Silence would take 3 periods (1.5 s) and close with 4008; a revoked token closes at the next check.
    assert await revoked.expect_close(timeout=2 * settings.WORKER_HEARTBEAT_SECONDS) == 4001
    assert time.monotonic() - started <= 2 * settings.WORKER_HEARTBEAT_SECONDS
    # The dead-worker rule: back to the queue (attempt 2), and the other worker had room for one.
    assert [(m["job_id"], m["attempt"]) for m in await bystander.jobs(1)] == [(ids[0], 2)]
    assert [await held(job_id) for job_id in ids[:2]] == [("dispatched", "host-b:0", 2), ("queued", None, 2)]
    assert (await worker_row("host-a:0"))["connected"] is False
    await bystander.send({"type": "heartbeat"})
    assert await bystander.silent(0.1)  # the other token's socket stays
    reconnect = workers("host-a:0")  # and the revoked token no longer gets in
    await reconnect.connect()
    assert await reconnect.expect_close() == 4001


async def test_revoking_twice_revokes_nothing_more_and_an_unknown_name_is_an_error(token):
    assert (await revoke("host-a"))[-1] == "revoked 1"
    assert (await revoke("host-a"))[-1] == "revoked 0"
    with pytest.raises(CommandError, match="no worker token"):
        await revoke("nobody")


@pytest.fixture
def root_client(client, make_account):
    root = make_account("root", staff=True)
    root.is_superuser = True
    root.save()
    client.force_login(root)
    return client


async def test_revoking_in_the_admin_closes_the_tokens_sockets_and_ends_its_bindings(
        workers, other_token, root_client, settings):
    from workers.models import WorkerToken

    settings.WORKER_HEARTBEAT_SECONDS = 0.5
    worker = workers("host-a:0")
    await worker.join(["tiny-a"])
    pk = await database_sync_to_async(lambda: WorkerToken.objects.get(name="host-a").pk)()

    response = await database_sync_to_async(root_client.post)(
        "/admin/workers/workertoken/", {"action": "revoke", "_selected_action": [str(pk)]})

    assert response.status_code == 302
    assert await worker.expect_close(timeout=2 * settings.WORKER_HEARTBEAT_SECONDS) == 4001
    assert (await worker_row("host-a:0"))["token__name"] is None
    newcomer = workers("host-a:0", token=other_token)
    assert (await newcomer.join(["tiny-a"]))["type"] == "welcome"


# --- the token in the Authorization header ------------------------------------------------------

async def test_it_accepts_the_token_in_the_authorization_header(alice, header_workers, token):
    job_id = await submit(alice)
    worker = header_workers(f"Token {token}")

    await worker.join(["tiny-a"])

    assert (await worker.receive())["job_id"] == job_id


@pytest.mark.parametrize("kind", ["a wrong token", "another scheme", "an account's API token", "no token"])
async def test_a_bad_authorization_header_closes_with_4001(alice, header_workers, token, kind):
    from rest_framework.authtoken.models import Token

    account_token = await database_sync_to_async(lambda: Token.objects.get(user=alice).key)()
    authorization = {"a wrong token": "Token wk_not-a-token", "another scheme": f"Bearer {token}",
                     "an account's API token": f"Token {account_token}", "no token": "Token "}[kind]
    worker = header_workers(authorization)

    await worker.connect()

    assert await worker.expect_close() == 4001


async def test_the_query_token_still_works_beside_an_unrelated_authorization_header(header_workers, token):
    worker = header_workers("Basic dXNlcjpwdw==", query=f"?token={token}")

    assert (await worker.join(["tiny-a"]))["type"] == "welcome"


# --- last seen ----------------------------------------------------------------------------------

async def test_the_workers_last_seen_moves_with_its_heartbeats(workers, settings):
    settings.WORKER_HEARTBEAT_SECONDS = 0.2
    worker = workers("host-a:0")
    await worker.join(["tiny-a"])
    at_hello = (await worker_row("host-a:0"))["last_seen"]

    async def moved():
        await worker.send({"type": "heartbeat"})
        return (await worker_row("host-a:0"))["last_seen"] > at_hello

    assert await eventually(moved, timeout=3)


async def test_last_seen_is_written_at_most_once_a_heartbeat_period(workers):
    worker = workers("host-a:0")  # the default period: 10 s
    await worker.join(["tiny-a"])
    at_hello = (await worker_row("host-a:0"))["last_seen"]

    for _ in range(20):
        await worker.send({"type": "heartbeat"})
    await worker.send({"type": "rung_changed", "model_id": "tiny-a", "rung": "model_offload", "realtime": False,
                       "realtime_slots": 0})  # handled after the heartbeats: once it shows, they were all read
    await eventually(_demoted)

    assert (await worker_row("host-a:0"))["last_seen"] == at_hello


async def _demoted() -> bool:
    from workers.models import Worker

    rows = await database_sync_to_async(lambda: Worker.objects.get(worker_id="host-a:0").served_models)()
    return rows[0]["rung"] == "model_offload"


async def test_a_worker_last_seen_long_ago_stops_reading_as_connected(workers):
    from workers.services import workers_silent_forget

    worker = workers("host-a:0")
    await worker.join(["tiny-a"])

    later = timezone.now() + timedelta(seconds=41)
    assert await database_sync_to_async(workers_silent_forget)(seconds=40, now=later) == 1

    assert (await worker_row("host-a:0"))["connected"] is False


async def test_operators_see_tokens_with_revoked_read_only_and_workers_with_their_token(workers, root_client):
    from workers.models import WorkerToken

    await workers("host-a:0").join(["tiny-a"])
    pk = await database_sync_to_async(lambda: WorkerToken.objects.get(name="host-a").pk)()

    pages = [await database_sync_to_async(root_client.get)(path) for path in (
        "/admin/workers/workertoken/", f"/admin/workers/workertoken/{pk}/change/", "/admin/workers/worker/")]

    assert [page.status_code for page in pages] == [200, 200, 200]
    assert "host-a:0" in pages[2].content.decode() and ">host-a<" in pages[2].content.decode()
    assert 'name="revoked"' not in pages[1].content.decode()  # revoking goes through the action
    await database_sync_to_async(root_client.post)(f"/admin/workers/workertoken/{pk}/change/",
                                                   {"name": "host-a", "revoked": "on"})
    assert await database_sync_to_async(lambda: WorkerToken.objects.get(pk=pk).revoked)() is False

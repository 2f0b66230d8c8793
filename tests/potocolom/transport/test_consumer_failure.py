"""A consumer whose channel-layer feed fails: it still runs its disconnect cleanup (as channels does
on websocket.disconnect) before the error closes its socket with 1011; a consumer that waits out a
Redis outage keeps its socket open and hears the layer again once Redis is back."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from potocolom.transport import relay
from potocolom.transport.relay import RelayConsumer
from tests.helpers import eventually
from tests.support.layer_faults import install_layer_fault

REDIS_DOWN = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connect call failed.")


class Recorder(RelayConsumer):
    """Says its channel name, echoes `relay.echo`, and records the codes its disconnect ran with."""

    disconnects: list[int]

    async def connect(self) -> None:
        self.disconnects = Recorder.seen
        await self.accept()
        await self.send(text_data=self.channel_name)

    async def relay_echo(self, event: dict[str, Any]) -> None:
        await self.send(text_data=event["text"])

    async def disconnect(self, code: int) -> None:
        self.disconnects.append(code)


class Waiting(Recorder):
    layer_outage_waits = True


@pytest.fixture
def layer_fault(monkeypatch):
    return install_layer_fault(monkeypatch)


@pytest.fixture(autouse=True)
def seen():
    Recorder.seen = []
    yield Recorder.seen


async def open_socket(kind: type) -> tuple[WebsocketCommunicator, str]:
    communicator = WebsocketCommunicator(kind.as_asgi(), "/")
    assert (await communicator.connect())[0]
    return communicator, await communicator.receive_from()


@pytest.mark.parametrize("error", [RuntimeError("the layer broke"), REDIS_DOWN], ids=["any error", "redis"])
async def test_a_consumer_whose_layer_feed_fails_runs_its_disconnect_then_fails(layer_fault, seen, error, db):
    communicator, name = await open_socket(Recorder)

    layer_fault.break_(error, channels=[name])

    with pytest.raises(type(error)):  # the error goes on to the server, which closes with 1011
        await communicator.receive_output(timeout=2)
    assert seen == [relay.SERVER_ERROR], "its disconnect ran once, with 1011"
    assert not relay.is_local(name)


async def test_a_consumer_that_fails_after_its_disconnect_ran_does_not_run_it_again(seen, db):
    communicator, name = await open_socket(Recorder)
    await communicator.disconnect()
    assert seen == [1000]


async def test_a_consumer_that_waits_out_a_redis_outage_stays_open_and_hears_the_layer_again(layer_fault, seen,
                                                                                           caplog, db):
    communicator, name = await open_socket(Waiting)

    layer_fault.break_(REDIS_DOWN, channels=[name])
    await eventually(lambda: asyncio.sleep(0, len(layer_fault.raised) >= 3))  # tried again, and again
    assert await communicator.receive_nothing(timeout=0.1)
    layer_fault.mend()
    await get_channel_layer().send(name, {"type": "relay.echo", "text": "after the restart"})

    assert await communicator.receive_from(timeout=3) == "after the restart"
    assert seen == [] and relay.is_local(name)
    assert sum("the channel layer cannot be read" in r.getMessage() for r in caplog.records) == 1  # once an outage
    await communicator.disconnect()
    assert seen == [1000]


async def test_a_waiting_consumer_still_fails_on_an_error_that_is_not_redis(layer_fault, seen, db):
    communicator, name = await open_socket(Waiting)

    layer_fault.break_(RuntimeError("not Redis"), channels=[name])

    with pytest.raises(RuntimeError):
        await communicator.receive_output(timeout=2)
    assert seen == [relay.SERVER_ERROR]


async def test_a_handler_that_raises_runs_the_disconnect_cleanup_too(seen, db):
    communicator, name = await open_socket(Recorder)

    await relay.send(name, {"type": "no.such.handler"})

    with pytest.raises(ValueError):
        await communicator.receive_output(timeout=2)
    assert seen == [relay.SERVER_ERROR]


@pytest.mark.django_db(transaction=True)
async def test_a_jobs_socket_whose_feed_fails_gives_its_seat_back(layer_fault, alice, settings):
    """/ws/jobs/ does not wait out an outage (its client connects again, and takes its place again);
    its failure lets go of its place in the account's ACCOUNT_SOCKET_LIMIT all the same."""
    from channels.db import database_sync_to_async
    from rest_framework.authtoken.models import Token

    from potocolom.asgi import application
    from potocolom.web.socket_limit import socket_seats

    settings.ACCOUNT_SOCKET_LIMIT = 1
    token = await database_sync_to_async(lambda: Token.objects.get(user=alice).key)()

    def jobs_socket() -> WebsocketCommunicator:
        return WebsocketCommunicator(application, f"/ws/jobs/?token={token}", headers=[(b"host", b"testserver")])

    first = jobs_socket()
    assert (await first.connect())[0]
    await eventually(lambda: asyncio.sleep(0, list(socket_seats().held)))
    (channel,) = socket_seats().held

    layer_fault.break_(REDIS_DOWN, channels=[channel])
    with pytest.raises(redis.ConnectionError):
        await first.receive_output(timeout=3)

    assert channel not in socket_seats().held
    second = jobs_socket()
    assert (await second.connect())[0]
    assert await second.receive_nothing(timeout=0.2), "not closed with 4003: the failed socket's place is free"
    await second.disconnect()

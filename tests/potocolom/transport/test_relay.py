"""potocolom.transport.relay: a consumer of this process gets its messages in memory, in order, from async
and sync senders alike; a channel of another process still goes through the channel layer."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from potocolom.transport import relay
from potocolom.transport.relay import RelayConsumer


class Echo(RelayConsumer):
    """Says its channel name, then writes each `relay.echo` message's text to its socket."""

    async def connect(self) -> None:
        await self.accept()
        await self.send(text_data=self.channel_name)

    async def relay_echo(self, event: dict[str, Any]) -> None:
        await self.send(text_data=event["text"])


@pytest.fixture
def layer_refuses(monkeypatch):
    """A channel layer whose send fails: what still arrives did not go through it."""
    layer = get_channel_layer()

    async def refuse(channel: str, message: dict[str, Any]) -> None:
        raise AssertionError(f"{channel} went through the channel layer")

    monkeypatch.setattr(layer, "send", refuse)


async def test_a_local_consumer_gets_messages_in_memory_and_in_order(layer_refuses, db):
    # (db: channels' websocket_disconnect closes the sync thread's old database connections)
    communicator = WebsocketCommunicator(Echo.as_asgi(), "/")
    assert (await communicator.connect())[0]
    name = await communicator.receive_from()
    assert relay.is_local(name)

    await relay.send(name, {"type": "relay.echo", "text": "from the loop"})

    def from_a_thread() -> None:  # a service in a worker thread, with no event loop of its own
        for n in range(50):
            relay.send_sync(name, {"type": "relay.echo", "text": f"sync {n}"})

    await asyncio.to_thread(from_a_thread)
    assert await communicator.receive_from() == "from the loop"
    assert [await communicator.receive_from() for _ in range(50)] == [f"sync {n}" for n in range(50)]

    await communicator.disconnect()
    assert not relay.is_local(name), "a consumer that ended is no longer a local channel"


async def test_many_messages_from_a_thread_reach_each_local_consumer_in_order(layer_refuses, db):
    """deliver_local_many (every queued browser's new place at once): each consumer gets its own
    messages in the order given, and a channel that is not here is passed over."""
    communicators = [WebsocketCommunicator(Echo.as_asgi(), "/") for _ in range(3)]
    names = []
    for communicator in communicators:
        assert (await communicator.connect())[0]
        names.append(await communicator.receive_from())
    deliveries = [(name, {"type": "relay.echo", "text": f"{n} to {k}"}) for n in range(5)
                  for k, name in enumerate(names)]
    deliveries.insert(4, ("nobody-here", {"type": "relay.echo", "text": "lost"}))

    await asyncio.to_thread(relay.deliver_local_many, deliveries)
    relay.deliver_local_many([(names[0], {"type": "relay.echo", "text": "from the loop"})])

    for k, communicator in enumerate(communicators):
        assert [await communicator.receive_from() for _ in range(5)] == [f"{n} to {k}" for n in range(5)]
    assert await communicators[0].receive_from() == "from the loop"
    for communicator in communicators:
        await communicator.disconnect()


async def test_a_channel_that_is_not_local_goes_through_the_channel_layer():
    layer = get_channel_layer()
    name = await layer.new_channel()
    assert not relay.is_local(name)

    await relay.send(name, {"type": "relay.echo", "text": "async"})
    await asyncio.to_thread(relay.send_sync, name, {"type": "relay.echo", "text": "sync"})

    assert await layer.receive(name) == {"type": "relay.echo", "text": "async"}
    assert await layer.receive(name) == {"type": "relay.echo", "text": "sync"}


async def test_a_group_target_reaches_every_local_member_and_none_after_it_left(layer_refuses, db):
    """What the bus hands over for `group:G` (a notice for G's members in this process)."""
    layer = get_channel_layer()
    communicators = [WebsocketCommunicator(Echo.as_asgi(), "/") for _ in range(3)]
    names = []
    for communicator in communicators:
        assert (await communicator.connect())[0]
        names.append(await communicator.receive_from())
    for name in names[:2]:
        assert await relay.group_membership(layer, "notices", name)

    assert relay.deliver_local("group:notices", {"type": "relay.echo", "text": "wake"})
    assert [await c.receive_from() for c in communicators[:2]] == ["wake", "wake"]
    assert await communicators[2].receive_nothing(0.05), "not a member"

    await relay.group_membership(layer, "notices", names[0], join=False)
    await communicators[1].disconnect()  # a consumer that ended is no member either
    assert not relay.deliver_local("group:notices", {"type": "relay.echo", "text": "again"})
    assert await communicators[0].receive_nothing(0.05)
    for communicator in (communicators[0], communicators[2]):
        await communicator.disconnect()


async def test_without_the_bus_a_notice_for_the_others_is_a_group_send_to_every_member():
    layer = get_channel_layer()
    name = await layer.new_channel()
    await layer.group_add("others", name)

    await asyncio.to_thread(relay.group_send_others_sync, "others", {"type": "jobs.available"})

    assert await layer.receive(name) == {"type": "jobs.available"}


async def test_an_inbox_keeps_the_newest_frame_per_session_and_every_control_message_in_order():
    inbox = relay.Inbox()
    for seq in range(1000):
        inbox.put_nowait({"type": "socket.send", "message": {"type": "frame", "session_id": "s1", "seq": seq}})
        if seq == 10:
            inbox.put_nowait({"type": "socket.send", "message": {"type": "session_start", "session_id": "s2"}})
    inbox.put_nowait({"type": "socket.send", "message": {"type": "frame", "session_id": "s1", "seq": 3}})  # late
    inbox.put_nowait({"type": "session.frame", "seq": 7})
    inbox.put_nowait({"type": "socket.send", "message": {"type": "session_end", "session_id": "s1"}})

    got = [(await inbox.get()) for _ in range(len(inbox))]

    assert [(m["type"], m.get("message", {}).get("type"), m.get("message", m).get("seq")) for m in got] == [
        ("socket.send", "frame", 999), ("socket.send", "session_start", None), ("session.frame", None, 7),
        ("socket.send", "session_end", None)]


def queued(position: int) -> dict:
    return {"type": "socket.send", "message": {"type": "state", "state": "queued", "position": position}}


async def test_an_inbox_tells_only_the_newest_of_a_burst_of_positions_and_never_one_out_of_order():
    inbox = relay.Inbox()
    for position in range(1000, 500, -1):  # 500 sessions ahead left at once
        inbox.put_nowait(queued(position))
    live = {"type": "socket.send", "message": {"type": "state", "state": "live", "model_id": "m", "worker_id": "w"}}
    inbox.put_nowait(live)
    inbox.put_nowait(queued(7))  # sent back to the queue after going live: told after `live`
    inbox.put_nowait(queued(6))

    got = [(await inbox.get())["message"] for _ in range(len(inbox))]

    assert got == [queued(501)["message"], live["message"], queued(6)["message"]]
    assert inbox.replaced == 499 + 1


async def test_an_inbox_of_a_stuck_consumer_fails_it_rather_than_drop_a_control_message():
    inbox = relay.Inbox(control_max=3)
    for n in range(5):
        inbox.put_nowait({"type": "socket.send", "message": {"type": "state", "n": n}})

    got = [(await inbox.get()) for _ in range(len(inbox))]

    assert [m["message"]["n"] for m in got[:3]] == [0, 1, 2]
    assert isinstance(got[3], relay.SourceFailed) and isinstance(got[3].error, relay.InboxOverflow)

"""potocolom.bus against the real Redis: a message published for another process reaches the
consumer named in it, in order; process names come from the channel layer's channel names."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import uuid
from typing import Any

import pytest

from potocolom.transport.bus import Bus, process_of

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/15"


@pytest.mark.parametrize(("channel", "process"), [
    ("specific.0123abcd!f00", "0123abcd"),
    ("specific.abc!", "abc"),
    ("prefix.specific.abc!x", "abc"),
    ("local.1234", None),
    ("specific!x", None),
    ("", None),
])
def test_it_reads_the_process_out_of_a_channel_name(channel, process):
    assert process_of(channel) == process


def redis_up() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.mark.skipif(not redis_up(), reason=f"no Redis at {REDIS_URL}")
async def test_a_message_reaches_the_consumer_of_the_other_process_in_order():
    got: list[tuple[str, dict[str, Any]]] = []
    done = asyncio.Event()

    def deliver(target: str, message: dict[str, Any]) -> bool:
        got.append((target, message))
        if len(got) == 200:
            done.set()
        return target.startswith("specific.b")

    a = Bus(REDIS_URL, f"a{uuid.uuid4().hex}", lambda target, message: False)
    b_process = f"b{uuid.uuid4().hex}"
    b = Bus(REDIS_URL, b_process, deliver)
    await a.start()
    await b.start()
    try:
        target = f"specific.{b_process}!consumer"
        for n in range(150):
            a.post(b_process, target, {"type": "session.frame", "seq": n, "image": "x" * 100})
        for n in range(150, 200):  # from a thread (a sync service): on the bus's loop, after the others
            await asyncio.to_thread(a.publish_threadsafe, b_process, target, {"type": "session.frame", "seq": n})
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await a.close()
        await b.close()
    assert [message["seq"] for _, message in got] == list(range(200))
    assert {target for target, _ in got} == {target}


@pytest.mark.skipif(not redis_up(), reason=f"no Redis at {REDIS_URL}")
async def test_a_broadcast_reaches_every_other_process_and_not_its_sender():
    got: dict[str, list[tuple[str, dict[str, Any]]]] = {"a": [], "b": [], "c": []}
    both = asyncio.Event()

    def deliver_to(name: str) -> Any:
        def deliver(target: str, message: dict[str, Any]) -> bool:
            got[name].append((target, message))
            if got["b"] and got["c"]:
                both.set()
            return True
        return deliver

    run = uuid.uuid4().hex
    buses = {name: Bus(REDIS_URL, f"{name}{run}", deliver_to(name)) for name in got}
    for bus in buses.values():
        await bus.start()
    try:
        await asyncio.to_thread(buses["a"].broadcast_threadsafe, "group:workers", {"type": "jobs.available"})
        await asyncio.wait_for(both.wait(), 10)
        # a's own copy would have come back by now, on the same subscription, before this one
        buses["b"].post(f"a{run}", f"specific.a{run}!x", {"type": "after"})
        await until(lambda: got["a"], "b's message to a")
    finally:
        for bus in buses.values():
            await bus.close()
    assert got["b"] == got["c"] == [("group:workers", {"type": "jobs.available"})]
    assert got["a"] == [(f"specific.a{run}!x", {"type": "after"})], "the sender skips its own broadcast"


# --- RESP: the part the bus speaks -------------------------------------------------------------

from potocolom.transport.bus import INCOMPLETE, RespError, command, parse  # noqa: E402


def test_a_command_is_an_array_of_bulk_strings_counted_in_bytes():
    assert command("PUBLISH", "ch", "é") == b"*3\r\n$7\r\nPUBLISH\r\n$2\r\nch\r\n$2\r\n\xc3\xa9\r\n"


def test_it_parses_what_redis_sends_a_subscriber():
    message = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$5\r\nhe\r\nl\r\n"  # a payload may hold CRLF
    assert parse(message) == ([b"message", b"ch", b"he\r\nl"], len(message))
    assert parse(b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n")[0] == [b"subscribe", b"ch", 1]
    assert parse(b"+OK\r\n") == ("OK", 5)
    error, end = parse(b"-NOAUTH Authentication required.\r\n")
    assert isinstance(error, RespError) and "NOAUTH" in str(error) and end == 34
    assert parse(b"$-1\r\n") == (None, 5)


def test_a_value_cut_anywhere_is_incomplete_until_it_is_whole():
    message = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$5\r\nhello\r\n"
    for cut in range(len(message)):
        assert parse(message[:cut]) is INCOMPLETE, cut
    # two values back to back: the second starts where the first ended
    value, end = parse(message + b"+OK\r\n")
    assert parse(message + b"+OK\r\n", end) == ("OK", len(message) + 5)


def test_something_that_is_not_resp_is_an_error_not_a_guess():
    with pytest.raises(ValueError):
        parse(b"hello\r\n")


class RecordingTransport:
    """The publisher's socket, as the bus sees it (its one seam): what was written, in one call each."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


async def test_what_is_posted_in_one_turn_goes_out_in_one_write_one_publish_per_process():
    bus = Bus("redis://127.0.0.1:1/0", "me", lambda target, message: False)
    transport = RecordingTransport()
    bus.publish_on(transport)  # type: ignore[arg-type]
    bus.post("p1", "specific.p1!a", {"seq": 1})
    bus.post("p2", "specific.p2!b", {"seq": 2})
    bus.post("p1", "specific.p1!c", {"seq": 3})
    assert transport.writes == [], "nothing is written before the turn ends"
    await asyncio.sleep(0)
    (written,) = transport.writes
    commands = []
    end = 0
    while end < len(written):
        value, end = parse(written, end)
        commands.append(value)
    assert [c[:2] for c in commands] == [[b"PUBLISH", b"potocolom.bus.p1"], [b"PUBLISH", b"potocolom.bus.p2"]]
    import json
    assert json.loads(commands[0][2]) == [["specific.p1!a", {"seq": 1}], ["specific.p1!c", {"seq": 3}]]
    assert json.loads(commands[1][2]) == [["specific.p2!b", {"seq": 2}]]


async def test_a_message_posted_while_redis_is_away_is_dropped_not_kept_growing():
    bus = Bus("redis://127.0.0.1:1/0", "me", lambda target, message: False)
    bus.post("p1", "specific.p1!a", {"seq": 1})
    await asyncio.sleep(0)
    assert bus.unsent == 0 and bus.lost == 1


async def test_a_bus_that_cannot_reach_redis_says_so_at_start():
    from tests.support.stack import free_port

    bus = Bus(f"redis://127.0.0.1:{free_port()}/0", "me", lambda target, message: False)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(bus.start(), 1)  # it would keep trying for 10 s
    await bus.close()


def test_it_refuses_a_url_it_cannot_speak():
    bus = Bus("rediss://example:6380/0", "me", lambda target, message: False)
    with pytest.raises(ValueError, match="redis://"):
        asyncio.run(bus.start())


async def until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.skipif(not shutil.which("redis-server"), reason="no redis-server to restart")
async def test_after_a_redis_restart_both_ends_reconnect_and_messages_flow_again(tmp_path):
    import subprocess

    from tests.support.stack import free_port

    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(tmp_path)]
    url = f"redis://127.0.0.1:{port}/0"
    got: list[int] = []
    a = Bus(url, "a" + uuid.uuid4().hex, lambda target, message: False)
    b = Bus(url, "b" + uuid.uuid4().hex, lambda target, message: got.append(message["n"]) is None)
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        await until(lambda: _answers(port), "redis to start")
        await a.start()
        await b.start()
        a.post(b.process, f"specific.{b.process}!x", {"n": 1})
        await until(lambda: got == [1], "the first message")

        server.kill()  # what a restart does to every connection, and to everything Redis held
        server.wait(10)
        await until(lambda: not b.subscribed and not a.publishing, "both ends to notice")
        a.post(b.process, f"specific.{b.process}!x", {"n": 2})  # lost: at most once, like the layer
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        await b.ready()
        await until(lambda: a.publishing, "the publisher to reconnect")
        a.post(b.process, f"specific.{b.process}!x", {"n": 3})
        await until(lambda: got == [1, 3], "a message after the restart")
    finally:
        await a.close()
        await b.close()
        server.kill()
        server.wait(10)


def _answers(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_what_another_publisher_put_on_the_channel_is_dropped_and_the_bus_reads_on():
    got: list[dict[str, Any]] = []
    bus = Bus("redis://127.0.0.1:1/0", "me", lambda target, message: got.append(message) is None)
    for junk in (b"not json", b"42", b'{"a": 1}', b"[1, [2, 3, 4]]"):
        bus.dispatch(junk)
    bus.dispatch(b'[["specific.me!a", {"seq": 1}]]')
    assert got == [{"seq": 1}]


class PausableProxy:
    """A TCP proxy in front of Redis whose reading from its clients can be paused: a Redis that has
    stopped reading, as far as the bus can tell."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.clients: list[asyncio.StreamReader] = []
        self.paused = asyncio.Event()
        self.paused.set()  # set: reading
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.port)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, pausable: bool) -> None:
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await source.read(65536):
                    if pausable:
                        await self.paused.wait()
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, upstream_writer, True), pipe(upstream_reader, writer, False))

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


@pytest.mark.skipif(not redis_up(), reason=f"no Redis at {REDIS_URL}")
async def test_a_full_bus_keeps_the_newest_frame_and_drops_no_control_message():
    from urllib.parse import urlsplit

    parts = urlsplit(REDIS_URL)
    proxy = PausableProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    proxy_port = await proxy.start()
    got: list[dict[str, Any]] = []
    controls = asyncio.Event()

    def deliver(target: str, message: dict[str, Any]) -> bool:
        got.append(message)
        if [m["message"]["type"] for m in got if m["message"]["type"] != "frame"] == ["session_end", "cancel"]:
            controls.set()
        return True

    b_process = f"b{uuid.uuid4().hex}"
    a = Bus(f"redis://127.0.0.1:{proxy_port}/0", f"a{uuid.uuid4().hex}", lambda target, message: False,
            frame_unsent_bytes=64 * 1024)
    b = Bus(REDIS_URL, b_process, deliver)
    await a.start()
    await b.start()
    target, image = f"specific.{b_process}!worker", "A" * 100_000
    try:
        proxy.paused.clear()  # Redis stops reading what the publisher writes
        for seq in range(200):  # 20 MB of frames of one session, one per loop turn
            a.post(b_process, target, {"type": "socket.send", "message": {"type": "frame", "session_id": "s1",
                                                                          "seq": seq, "image": image}})
            await asyncio.sleep(0)
        a.post(b_process, target, {"type": "socket.send", "message": {"type": "session_end", "session_id": "s1"}})
        await asyncio.sleep(0)
        a.post(b_process, target, {"type": "socket.send", "message": {"type": "cancel", "job_id": "j1"}})
        await asyncio.sleep(0)
        assert a.frames_replaced > 0, "Redis never fell behind: nothing was held"
        proxy.paused.set()
        await asyncio.wait_for(controls.wait(), 20)
        await until(lambda: any(m["message"].get("seq") == 199 for m in got), "the newest frame")
    finally:
        await a.close()
        await b.close()
        await proxy.close()
    frames = [m["message"]["seq"] for m in got if m["message"]["type"] == "frame"]
    assert frames == sorted(frames) and len(frames) < 200, "frames in order, the older held ones dropped"
    assert a.lost == 0

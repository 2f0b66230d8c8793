"""The floor under bench/tenancy.py's "head leaves" figure: a bare ASGI websocket app on Daphne that,
when any socket sends the text "go", sends one small `queued` message to every open socket from one
coroutine (no Channels, no channel layer, no database). What telling N browsers one new position
each costs in Daphne itself, on this machine.

    daphne -b 127.0.0.1 -p PORT bench.fanout_app:application
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]
SOCKETS: dict[int, Send] = {}  # open sockets in the order they opened: the newest hears last


async def application(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]], send: Send) -> None:
    if scope["type"] != "websocket":
        return
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    key = id(send)
    SOCKETS[key] = send
    try:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") == "go":
                for position, other in enumerate(list(SOCKETS.values()), start=1):
                    await other({"type": "websocket.send",
                                 "text": json.dumps({"type": "state", "state": "queued", "position": position})})
    finally:
        SOCKETS.pop(key, None)

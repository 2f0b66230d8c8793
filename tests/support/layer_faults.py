"""A channel layer whose receive breaks on demand, at the layer seam the consumers read from: what a
Redis that dies does to every socket's channel-layer feed (channels_redis' receive raises), and
what any other failure of that source does."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection
from typing import Any

import pytest


class LayerFault:
    """Wraps the test's channel layer's `receive`. While broken, each receive of an affected channel
    (`channels`, or every channel) raises the error, and a receive already waiting is woken to raise
    it; mended, receives reach the layer again."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.real = layer.receive
        self.error: BaseException | None = None
        self.channels: frozenset[str] | None = None
        self.raised: list[str] = []  # the channel of each receive that raised
        self._changed = asyncio.Event()

    def break_(self, error: BaseException, *, channels: Collection[str] | None = None) -> None:
        self.error, self.channels = error, None if channels is None else frozenset(channels)
        self._wake()

    def mend(self) -> None:
        self.error = self.channels = None
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _affects(self, channel: str) -> bool:
        return self.error is not None and (self.channels is None or channel in self.channels)

    async def receive(self, channel: str) -> dict[str, Any]:
        while True:
            if self._affects(channel):
                self.raised.append(channel)
                raise self.error  # type: ignore[misc]
            real = asyncio.ensure_future(self.real(channel))
            changed = asyncio.ensure_future(self._changed.wait())
            done, _ = await asyncio.wait({real, changed}, return_when=asyncio.FIRST_COMPLETED)
            if real in done:
                changed.cancel()
                return real.result()
            real.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await real


def install_layer_fault(monkeypatch: pytest.MonkeyPatch) -> LayerFault:
    """The test's channel layer with a receive that `break_`s on demand (a Redis outage is waited
    out quickly: retried after 50 ms). Each test module's `layer_fault` fixture calls it."""
    from channels.layers import get_channel_layer

    from potocolom.transport import relay

    monkeypatch.setattr(relay, "OUTAGE_RETRY_FIRST", 0.05)
    monkeypatch.setattr(relay, "OUTAGE_RETRY_MAX", 0.2)
    fault = LayerFault(get_channel_layer())
    monkeypatch.setattr(fault.layer, "receive", fault.receive)
    return fault

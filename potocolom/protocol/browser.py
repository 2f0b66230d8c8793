"""The browser socket's messages as typed values: `parse_browser_message` reads what a drawing page
sends (MessageError with a short reason otherwise), `to_wire()` writes what it is sent. A frame's
params are checked once, here (`frame_params`), for the API and the worker alike."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from potocolom.protocol.errors import MessageError
from potocolom.protocol.images import ImageRefused, header_of

DATA_URL_PREFIXES = ("data:image/png;base64,", "data:image/jpeg;base64,", "data:image/webp;base64,")
DEFAULT_MAX_PIXELS = 4194304  # MAX_IMAGE_PIXELS' default (the API passes its setting)
MAX_SEQ = 2**53  # what a browser's Number holds exactly
DEFAULT_STRENGTH = 0.8  # diffusers' img2img default


@dataclass(frozen=True)
class FrameParams:
    """A frame's params as the worker runs them: the prompt and the img2img strength (0 to 1)."""

    prompt: str
    strength: float


def frame_params(params: Any) -> FrameParams:
    """The checked params of a browser frame (MessageError naming the field otherwise)."""
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise MessageError("params must be an object")
    prompt = params.get("prompt", "")
    if not isinstance(prompt, str):
        raise MessageError("params.prompt must be a string")
    strength = params.get("strength", DEFAULT_STRENGTH)
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 <= strength <= 1:
        raise MessageError(f"params.strength must be a number from 0 to 1, got {strength!r}"[:200])
    return FrameParams(prompt, float(strength))


@dataclass(frozen=True)
class BrowserFrame:
    """The one message a browser sends: a canvas frame."""

    seq: int
    image: str  # bare base64 (the data: prefix removed)
    params: dict[str, Any]  # the browser's own, relayed to the worker as sent


def parse_browser_message(text: str, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> BrowserFrame:
    """A browser's text frame as a BrowserFrame; MessageError says what is wrong. The image must be
    a PNG, JPEG or WebP declaring at most `max_pixels` pixels, read from its header (nothing is
    decoded), so that no image a worker would refuse, or choke on, ever reaches one."""
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):
        raise MessageError("a message must be JSON") from None
    if not isinstance(message, dict):
        raise MessageError("a message must be a JSON object")
    if message.get("type") != "frame":
        raise MessageError(f"unknown message type {str(message.get('type'))[:100]!r}")
    seq = message.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
        raise MessageError("seq must be a non-negative integer")
    image = message.get("image")
    prefix = next((p for p in DATA_URL_PREFIXES if isinstance(image, str) and image.startswith(p)), None)
    if prefix is None:
        raise MessageError("image must be a data:image/png, jpeg or webp;base64 URL")
    bare = image[len(prefix):]  # type: ignore[index]
    try:
        header_of(bare, max_pixels=max_pixels)
    except ImageRefused as exc:
        raise MessageError(f"image: {exc}") from None
    params = message.get("params", {})
    frame_params(params)
    return BrowserFrame(seq, bare, params if isinstance(params, dict) else {})


def image_data_url(image: str) -> str:
    """A worker's bare base64 image as a data: URL of its own type (PNG or JPEG)."""
    if image.startswith("data:"):
        return image
    kind = "jpeg" if image.startswith("/9j/") else "png"
    return f"data:image/{kind};base64,{image}"


class ServerMessage:
    """A message the API sends a browser."""

    type: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, **self.__dict__}


@dataclass(frozen=True)
class Queued(ServerMessage):
    type = "state"
    position: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": "state", "state": "queued", "position": self.position}


@dataclass(frozen=True)
class Live(ServerMessage):
    type = "state"
    model_id: str
    worker_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "state", "state": "live", "model_id": self.model_id, "worker_id": self.worker_id}


@dataclass(frozen=True)
class Idle(ServerMessage):
    type = "state"

    def to_wire(self) -> dict[str, Any]:
        return {"type": "state", "state": "idle"}


@dataclass(frozen=True)
class Frame(ServerMessage):
    """A repainted frame: `ms` from the API receiving the browser's frame to sending this one."""

    type = "frame"
    seq: int
    image: str  # a data: URL
    ms: float | None


@dataclass(frozen=True)
class Error(ServerMessage):
    type = "error"
    error: str

"""Typed messages of the browser socket, parsed from JSON with clear errors."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

DATA_URL_PREFIXES = ("data:image/png;base64,", "data:image/jpeg;base64,")
BASE64_HEAD = re.compile(r"[A-Za-z0-9+/]+=*")  # checked on the first characters only: images are large
MAX_SEQ = 2**53  # what a browser's Number holds exactly


class BrowserMessageError(ValueError):
    """A browser message does not follow the contract."""


@dataclass(frozen=True)
class BrowserFrame:
    seq: int
    image: str  # bare base64 (the data: prefix removed)
    params: dict[str, Any]

    def for_worker(self, session_id: str) -> dict[str, Any]:
        return {"type": "frame", "session_id": session_id, "seq": self.seq, "image": self.image,
                "params": self.params}


def parse_browser_message(text: str) -> BrowserFrame:
    """The one message a browser sends: a frame."""
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):
        raise BrowserMessageError("a message must be JSON") from None
    if not isinstance(message, dict):
        raise BrowserMessageError("a message must be a JSON object")
    if message.get("type") != "frame":
        raise BrowserMessageError(f"unknown message type {message.get('type')!r}")
    return parse_frame(message)


def parse_frame(message: dict[str, Any]) -> BrowserFrame:
    seq = message.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
        raise BrowserMessageError("seq must be a non-negative integer")
    image = message.get("image")
    prefix = next((p for p in DATA_URL_PREFIXES if isinstance(image, str) and image.startswith(p)), None)
    if prefix is None:
        raise BrowserMessageError("image must be a data:image/png;base64 URL")
    bare = image[len(prefix):]  # type: ignore[index]
    if not bare or not BASE64_HEAD.fullmatch(bare[:64]):
        raise BrowserMessageError("image is not valid base64")
    params = message.get("params", {})
    if not isinstance(params, dict):
        raise BrowserMessageError("params must be an object")
    if "prompt" in params and not isinstance(params["prompt"], str):
        raise BrowserMessageError("params.prompt must be a string")
    strength = params.get("strength")
    if strength is not None and (isinstance(strength, bool) or not isinstance(strength, (int, float))):
        raise BrowserMessageError("params.strength must be a number")
    return BrowserFrame(seq, bare, params)


def image_data_url(image: str) -> str:
    """A worker's bare base64 image as a data: URL of its own type (PNG or JPEG)."""
    if image.startswith("data:"):
        return image
    kind = "jpeg" if image.startswith("/9j/") else "png"
    return f"data:image/{kind};base64,{image}"

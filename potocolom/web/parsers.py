"""A JSON parser for the API that turns every malformed body into a 400, never a 500."""
from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


def _refuse(value: str) -> Any:
    raise ValueError(f"{value} is not a finite JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is too large for a number")
    return value


class StrictJSONParser(JSONParser):
    """JSON bodies only: NaN, Infinity, numbers too large for a float and bodies nested past the
    recursion limit are parse errors."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            text = codecs.getreader(encoding)(stream).read()
            return json.loads(text, parse_constant=_refuse, parse_float=_finite_float)
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"JSON parse error - {exc}"[:500]) from None

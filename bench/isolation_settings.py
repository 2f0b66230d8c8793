"""bench/isolation.py's settings: the project's own, with a webhook resolver that takes about 2 s for
hosts under `.slow.invalid` and then fails (the slow-lookups flood). Such a host never resolves, so
its submission is refused (400) and nothing is ever sent anywhere; every other host is looked up by
the system's resolver as usual.

    DJANGO_SETTINGS_MODULE=bench.isolation_settings  (bench/isolation.py passes it to its Daphne)
"""
from __future__ import annotations

import socket
import time

from potocolom.settings import *  # noqa: F403

SLOW_SUFFIX = ".slow.invalid"
SLOW_LOOKUP_SECONDS = 2.0  # the contract's bound on a lookup (scheduling/webhooks/resolving.py)

WEBHOOK_RESOLVER = "bench.isolation_settings.slow_resolve"


def slow_resolve(host: str, port: int) -> list[str]:
    """The system's lookup, except that a `.slow.invalid` host takes SLOW_LOOKUP_SECONDS and then
    does not resolve."""
    if host.lower().rstrip(".").endswith(SLOW_SUFFIX):
        time.sleep(SLOW_LOOKUP_SECONDS)
        raise socket.gaierror(socket.EAI_NONAME, f"{host}: a slow host that does not resolve (bench)")
    from scheduling.webhooks.resolving import system_resolve

    return system_resolve(host, port)

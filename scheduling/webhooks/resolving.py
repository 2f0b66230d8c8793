"""A webhook host's addresses, looked up within RESOLVE_SECONDS, and the one address a webhook may
be sent to (checked by addresses.py): used at submission and again at each delivery attempt. The
resolver is settings.WEBHOOK_RESOLVER (the test seam). The story: docs/operations.md, "Webhooks"."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from django.conf import settings
from django.utils.module_loading import import_string

from potocolom.runtime import Slot, runtime
from scheduling.webhooks.addresses import Target, addresses_problem, parse_webhook_url

RESOLVE_SECONDS = 2.0  # the contract's bound on a lookup: a slower host is refused
MAX_LOOKUPS_IN_FLIGHT = 32  # lookups stuck past their bound keep a thread each: at most this many
Resolver = Callable[[str, int], list[str]]
LOOKUPS_IN_FLIGHT = Slot("scheduling.webhooks.lookups",
                         make=lambda: threading.BoundedSemaphore(MAX_LOOKUPS_IN_FLIGHT))


class WebhookRefused(Exception):
    """The webhook's host may not be posted to (the reason is the message)."""


def system_resolve(host: str, port: int) -> list[str]:
    """The host's addresses as the system's resolver gives them, in its order, each once."""
    found: list[str] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = str(sockaddr[0])
        if address not in found:
            found.append(address)
    return found


def configured_resolver() -> Resolver:
    resolver = settings.WEBHOOK_RESOLVER
    return import_string(resolver) if isinstance(resolver, str) else resolver


def resolve_within(host: str, port: int, *, resolve: Resolver, seconds: float = RESOLVE_SECONDS) -> list[str]:
    """`resolve(host, port)` in a thread of its own, given at most `seconds` (getaddrinfo has no
    timeout of its own); WebhookRefused when it fails or takes longer."""
    lookups = runtime.get(LOOKUPS_IN_FLIGHT)
    if not lookups.acquire(timeout=seconds):
        raise WebhookRefused(f"its host could not be looked up within {seconds:g} s (too many lookups under way)")
    outcome: dict[str, object] = {}

    def lookup() -> None:
        try:
            outcome["addresses"] = resolve(host, port)
        except Exception as exc:  # any resolver failure is "does not resolve"
            outcome["error"] = exc
        finally:
            lookups.release()

    thread = threading.Thread(target=lookup, name="webhook-resolve", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise WebhookRefused(f"its host did not resolve within {seconds:g} s")
    addresses = outcome.get("addresses")
    if not isinstance(addresses, list):
        raise WebhookRefused("its host does not resolve")
    return [str(address) for address in addresses]


def checked_address(target: Target, *, allow_private: bool, resolve: Resolver) -> str:
    """The address to connect to for `target`: its host's first address, once every address it
    resolved to passed the check (a host with one refused address is refused whole, so that no
    second lookup can pick another). WebhookRefused with the reason otherwise."""
    addresses = resolve_within(target.host, target.port, resolve=resolve)
    problem = addresses_problem(addresses, allow_private=allow_private)
    if problem:
        raise WebhookRefused(problem if problem.startswith("its host") else f"its host's address {problem}")
    return addresses[0]


def webhook_url_problem(url: object) -> str | None:
    """Why a submitted webhook_url is refused (form, or where its host resolves to), or None."""
    try:
        checked_address(parse_webhook_url(url), allow_private=settings.WEBHOOK_ALLOW_PRIVATE,
                        resolve=configured_resolver())
    except (ValueError, WebhookRefused) as exc:
        return str(exc)
    return None

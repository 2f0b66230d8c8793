"""A webhook host's addresses, looked up within RESOLVE_SECONDS in a thread counted against its account
(WEBHOOK_LOOKUPS_PER_ACCOUNT) and the process, and the one address a webhook may be sent to (checked
by addresses.py). The resolver is settings.WEBHOOK_RESOLVER. docs/operations.md, "Webhooks"."""
from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Callable, Collection

from django.conf import settings
from django.utils.module_loading import import_string

from potocolom.protocol.errors import DomainError
from potocolom.runtime import Slot, runtime
from scheduling.webhooks.addresses import Target, addresses_problem, parse_webhook_url, port_problem
from scheduling.webhooks.policy import lookup_admission

RESOLVE_SECONDS = 2.0  # the contract's bound on a lookup: a slower host is refused
MAX_LOOKUPS_IN_FLIGHT = 32  # lookup threads alive at once in a process (one stuck past its bound counts)
Resolver = Callable[[str, int], list[str]]


class WebhookRefused(Exception):
    """The webhook's host may not be posted to (the reason is the message); `kind` is "dns" when it
    did not resolve (in time), "refused" when its port or an address is not allowed."""

    def __init__(self, reason: str, *, kind: str = "refused") -> None:
        super().__init__(reason)
        self.kind = kind


class WebhookLookupsThrottled(DomainError):
    """This account already has WEBHOOK_LOOKUPS_PER_ACCOUNT webhook host lookups under way; retry shortly."""

    code = "throttled"
    retry_after_seconds = 2


class WebhookLookupsBusy(DomainError):
    """This API process has as many webhook host lookups under way as it allows; retry shortly."""

    code = "unavailable"
    retry_after_seconds = 2


class Lookups:
    """The name lookups under way in this process, by account: each counted from its start until its
    thread ends, so that a lookup outliving its request's RESOLVE_SECONDS still counts (getaddrinfo
    cannot be stopped): an account's slow hosts hold its own lookups, never another account's."""

    def __init__(self, *, most: int = MAX_LOOKUPS_IN_FLIGHT) -> None:
        self.most = most
        self.changed = threading.Condition()
        self.of_account: Counter[int] = Counter()

    def enter(self, account_id: int, *, per_account: int) -> None:
        """Count one more lookup of the account, or raise what policy.lookup_admission says."""
        with self.changed:
            verdict = lookup_admission(of_account=self.of_account[account_id], in_all=self.under_way(),
                                       per_account=per_account, most=self.most)
            if verdict == "throttled":
                raise WebhookLookupsThrottled()
            if verdict == "busy":
                raise WebhookLookupsBusy()
            self.of_account[account_id] += 1

    def leave(self, account_id: int) -> None:
        with self.changed:
            self.of_account[account_id] -= 1
            if self.of_account[account_id] <= 0:
                del self.of_account[account_id]
            self.changed.notify_all()

    def under_way(self, account_id: int | None = None) -> int:
        """Lookups whose thread is alive: of one account, or in all."""
        return self.of_account[account_id] if account_id is not None else sum(self.of_account.values())

    def wait_at_most(self, count: int, *, account_id: int | None = None, timeout: float) -> bool:
        """Wait until at most `count` lookups (of the account, or in all) are under way."""
        with self.changed:
            return self.changed.wait_for(lambda: self.under_way(account_id) <= count, timeout)


LOOKUPS = Slot("scheduling.webhooks.lookups", make=Lookups)


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


def resolve_within(host: str, port: int, *, resolve: Resolver, account_id: int,
                   seconds: float = RESOLVE_SECONDS) -> list[str]:
    """`resolve(host, port)` in a thread of its own, given at most `seconds` (getaddrinfo has no
    timeout of its own), counted against the account; WebhookRefused when it fails or takes longer,
    WebhookLookupsThrottled or WebhookLookupsBusy when it may not start."""
    lookups = runtime.get(LOOKUPS)
    lookups.enter(account_id, per_account=settings.WEBHOOK_LOOKUPS_PER_ACCOUNT)
    outcome: dict[str, object] = {}

    def lookup() -> None:
        try:
            outcome["addresses"] = resolve(host, port)
        except Exception as exc:  # any resolver failure is "does not resolve"
            outcome["error"] = exc
        finally:
            lookups.leave(account_id)

    thread = threading.Thread(target=lookup, name="webhook-resolve", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no thread to be had
        lookups.leave(account_id)
        raise WebhookLookupsBusy() from None
    thread.join(seconds)
    if thread.is_alive():
        raise WebhookRefused(f"its host did not resolve within {seconds:g} s", kind="dns")
    addresses = outcome.get("addresses")
    if not isinstance(addresses, list):
        raise WebhookRefused("its host does not resolve", kind="dns")
    return [str(address) for address in addresses]


def checked_address(target: Target, *, account_id: int, allow_private: bool, ports: Collection[int],
                    resolve: Resolver) -> str:
    """The address to connect to for `target`: the host itself when it is an IP address, else its
    first address once every address it resolved to passed the check (a host with one refused address
    is refused whole, so that no second lookup can pick another). Without allow_private a port not
    allowed is refused before any lookup. WebhookRefused with the reason otherwise."""
    literal = target.address
    if literal is None and not allow_private and (problem := port_problem(target.port, ports=ports)):
        raise WebhookRefused(problem)
    if literal is not None:
        addresses = [literal]
    else:
        addresses = resolve_within(target.host, target.port, resolve=resolve, account_id=account_id)
    problem = addresses_problem(addresses, port=target.port, ports=ports, allow_private=allow_private)
    if problem:
        raise WebhookRefused(problem, kind="dns" if not addresses else "refused")
    return addresses[0]


def webhook_url_problem(url: object, *, account_id: int) -> str | None:
    """Why a submitted webhook_url is refused (its form, port, or where its host resolves to), or
    None; WebhookLookupsThrottled (429) or WebhookLookupsBusy (503) when its lookup may not start."""
    try:
        checked_address(parse_webhook_url(url), account_id=account_id, allow_private=settings.WEBHOOK_ALLOW_PRIVATE,
                        ports=settings.WEBHOOK_PORTS, resolve=configured_resolver())
    except (ValueError, WebhookRefused) as exc:
        return str(exc)
    return None

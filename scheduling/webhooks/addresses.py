"""Which webhook URLs, ports and addresses may be posted to, decided without I/O: every spelling of
an IP address read as the system would and written one way, and each address's reach by IANA's
special-purpose registries (the table below). The story: docs/operations.md, "Webhooks"."""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal
from urllib.parse import SplitResult, urlsplit

MAX_URL_LENGTH = 2000
DEFAULT_PORTS = {"http": 80, "https": 443}
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# "global": anyone may post there; "local": only with WEBHOOK_ALLOW_PRIVATE (this machine, its
# networks); "none": never (not a destination: documentation, benchmarking, reserved, multicast ...)
Reach = Literal["global", "local", "none"]
HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")

# Each block: (network, what it is, reach); the longest block holding an address decides. Transcribed
# on 2026-12-05 from the registries as they stood after their latest entries known here, 192.0.0.10/32
# (RFC 8155, 2017) and 100:0:0:1::/64 (RFC 9780, 2025): "Globally Reachable" True is "global",
# False or N/A is "none", but loopback, private-use, shared, unique-local and link-local are "local".
#   https://www.iana.org/assignments/iana-ipv4-special-registry/iana-ipv4-special-registry.xhtml
#   https://www.iana.org/assignments/iana-ipv6-special-registry/iana-ipv6-special-registry.xhtml
# Beside them: IPv4 multicast (https://www.iana.org/assignments/multicast-addresses/), and IPv6 outside
# 2000::/3, the only space allocated as Global Unicast (https://www.iana.org/assignments/ipv6-address-space/).
SPECIAL_PURPOSE_BLOCKS: tuple[tuple[str, str, Reach], ...] = (
    ("0.0.0.0/0", "a public address", "global"),
    ("0.0.0.0/8", 'an address of "this network"', "none"),
    ("0.0.0.0/32", 'the address of "this host on this network"', "none"),
    ("10.0.0.0/8", "a private-use address", "local"),
    ("100.64.0.0/10", "a shared address (carrier-grade NAT)", "local"),
    ("127.0.0.0/8", "a loopback address", "local"),
    ("169.254.0.0/16", "a link-local address", "local"),
    ("172.16.0.0/12", "a private-use address", "local"),
    ("192.0.0.0/24", "an IETF protocol assignment", "none"),
    ("192.0.0.0/29", "an IPv4 service continuity address", "none"),
    ("192.0.0.8/32", "the IPv4 dummy address", "none"),
    ("192.0.0.9/32", "the Port Control Protocol anycast address", "global"),
    ("192.0.0.10/32", "the TURN anycast address", "global"),
    ("192.0.0.170/32", "a NAT64/DNS64 discovery address", "none"),
    ("192.0.0.171/32", "a NAT64/DNS64 discovery address", "none"),
    ("192.0.2.0/24", "a documentation address (TEST-NET-1)", "none"),
    ("192.31.196.0/24", "an AS112-v4 address", "global"),
    ("192.52.193.0/24", "an AMT address", "global"),
    ("192.88.99.0/24", "a deprecated 6to4 relay anycast address", "none"),
    ("192.168.0.0/16", "a private-use address", "local"),
    ("192.175.48.0/24", "a direct delegation AS112 service address", "global"),
    ("198.18.0.0/15", "a benchmarking address", "none"),
    ("198.51.100.0/24", "a documentation address (TEST-NET-2)", "none"),
    ("203.0.113.0/24", "a documentation address (TEST-NET-3)", "none"),
    ("224.0.0.0/4", "a multicast address", "none"),
    ("240.0.0.0/4", "a reserved address", "none"),
    ("255.255.255.255/32", "the limited broadcast address", "none"),
    ("::/0", "an address outside the global unicast space (2000::/3)", "none"),
    ("::/96", "a deprecated IPv4-compatible address", "none"),
    ("::/128", "the unspecified address", "none"),
    ("::1/128", "the loopback address", "local"),
    ("64:ff9b::/96", "an IPv4/IPv6 translation address", "global"),
    ("64:ff9b:1::/48", "a local-use IPv4/IPv6 translation address", "none"),
    ("100::/64", "a discard-only address", "none"),
    ("100:0:0:1::/64", "a dummy IPv6 prefix address", "none"),
    ("2000::/3", "a global unicast address", "global"),
    ("2001::/23", "an IETF protocol assignment", "none"),
    ("2001::/32", "a Teredo address", "none"),
    ("2001:1::1/128", "the Port Control Protocol anycast address", "global"),
    ("2001:1::2/128", "the TURN anycast address", "global"),
    ("2001:1::3/128", "the DNS-SD service registration protocol anycast address", "global"),
    ("2001:2::/48", "a benchmarking address", "none"),
    ("2001:3::/32", "an AMT address", "global"),
    ("2001:4:112::/48", "an AS112-v6 address", "global"),
    ("2001:10::/28", "a deprecated ORCHID address", "none"),
    ("2001:20::/28", "an ORCHIDv2 address", "global"),
    ("2001:30::/28", "a drone remote ID entity tag", "global"),
    ("2001:db8::/32", "a documentation address", "none"),
    ("2002::/16", "a 6to4 address", "none"),
    ("2620:4f:8000::/48", "a direct delegation AS112 service address", "global"),
    ("3fff::/20", "a documentation address", "none"),
    ("5f00::/16", "a segment routing (SRv6) identifier", "none"),
    ("fc00::/7", "a unique-local address", "local"),
    ("fe80::/10", "a link-local address", "local"),
    ("fec0::/10", "a deprecated site-local address", "none"),
    ("ff00::/8", "a multicast address", "none"),
)
_BLOCKS = tuple((ipaddress.ip_network(network), phrase, reach) for network, phrase, reach in SPECIAL_PURPOSE_BLOCKS)
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


@dataclass(frozen=True)
class Target:
    """Where a webhook URL posts: its scheme, host (a name in lower case and IDNA, or an IP address
    written one way), port and request path."""

    scheme: str
    host: str
    port: int
    path: str  # path and query, "/" at least

    @property
    def host_header(self) -> str:
        """The Host header (and, for https, the TLS server name is `host`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    @property
    def address(self) -> str | None:
        """The host when it is an IP address (no lookup then), else None."""
        try:
            return str(ipaddress.ip_address(self.host))
        except ValueError:
            return None


def parse_webhook_url(url: object) -> Target:
    """The URL as a Target; ValueError with a message for the submitter when it is not an http or
    https URL of at most MAX_URL_LENGTH characters with a valid host (and no credentials in it)."""
    if not isinstance(url, str) or not url:
        raise ValueError("must be an http or https URL")
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(f"must be at most {MAX_URL_LENGTH} characters")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise ValueError("may not hold spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError("is not a valid URL (its host or port cannot be read)") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise ValueError("must be an http or https URL")
    if parts.username is not None or parts.password is not None:
        raise ValueError("may not carry a user name or password")
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return Target(scheme=scheme, host=_host_of(parts), port=port if port is not None else DEFAULT_PORTS[scheme],
                  path=path)


def _host_of(parts: SplitResult) -> str:
    """The URL's host written one way: an IPv6 address in brackets compressed (IPv4-mapped as its
    IPv4 address), a name that ends in a number read as IPv4 in any spelling, other names in IDNA."""
    host = parts.hostname or ""
    if "[" in parts.netloc:
        if "%" in host:
            raise ValueError("may not carry an IPv6 zone id")
        try:
            ip = ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError("has a host in brackets that is not an IPv6 address") from None
        return str(ip.ipv4_mapped or ip)
    host = host.rstrip(".")
    if not host:
        raise ValueError("must name a host")
    try:
        host = host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise ValueError("has a host name that is not valid") from None
    if not HOST_NAME.fullmatch(host):
        raise ValueError("has a host name that is not valid")
    numeric = ipv4_of_spelling(host)
    return str(numeric) if numeric is not None else host


def ipv4_of_spelling(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address a host name spells when it ends in a number, as inet_aton (and so
    getaddrinfo) and the WHATWG URL standard read it: 1 to 4 parts, each decimal, octal (a leading
    0) or hex (0x), the last filling the bytes left ("127.1", "0x7f.1", "0177.0.0.1", "167772161").
    None for a name that does not end in a number; ValueError for one that does but spells no address."""
    parts = host.split(".")
    if not _is_number(parts[-1]):
        return None
    values = [_number(part) for part in parts]
    numbers = [value for value in values if value is not None]
    if len(values) > 4 or len(numbers) < len(values) or any(value > 255 for value in numbers[:-1]) \
            or numbers[-1] >= 256 ** (5 - len(numbers)):
        raise ValueError("has a host that ends in a number but is not a valid IPv4 address")
    leading = sum(value << (8 * (3 - index)) for index, value in enumerate(numbers[:-1]))
    return ipaddress.IPv4Address(leading + numbers[-1])


def _is_number(part: str) -> bool:
    return part.isdigit() or (part[:2] == "0x" and all(c in "0123456789abcdef" for c in part[2:]))


def _number(part: str) -> int | None:
    """One part of a numeric IPv4 spelling, or None when it is none (empty, or 8 or 9 in octal)."""
    try:
        if part[:2] == "0x":
            return int(part[2:] or "0", 16)
        if len(part) > 1 and part[0] == "0":
            return int(part[1:], 8)
        return int(part, 10) if part.isdigit() else None
    except ValueError:
        return None


def reach_of(address: str) -> tuple[Reach, str]:
    """Whether an address is global, local or no destination at all, and what it is ("127.0.0.1
    is a loopback address (127.0.0.0/8)"). IPv4-mapped and NAT64 addresses are the IPv4 address they
    carry; an IPv6 zone id says nothing here. ValueError for what is not an IP address."""
    ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])
    name = str(ip)
    if isinstance(ip, ipaddress.IPv6Address) and (ip in _MAPPED or ip in _NAT64):
        ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        name = f"{name} (standing for {ip})"
    network, phrase, reach = max((block for block in _BLOCKS if ip in block[0]), key=lambda block: block[0].prefixlen)
    return reach, f"{name} is {phrase} ({network})"


def port_problem(port: int, *, ports: Collection[int]) -> str | None:
    """Why a public host may not be posted to on this port: only 80, 443 and WEBHOOK_PORTS may be."""
    allowed = sorted({*DEFAULT_PORTS.values(), *ports})
    if port in allowed:
        return None
    return f"may not use port {port}: only {', '.join(map(str, allowed))}"


def addresses_problem(addresses: list[str], *, port: int, ports: Collection[int], allow_private: bool) -> str | None:
    """Why a host that resolved to `addresses` is refused, or None when it may be posted to: it
    resolved to nothing, or one of its addresses is no destination, or local (unless allow_private,
    WEBHOOK_ALLOW_PRIVATE), or every one is global and the port is not allowed. A host that is
    local on any address (allowed by allow_private) may use any port."""
    if not addresses:
        return "its host does not resolve"
    local = False
    for address in addresses:
        try:
            reach, what = reach_of(address)
        except ValueError:
            return f"its host resolved to {address!r}, which is not an IP address"
        if reach == "none" or (reach == "local" and not allow_private):
            return f"its host's address {what}, not globally reachable"
        local = local or reach == "local"
    return None if local else port_problem(port, ports=ports)

"""Which webhook URLs and addresses may be posted to, decided without I/O: the URL's form, and the
refusal of every address that is not a public one (loopback, private, link-local, unspecified,
multicast, reserved, IPv4-mapped IPv6 of those): SSRF. The story: docs/operations.md, "Webhooks"."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL_LENGTH = 2000
DEFAULT_PORTS = {"http": 80, "https": 443}
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Target:
    """Where a webhook URL posts: its scheme, host name (lower case, IDNA), port and request path."""

    scheme: str
    host: str
    port: int
    path: str  # path and query, "/" at least

    @property
    def host_header(self) -> str:
        """The Host header (and, for https, the TLS server name is `host`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


def parse_webhook_url(url: object) -> Target:
    """The URL as a Target; ValueError with a message for the submitter when it is not an http or
    https URL of at most MAX_URL_LENGTH characters with a host (and no credentials in it)."""
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
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise ValueError("must name a host")
    try:
        host = host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise ValueError("has a host name that is not valid") from None
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return Target(scheme=scheme, host=host, port=port if port is not None else DEFAULT_PORTS[scheme], path=path)


def address_problem(address: str) -> str | None:
    """Why a webhook may not be sent to this IP address, or None for a public (global) one."""
    try:
        ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone id says nothing here
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:  # the IPv4 address it reaches decides
            return address_problem(str(embedded))
    for is_kind, kind in ((ip.is_loopback, "a loopback"), (ip.is_link_local, "a link-local"),
                          (ip.is_unspecified, "an unspecified"), (ip.is_multicast, "a multicast"),
                          (ip.is_private, "a private"), (ip.is_reserved, "a reserved")):
        if is_kind:
            return f"{ip} is {kind} address"
    if not ip.is_global:  # shared (100.64.0.0/10) and other ranges that are neither private nor public
        return f"{ip} is not a public address"
    return None


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for: IPv4-mapped (::ffff:a.b.c.d), NAT64 (64:ff9b::/96),
    6to4 (2002::/16) or Teredo's client."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def addresses_problem(addresses: list[str], *, allow_private: bool) -> str | None:
    """Why a host that resolved to `addresses` is refused: it resolved to nothing, or any one of its
    addresses is refused (unless allow_private, WEBHOOK_ALLOW_PRIVATE); None when it may be used."""
    if not addresses:
        return "its host does not resolve"
    if allow_private:
        return None
    return next(filter(None, map(address_problem, addresses)), None)

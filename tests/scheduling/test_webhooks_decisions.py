"""Webhook decisions without I/O (scheduling/webhooks/addresses.py, policy.py): which URLs and
addresses may be posted to, and the retry schedule."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from scheduling.webhooks.addresses import Target, address_problem, addresses_problem, parse_webhook_url
from scheduling.webhooks.policy import Decision, after_attempt, retry_delay_seconds

NOW = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)


@pytest.mark.parametrize(("address", "refused_as"), [
    ("93.184.216.34", None),
    ("8.8.8.8", None),
    ("2606:4700::1111", None),
    ("::ffff:8.8.8.8", None),
    ("127.0.0.1", "loopback"),
    ("127.9.9.9", "loopback"),
    ("::1", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("192.168.1.1", "private"),
    ("fc00::1", "private"),
    ("169.254.169.254", "link-local"),  # cloud metadata
    ("fe80::1%eth0", "link-local"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"),
    ("240.0.0.1", "private"),  # reserved, which Python counts private
    ("100.64.0.1", "not a public"),  # shared address space (carrier NAT)
    ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped IPv6 decides by its IPv4 address
    ("::ffff:10.0.0.1", "private"),
    ("64:ff9b::7f00:1", "loopback"),  # NAT64 of 127.0.0.1
    ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
    ("not-an-address", "not an IP address"),
])
def test_it_refuses_every_address_that_is_not_public(address, refused_as):
    problem = address_problem(address)
    if refused_as is None:
        assert problem is None
    else:
        assert problem is not None and refused_as in problem


@pytest.mark.parametrize(("addresses", "allow_private", "refused"), [
    (["93.184.216.34"], False, False),
    (["93.184.216.34", "10.0.0.1"], False, True),  # one refused address refuses the host
    (["10.0.0.1"], True, False),
    ([], False, True),  # does not resolve
    ([], True, True),  # not even with WEBHOOK_ALLOW_PRIVATE
])
def test_a_host_is_refused_when_any_of_its_addresses_is_or_it_has_none(addresses, allow_private, refused):
    assert (addresses_problem(addresses, allow_private=allow_private) is not None) == refused


@pytest.mark.parametrize(("url", "target"), [
    ("https://hooks.example.com/a?b=1#frag", Target("https", "hooks.example.com", 443, "/a?b=1")),
    ("http://Hooks.Example.com:8080", Target("http", "hooks.example.com", 8080, "/")),
    ("HTTPS://exämple.com/x", Target("https", "xn--exmple-cua.com", 443, "/x")),
    ("http://[2606:4700::1111]:81/h", Target("http", "2606:4700::1111", 81, "/h")),
])
def test_it_reads_an_http_or_https_url(url, target):
    assert parse_webhook_url(url) == target


@pytest.mark.parametrize(("url", "says"), [
    ("ftp://hooks.example.com/", "http or https"),
    ("hooks.example.com/path", "http or https"),
    ("", "http or https"),
    (42, "http or https"),
    ("http:///path", "must name a host"),
    ("http://user:pw@hooks.example.com/", "user name or password"),
    ("http://hooks.example.com:99999/", "not a valid URL"),
    ("http://hooks.example.com/a b", "spaces or control"),
    ("http://hooks.example.com/" + "a" * 2000, "at most 2000"),
])
def test_it_refuses_a_url_it_cannot_post_to_with_a_reason(url, says):
    with pytest.raises(ValueError, match=says):
        parse_webhook_url(url)


def test_the_host_header_names_the_port_only_when_it_is_not_the_default():
    assert parse_webhook_url("https://h.example/").host_header == "h.example"
    assert parse_webhook_url("http://h.example:8080/").host_header == "h.example:8080"
    assert parse_webhook_url("http://[2606:4700::1111]:81/").host_header == "[2606:4700::1111]:81"


@pytest.mark.parametrize(("attempts_made", "seconds"), [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 16.0)])
def test_the_backoff_doubles_from_one_second(attempts_made, seconds):
    assert retry_delay_seconds(attempts_made) == seconds


@pytest.mark.parametrize(("status_code", "attempts_made", "decision"), [
    (200, 1, Decision("delivered", None)),
    (204, 6, Decision("delivered", None)),
    (299, 3, Decision("delivered", None)),
    (500, 1, Decision("pending", NOW + timedelta(seconds=1))),
    (None, 2, Decision("pending", NOW + timedelta(seconds=2))),  # no answer at all
    (302, 3, Decision("pending", NOW + timedelta(seconds=4))),  # a redirect is not followed: a failure
    (404, 5, Decision("pending", NOW + timedelta(seconds=16))),
    (500, 6, Decision("failed", None)),  # the last of WEBHOOK_ATTEMPTS
    (None, 6, Decision("failed", None)),
])
def test_after_each_attempt_it_delivers_retries_with_backoff_or_gives_up(status_code, attempts_made, decision):
    assert after_attempt(status_code=status_code, attempts_made=attempts_made, max_attempts=6, now=NOW) == decision

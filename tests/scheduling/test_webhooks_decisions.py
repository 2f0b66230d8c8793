"""Webhook decisions without I/O (scheduling/webhooks/addresses.py, policy.py, sending.error_of): which
URLs, ports and addresses may be posted to, which due deliveries start, whether a lookup may start,
the retry schedule, and an attempt's error in our words."""
from __future__ import annotations

import errno
import http.client
import ssl
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduling.webhooks.addresses import (
    Target,
    addresses_problem,
    ipv4_of_spelling,
    parse_webhook_url,
    port_problem,
    reach_of,
)
from scheduling.webhooks.policy import (
    Decision,
    DueDelivery,
    after_attempt,
    deliveries_to_start,
    lookup_admission,
    retry_delay_seconds,
)
from scheduling.webhooks.sending import error_of

NOW = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)


@pytest.mark.parametrize(("address", "reach", "says"), [
    ("93.184.216.34", "global", "public"),
    ("8.8.8.8", "global", "public"),
    ("2606:4700::1111", "global", "global unicast"),
    ("::ffff:8.8.8.8", "global", "standing for 8.8.8.8"),
    ("127.0.0.1", "local", "loopback"),
    ("127.9.9.9", "local", "loopback"),
    ("::1", "local", "loopback"),
    ("10.1.2.3", "local", "private-use"),
    ("172.16.0.1", "local", "private-use"),
    ("192.168.1.1", "local", "private-use"),
    ("100.64.0.1", "local", "shared"),  # carrier-grade NAT
    ("fc00::1", "local", "unique-local"),
    ("169.254.169.254", "local", "link-local"),  # cloud metadata
    ("fe80::1%eth0", "local", "link-local"),
    ("::ffff:127.0.0.1", "local", "loopback"),  # IPv4-mapped IPv6 is its IPv4 address
    ("::ffff:10.0.0.1", "local", "private-use"),
    ("64:ff9b::7f00:1", "local", "loopback"),  # NAT64 of 127.0.0.1
    ("64:ff9b::808:808", "global", "public"),  # NAT64 of 8.8.8.8
    ("0.0.0.0", "none", "this host"),
    ("0.1.2.3", "none", "this network"),
    ("::", "none", "unspecified"),
    ("224.0.0.1", "none", "multicast"),
    ("ff02::1", "none", "multicast"),
    ("240.0.0.1", "none", "reserved"),
    ("255.255.255.255", "none", "broadcast"),
    # the special-purpose registries' blocks that are not globally reachable, whatever Python says
    ("192.0.0.8", "none", "dummy"),
    ("192.0.0.100", "none", "IETF protocol assignment"),
    ("192.0.0.1", "none", "service continuity"),
    ("192.0.0.170", "none", "NAT64/DNS64"),
    ("192.0.0.9", "global", "Port Control Protocol"),  # the registry's exceptions in 192.0.0.0/24
    ("192.0.0.10", "global", "TURN"),
    ("192.0.2.1", "none", "documentation"),
    ("192.88.99.1", "none", "6to4 relay"),
    ("198.18.0.1", "none", "benchmarking"),
    ("198.19.255.255", "none", "benchmarking"),
    ("198.51.100.1", "none", "documentation"),
    ("203.0.113.1", "none", "documentation"),
    ("192.31.196.1", "global", "AS112"),
    ("fec0::1", "none", "site-local"),
    ("2001:db8::1", "none", "documentation"),
    ("3fff::1", "none", "documentation"),
    ("5f00::1", "none", "SRv6"),
    ("64:ff9b:1::1", "none", "local-use"),
    ("100::1", "none", "discard-only"),
    ("100:0:0:1::1", "none", "dummy"),
    ("2001::1", "none", "Teredo"),
    ("2001:2::1", "none", "benchmarking"),
    ("2001:10::1", "none", "ORCHID"),
    ("2001:1ff::1", "none", "IETF protocol assignment"),
    ("2001:1::1", "global", "Port Control Protocol"),  # the registry's exceptions in 2001::/23
    ("2001:3::1", "global", "AMT"),
    ("2001:20::1", "global", "ORCHIDv2"),
    ("2002:7f00:1::", "none", "6to4"),
    ("2002:808:808::", "none", "6to4"),
    ("::127.0.0.1", "none", "IPv4-compatible"),
    ("4000::1", "none", "outside the global unicast space"),
    ("2620:4f:8000::1", "global", "AS112"),
])
def test_each_address_is_global_local_or_no_destination_as_the_registries_say(address, reach, says):
    assert reach_of(address)[0] == reach
    assert says in reach_of(address)[1]


def test_the_acceptance_addresses_are_not_globally_reachable_though_python_3_11_says_some_are():
    for address in ("192.0.0.8", "198.18.0.1", "fec0::1", "10.0.0.1"):
        assert reach_of(address)[0] != "global"
    assert addresses_problem(["192.0.0.8"], port=80, ports=[], allow_private=True) is not None  # not even then


@pytest.mark.parametrize(("addresses", "port", "allow_private", "problem"), [
    (["93.184.216.34"], 443, False, None),
    (["93.184.216.34"], 80, False, None),
    (["93.184.216.34"], 8443, False, "may not use port 8443"),
    (["93.184.216.34"], 9000, False, None),  # listed in ports
    (["93.184.216.34", "10.0.0.1"], 443, False, "10.0.0.1 is a private-use"),  # one refused address refuses the host
    (["10.0.0.1"], 443, True, None),
    (["10.0.0.1"], 22, True, None),  # a host only WEBHOOK_ALLOW_PRIVATE lets through: any port
    (["93.184.216.34"], 22, True, "may not use port 22"),  # a public host: the ports' rule still
    (["198.18.0.1"], 443, True, "benchmarking"),  # WEBHOOK_ALLOW_PRIVATE lets local addresses only
    ([], 443, False, "does not resolve"),
    ([], 443, True, "does not resolve"),  # not even with WEBHOOK_ALLOW_PRIVATE
])
def test_a_host_is_refused_for_any_of_its_addresses_its_port_or_having_none(addresses, port, allow_private, problem):
    found = addresses_problem(addresses, port=port, ports=[9000], allow_private=allow_private)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found


def test_the_port_rule_names_the_ports_allowed():
    assert port_problem(8443, ports=[9000]) == "may not use port 8443: only 80, 443, 9000"
    assert port_problem(443, ports=[]) is None


@pytest.mark.parametrize(("spelling", "address"), [
    ("167772161", "10.0.0.1"),  # one decimal number
    ("0177.0.0.1", "127.0.0.1"),  # octal
    ("0x7f.1", "127.0.0.1"),  # hex, short
    ("127.1", "127.0.0.1"),  # short
    ("0x7f000001", "127.0.0.1"),
    ("017700000001", "127.0.0.1"),
    ("1.2.65535", "1.2.255.255"),
    ("00000127.0.0.1", "87.0.0.1"),  # octal, as inet_aton reads it
    ("93.184.216.34", "93.184.216.34"),
    ("hooks.example", None),  # a name
    ("123.example", None),
])
def test_a_host_that_ends_in_a_number_is_read_as_ipv4_in_every_spelling(spelling, address):
    found = ipv4_of_spelling(spelling)
    assert (str(found) if found is not None else None) == address


@pytest.mark.parametrize("spelling", ["08.0.0.1", "1.2.3.4.5", "256.0.0.1", "1.2.65536", "4294967296",
                                      "hooks.example.123", "1..2"])
def test_a_host_that_ends_in_a_number_but_spells_no_address_is_refused(spelling):
    with pytest.raises(ValueError, match="not a valid IPv4 address"):
        ipv4_of_spelling(spelling)


@pytest.mark.parametrize(("url", "host"), [
    ("http://167772161/hook", "10.0.0.1"),
    ("http://0177.0.0.1/", "127.0.0.1"),
    ("http://0x7f.1/", "127.0.0.1"),
    ("http://127.1/", "127.0.0.1"),
    ("http://127.0.0.1./", "127.0.0.1"),
    ("http://１２７.０.０.１/", "127.0.0.1"),  # full-width digits, as IDNA folds them
    ("http://[::ffff:7f00:1]/", "127.0.0.1"),  # IPv4-mapped: its IPv4 address
    ("http://[::ffff:127.0.0.1]/", "127.0.0.1"),
    ("http://[0:0::1]/", "::1"),
    ("http://[FEC0::0001]/", "fec0::1"),
    ("http://[::127.0.0.1]/", "::7f00:1"),  # IPv4-compatible (deprecated): refused by its block
])
def test_an_ip_address_in_any_spelling_is_written_one_way(url, host):
    target = parse_webhook_url(url)
    assert target.host == host and target.address == host


@pytest.mark.parametrize(("url", "says"), [
    ("http://[fe80::1%25eth0]/", "zone id"),
    ("http://[v1.abc]/", "not an IPv6 address"),
    ("http://08.0.0.1/", "not a valid IPv4 address"),
    ("http://1.2.3.4.5/", "not a valid IPv4 address"),
    ("http://%31%32%37.0.0.1/", "host name that is not valid"),
    ("http://hooks..example/", "host name that is not valid"),
])
def test_a_host_that_is_no_address_and_no_name_is_refused(url, says):
    with pytest.raises(ValueError, match=says):
        parse_webhook_url(url)


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


# --- which due deliveries start ------------------------------------------------------------------

def due(*owners: int) -> list[DueDelivery]:
    """Due deliveries of these accounts, one second apart, in this order."""
    return [DueDelivery(id=uuid.UUID(int=index), account_id=owner, due_at=NOW + timedelta(seconds=index))
            for index, owner in enumerate(owners)]


ALICE, BOB, CAROL = 1, 2, 3


@pytest.mark.parametrize(("owners", "in_flight", "free", "started"), [
    ((ALICE,) * 10 + (BOB,), {}, 16, [0, 10, 1]),  # alice's first, bob's, then alice's second; no third
    ((ALICE,) * 10 + (BOB,), {ALICE: 2}, 16, [10]),  # alice's two are under way: bob's goes at once
    ((ALICE,) * 10 + (BOB,), {ALICE: 1}, 16, [10, 0]),  # bob's first turn, then alice's second
    ((ALICE, ALICE, BOB, BOB, CAROL), {}, 3, [0, 2, 4]),  # little room: every account's first before any second
    ((ALICE, ALICE, BOB, BOB, CAROL), {}, 4, [0, 2, 4, 1]),
    ((ALICE, BOB), {}, 0, []),  # no room at all
    ((BOB, ALICE), {BOB: 1}, 1, [1]),  # bob has one under way: alice's first turn is before his second
    ((), {}, 4, []),
])
def test_accounts_take_turns_each_at_most_its_concurrency(owners, in_flight, free, started):
    chosen = deliveries_to_start(due(*owners), in_flight=in_flight, per_account=2, free=free)
    assert [int(delivery.id) for delivery in chosen] == started


@given(owners=st.lists(st.sampled_from([ALICE, BOB, CAROL]), max_size=30),
       in_flight=st.dictionaries(st.sampled_from([ALICE, BOB, CAROL]), st.integers(0, 3)),
       per_account=st.integers(1, 4), free=st.integers(0, 10))
def test_no_account_passes_its_cap_nor_the_room_and_no_room_is_left_idle(owners, in_flight, per_account, free):
    chosen = deliveries_to_start(due(*owners), in_flight=in_flight, per_account=per_account, free=free)
    assert len(chosen) <= free
    for account in (ALICE, BOB, CAROL):
        mine = [d for d in chosen if d.account_id == account]
        assert in_flight.get(account, 0) + len(mine) <= per_account or not mine
        waiting = [d for d in due(*owners) if d.account_id == account and d not in chosen]
        has_room = in_flight.get(account, 0) + len(mine) < per_account
        assert not (waiting and has_room and len(chosen) < free), "a startable delivery was left waiting"
        assert mine == sorted(mine, key=lambda d: d.due_at)[:len(mine)]
        assert mine == [d for d in due(*owners) if d.account_id == account][:len(mine)]  # its earliest


# --- whether a lookup may start ------------------------------------------------------------------

@pytest.mark.parametrize(("of_account", "in_all", "admission"), [
    (0, 0, "start"),
    (3, 3, "start"),
    (4, 4, "throttled"),  # the account's own cap comes first ...
    (4, 32, "throttled"),
    (0, 32, "busy"),  # ... the process's bound on lookup threads after it: not the submitter's doing
    (3, 31, "start"),
])
def test_an_accounts_lookups_are_capped_before_the_processes(of_account, in_all, admission):
    assert lookup_admission(of_account=of_account, in_all=in_all, per_account=4, most=32) == admission


# --- an attempt's error, in our words ------------------------------------------------------------

@pytest.mark.parametrize(("exc", "error"), [
    (TimeoutError("timed out"), "timeout"),
    (ConnectionRefusedError(111, "Connection refused"), "connection_refused"),
    (ConnectionResetError(104, "Connection reset by peer"), "connection_reset"),
    (OSError(errno.EHOSTUNREACH, "No route to host"), "unreachable"),
    (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"), "connection_failed"),
    (http.client.BadStatusLine("SSH-2.0-OpenSSH_9.6\r\n"), "bad_response"),
    (http.client.LineTooLong("header line"), "bad_response"),
    (http.client.IncompleteRead(b"partial secret bytes"), "bad_response"),
    (http.client.RemoteDisconnected("Remote end closed connection without response"), "no_response"),
    (ssl.SSLCertVerificationError(1, "certificate verify failed: self-signed certificate"),
     "tls: certificate not verified"),
    (ssl.SSLError(1, "wrong version number"), "tls"),
    (RuntimeError("boom"), "internal_error"),
])
def test_an_attempts_error_is_in_our_words_never_what_the_receiver_sent(exc, error):
    assert error_of(exc) == error

"""Password guessing: LOGIN_FAILURE_LIMIT failed logins for one username from one address lock
that pair out for 15 minutes, the right password included; other pairs are untouched."""
from __future__ import annotations

import uuid

import pytest
from django.core.cache.backends.locmem import LocMemCache
from django.test import Client

from potocolom.web.logins import LoginLimiter

WINDOW = 15 * 60
PASSWORD = "harbour-lights-at-dusk"


@pytest.fixture
def logins():
    return LoginLimiter(LocMemCache(f"logins-{uuid.uuid4()}", {}), limit=3, seconds=WINDOW)


def test_the_limit_th_failure_locks_the_pair_out_for_the_window(logins):
    for n in range(2):
        logins.failed("alice", "10.0.0.1", now=1000.0 + n)
    assert logins.refused_until("alice", "10.0.0.1", now=1002.0) is None

    logins.failed("alice", "10.0.0.1", now=1002.0)

    assert logins.refused_until("alice", "10.0.0.1", now=1003.0) == 1002.0 + WINDOW
    assert logins.refused_until("alice", "10.0.0.1", now=1002.0 + WINDOW - 1) is not None
    assert logins.refused_until("alice", "10.0.0.1", now=1002.0 + WINDOW) is None


def test_other_pairs_are_not_locked_out(logins):
    for n in range(3):
        logins.failed("alice", "10.0.0.1", now=1000.0 + n)

    assert logins.refused_until("alice", "10.0.0.2", now=1003.0) is None
    assert logins.refused_until("bob", "10.0.0.1", now=1003.0) is None


def test_failures_older_than_the_window_do_not_count(logins):
    logins.failed("alice", "10.0.0.1", now=1000.0)
    logins.failed("alice", "10.0.0.1", now=1001.0)

    logins.failed("alice", "10.0.0.1", now=1000.0 + WINDOW + 5)

    assert logins.refused_until("alice", "10.0.0.1", now=1000.0 + WINDOW + 6) is None


def test_a_good_login_starts_the_count_afresh(logins):
    logins.failed("alice", "10.0.0.1", now=1000.0)
    logins.failed("alice", "10.0.0.1", now=1001.0)
    logins.succeeded("alice", "10.0.0.1")

    logins.failed("alice", "10.0.0.1", now=1002.0)

    assert logins.refused_until("alice", "10.0.0.1", now=1003.0) is None


# --- through Django's login views -------------------------------------------------------------

@pytest.fixture
def account(db, settings):
    """An account with a name of its own: a shared cache (Redis) may hold other tests' failures."""
    from django.contrib.auth import get_user_model

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.LOGIN_FAILURE_LIMIT = 3
    return get_user_model().objects.create_user(username=f"guess-{uuid.uuid4().hex[:12]}", password=PASSWORD,
                                                is_staff=True)


def log_in(path: str, username: str, password: str, *, address: str = "10.1.2.3") -> int:
    return Client(REMOTE_ADDR=address).post(path, {"username": username, "password": password}).status_code


@pytest.mark.parametrize("path", ["/accounts/login/", "/admin/login/"])
def test_after_the_limit_the_right_password_is_refused_with_429(account, path):
    assert [log_in(path, account.username, "wrong-password") for _ in range(3)] == [200, 200, 200]

    client = Client(REMOTE_ADDR="10.1.2.3")
    refused = client.post(path, {"username": account.username, "password": PASSWORD})

    assert refused.status_code == 429
    assert 0 < int(refused["Retry-After"]) <= WINDOW
    assert "_auth_user_id" not in client.session
    # the same account from another address, and the login page itself, still work
    assert log_in(path, account.username, PASSWORD, address="10.9.9.9") == 302
    assert Client(REMOTE_ADDR="10.1.2.3").get(path).status_code == 200


def test_a_good_login_below_the_limit_logs_in_and_resets_the_count(account):
    path = "/accounts/login/"
    for _ in range(2):
        assert log_in(path, account.username, "wrong-password") == 200

    assert log_in(path, account.username, PASSWORD) == 302
    assert [log_in(path, account.username, "wrong-password") for _ in range(2)] == [200, 200]
    assert log_in(path, account.username, PASSWORD) == 302

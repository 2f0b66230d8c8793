"""Password guessing: LOGIN_FAILURE_LIMIT failed logins for one username (as Django normalises it)
from one address lock that pair out for 15 minutes, the right password included; other pairs are
untouched; LOGIN_ADDRESS_FAILURE_LIMIT failures from one address, whatever the usernames, lock it out."""
from __future__ import annotations

import uuid

import pytest
from django.core.cache.backends.locmem import LocMemCache
from django.test import Client

from potocolom.web.logins import LoginLimiter, login_username

WINDOW = 15 * 60
PASSWORD = "harbour-lights-at-dusk"


@pytest.fixture
def logins():
    return LoginLimiter(LocMemCache(f"logins-{uuid.uuid4()}", {}), limit=3, seconds=WINDOW, address_limit=5)


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


@pytest.mark.parametrize("spelling", ["demo", "demo ", "  demo\t", "\uff44\uff45\uff4d\uff4f", "de\u217fo"])
def test_a_username_counts_as_django_authenticates_it(spelling):
    assert login_username(spelling) == "demo"  # stripped, NFKC (fullwidth letters, the roman numeral M)


@pytest.mark.parametrize("spelling", ["Demo", "de mo", "demos"])
def test_other_usernames_stay_apart(spelling):
    assert login_username(spelling) != "demo"


def test_an_address_is_locked_out_after_its_limit_whatever_the_usernames(logins):
    for n in range(4):
        logins.failed(f"user-{n}", "10.0.0.1", now=1000.0 + n)
    assert logins.refused_until("someone-else", "10.0.0.1", now=1004.0) is None

    logins.failed("user-4", "10.0.0.1", now=1004.0)

    assert logins.refused_until("someone-else", "10.0.0.1", now=1005.0) == 1004.0 + WINDOW
    assert logins.refused_until("someone-else", "10.0.0.2", now=1005.0) is None
    assert logins.refused_until("someone-else", "10.0.0.1", now=1004.0 + WINDOW) is None


def test_an_addresss_failures_older_than_the_window_do_not_count(logins):
    for n in range(4):
        logins.failed(f"user-{n}", "10.0.0.1", now=1000.0 + n)

    logins.failed("user-4", "10.0.0.1", now=1000.0 + WINDOW + 5)

    assert logins.refused_until("user-5", "10.0.0.1", now=1000.0 + WINDOW + 6) is None


def test_a_good_login_does_not_reset_the_addresss_count(logins):
    for n in range(4):
        logins.failed(f"user-{n}", "10.0.0.1", now=1000.0 + n)
    logins.succeeded("mine", "10.0.0.1")

    logins.failed("user-4", "10.0.0.1", now=1004.0)

    assert logins.refused_until("mine", "10.0.0.1", now=1005.0) is not None


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


@pytest.mark.parametrize("path", ["/accounts/login/", "/admin/login/"])
def test_every_spelling_of_a_username_shares_one_count(db, settings, path):
    from django.contrib.auth import get_user_model

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.LOGIN_FAILURE_LIMIT = 3
    get_user_model().objects.create_user(username="demo", password=PASSWORD, is_staff=True)
    address = f"10.7.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}"

    assert [log_in(path, name, "wrong-password", address=address)
            for name in ("demo", "demo ", "\uff44\uff45\uff4d\uff4f")] == [200, 200, 200]

    assert log_in(path, "demo", PASSWORD, address=address) == 429
    assert log_in(path, " \uff44\uff45\uff4d\uff4f", PASSWORD, address=address) == 429
    assert log_in(path, "demo", PASSWORD, address="10.9.9.9") == 302


def test_an_address_failing_with_many_usernames_is_refused_for_every_one(account, settings):
    settings.LOGIN_ADDRESS_FAILURE_LIMIT = 5
    address = f"10.8.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}"
    guesses = [log_in("/accounts/login/", f"{account.username}-{n}", "wrong-password", address=address)
               for n in range(5)]
    assert guesses == [200] * 5

    client = Client(REMOTE_ADDR=address)
    refused = client.post("/admin/login/", {"username": account.username, "password": PASSWORD})

    assert refused.status_code == 429 and 0 < int(refused["Retry-After"]) <= WINDOW
    assert "_auth_user_id" not in client.session
    assert log_in("/accounts/login/", account.username, PASSWORD, address="10.9.9.8") == 302


def test_the_address_limit_is_the_setting_s_default(settings):
    assert settings.LOGIN_ADDRESS_FAILURE_LIMIT == 50 and settings.LOGIN_FAILURE_SECONDS == WINDOW

"""`manage.py create_account`: a password must pass Django's validators; a weak one exits
non-zero, says why, and creates or changes nothing."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

pytestmark = pytest.mark.django_db

STRONG = "harbour-lights-at-dusk"


def create_account(*args: str) -> list[str]:
    out = io.StringIO()
    call_command("create_account", *args, stdout=out)
    return out.getvalue().splitlines()


@pytest.mark.parametrize(("password", "says"), [
    ("pw", "too short"),
    ("password123", "too common"),
    ("83749201736", "entirely numeric"),
    ("alice-wonder", "too similar"),  # too close to the username alice-wonder
])
def test_a_weak_password_is_refused_and_nothing_is_created(password, says):
    with pytest.raises(CommandError, match=says):
        create_account("alice-wonder", "--password", password)

    assert not get_user_model().objects.exists()


def test_a_weak_password_leaves_an_existing_account_as_it_was():
    create_account("alice", "--password", STRONG)

    with pytest.raises(CommandError, match="password refused"):
        create_account("alice", "--password", "pw")

    assert get_user_model().objects.get(username="alice").check_password(STRONG)


def test_a_strong_password_makes_an_account_that_can_log_in(settings, client):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

    lines = create_account("alice", "--password", STRONG)

    assert lines[0] == "created account alice" and len(lines[-1]) == 40  # the API token, printed last
    assert client.post("/accounts/login/", {"username": "alice", "password": STRONG}).status_code == 302


def test_an_account_without_a_password_still_works_with_its_token():
    lines = create_account("bob")  # as the acceptance harness and the test stack make accounts

    assert lines[0] == "created account bob"
    assert not get_user_model().objects.get(username="bob").has_usable_password()


def test_the_command_exits_non_zero_with_a_clear_message(tmp_path):
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "QUEUE_REBUILD_AT_START": "0"}
    root = Path(__file__).resolve().parents[2]

    def manage(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=root, env=env, capture_output=True,
                              text=True, timeout=180)

    assert manage("migrate", "--noinput").returncode == 0
    done = manage("create_account", "carol", "--password", "12345678")

    assert done.returncode != 0
    assert "password refused" in done.stderr and "numeric" in done.stderr
    assert done.stdout == ""
    assert manage("create_account", "carol").stdout.startswith("created account carol")

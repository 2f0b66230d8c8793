"""REST token authentication keeps a token's account a second: a revoked token or a deactivated
user counts at once in this process, and within the window in another; a wrong token is never kept."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from potocolom.web.tokens import KnownTokens

pytestmark = pytest.mark.django_db


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def client_with(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def test_a_token_revoked_or_a_user_deactivated_here_is_refused_at_once():
    user = User.objects.create_user("alice")
    token = Token.objects.create(user=user)
    assert client_with(token.key).get("/api/v1/models/").status_code == 200
    user.is_active = False
    user.save()
    assert client_with(token.key).get("/api/v1/models/").status_code == 401
    user.is_active = True
    user.save()
    assert client_with(token.key).get("/api/v1/models/").status_code == 200
    token.delete()
    assert client_with(token.key).get("/api/v1/models/").status_code == 401


def test_a_token_is_kept_for_its_window_only_and_the_oldest_go_first():
    user = User.objects.create_user("bob")
    token = Token.objects.create(user=user)
    clock = Clock()
    known = KnownTokens(fresh_seconds=1.0, clock=clock)
    assert known.get(token.key) is None
    known.put(token.key, (user, token))
    clock.now = 0.9
    assert known.get(token.key) == (user, token)
    clock.now = 1.0
    assert known.get(token.key) is None  # read again after the window
    small = KnownTokens(fresh_seconds=1.0, kept=2, clock=clock)
    for key in ("a", "b", "c"):
        small.put(key, (user, token))
    assert small.get("a") is None and small.get("c") == (user, token)  # bounded: the oldest went


def test_a_requests_user_is_its_own_copy():
    user = User.objects.create_user("carol")
    token = Token.objects.create(user=user)
    from potocolom.web.tokens import KeptTokenAuthentication

    auth = KeptTokenAuthentication()
    first, _ = auth.authenticate_credentials(token.key)
    first.first_name = "changed by one request"
    second, _ = auth.authenticate_credentials(token.key)
    assert second.first_name == "" and second.pk == first.pk


def test_a_wrong_token_is_refused_every_time():
    assert client_with("0" * 40).get("/api/v1/models/").status_code == 401
    assert client_with("0" * 40).get("/api/v1/models/").status_code == 401

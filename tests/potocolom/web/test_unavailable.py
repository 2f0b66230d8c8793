"""A request that would wait on the database past DATABASE_TIMEOUT_SECONDS answers 503
`unavailable` (with Retry-After) instead of hanging: a real lock held by another connection, and
PostgreSQL's lock_timeout from the settings; or a Redis that cannot be reached. REST views and
plain Django views alike."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connection
from django.test import Client

from tests.helpers import api_client

pytestmark = pytest.mark.django_db(transaction=True)
postgresql = pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's lock_timeout")


@contextmanager
def table_locked(table: str) -> Iterator[None]:
    """Another connection holds an ACCESS EXCLUSIVE lock on `table` (no read gets past it)."""
    import psycopg

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params) as holder:
        holder.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
        try:
            yield
        finally:
            holder.rollback()


@postgresql
def test_the_lock_timeout_is_the_setting():
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == "5s"
        cursor.execute("SHOW statement_timeout")
        assert cursor.fetchone()[0] == "5s"


@postgresql
def test_a_rest_request_behind_a_held_lock_answers_503(alice):
    client = api_client(alice, raise_request_exception=False)
    assert client.get("/api/v1/jobs/").status_code == 200

    with table_locked("scheduling_job"):
        started = time.monotonic()
        answer = client.get("/api/v1/jobs/")
        waited = time.monotonic() - started

    assert answer.status_code == 503
    assert answer.json()["error"] == "unavailable" and answer.json()["detail"]
    assert int(answer["Retry-After"]) > 0
    assert 4 < waited < 15  # it waited for the lock as long as DATABASE_TIMEOUT_SECONDS, then gave up
    assert client.get("/api/v1/jobs/").status_code == 200  # and the process is fine once it is released


@postgresql
def test_a_page_behind_a_held_lock_answers_503(alice):
    browser = Client(raise_request_exception=False)
    browser.force_login(alice)

    with table_locked("django_session"):
        answer = browser.get("/")

    assert answer.status_code == 503 and answer.json()["error"] == "unavailable"
    assert browser.get("/").status_code == 200


@pytest.fixture
def redis_down(settings):
    """The cache on a Redis that refuses connections (nothing listens on port 1)."""
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                   "LOCATION": "redis://127.0.0.1:1/0",
                                   "OPTIONS": {"socket_timeout": 1, "socket_connect_timeout": 1}}}


def test_a_submission_with_redis_down_answers_503(alice, redis_down):
    answer = api_client(alice, raise_request_exception=False).post("/api/v1/jobs/", {"params": {"prompt": "x"}},
                                                                   format="json")

    assert answer.status_code == 503 and answer.json()["error"] == "unavailable"


def test_a_login_with_redis_down_answers_503(alice, redis_down):
    answer = Client(raise_request_exception=False).post("/accounts/login/", {"username": "alice", "password": "pw"})

    assert answer.status_code == 503 and answer.json()["error"] == "unavailable"

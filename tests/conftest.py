"""Shared fixtures: named accounts, a fresh runtime per test (as a restarted API process has)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "potocolom.settings")

# The worker-socket fixtures (token, v2_workers, header_workers) for tests/fleet and tests/scheduling.
pytest_plugins = ["tests.support.worker_sockets"]


@pytest.fixture(autouse=True)
def fresh_runtime():
    """Each test starts like a freshly started API process: its dispatcher, admission, relay, caches
    and background threads made anew (the queue rebuilt from the database), and all stopped after."""
    from potocolom.runtime import runtime

    runtime.reset()
    yield
    runtime.reset()


@pytest.fixture(autouse=True)
def fresh_channel_layer():
    """Each test gets its own channel layer instance. Every async test runs on a new event loop,
    and a RedisChannelLayer keeps asyncio locks bound to the loop that first waited on them: one
    left locked by a receive cancelled at the end of a test fails the next test with "bound to a
    different event loop". A served process has one loop, so this concerns tests only."""
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture(autouse=True)
def fresh_cache(settings):
    """Each test counts job submissions and failed logins afresh: its own key prefix in the cache
    (the same backend, LocMem or Redis), as account ids repeat from one test to the next."""
    import uuid

    settings.CACHES = {name: {**options, "KEY_PREFIX": f"test-{uuid.uuid4().hex}"}
                       for name, options in settings.CACHES.items()}


@pytest.fixture(autouse=True)
def media_in_tmp(settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path / "media"


@pytest.fixture
def make_account(db):
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    def make(name: str, *, staff: bool = False):
        account = get_user_model().objects.create_user(username=name, password="pw", is_staff=staff)
        Token.objects.create(user=account)
        return account

    return make


@pytest.fixture
def alice(make_account):
    return make_account("alice")


@pytest.fixture
def bob(make_account):
    return make_account("bob")


@pytest.fixture
def carol(make_account):
    return make_account("carol")


@pytest.fixture
async def workers(token):
    """Factory of fake workers (tests/helpers.FakeWorker) presenting the module's `token` fixture
    (or another token); every one still open is closed at the end."""
    from tests.helpers import FakeWorker, close_sync_thread_connections

    made: list[FakeWorker] = []

    def make(worker_id: str = "host-a:0", *, token: str | None = token) -> FakeWorker:
        made.append(FakeWorker(token, worker_id))
        return made[-1]

    yield make
    for worker in made:
        await worker.close()
    await close_sync_thread_connections()

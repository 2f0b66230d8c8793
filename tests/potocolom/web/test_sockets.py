"""The websocket guards: the browser socket's Origin check when the session cookie would
authenticate it, token sockets and the worker socket left alone, unknown paths refused."""
from __future__ import annotations

import logging

import pytest
from channels.testing import WebsocketCommunicator
from django.test import Client

from potocolom.protocol import close_codes
from potocolom.web.sockets import origin_allowed
from tests.helpers import close_sync_thread_connections

pytestmark = pytest.mark.django_db(transaction=True)

OWN = b"http://127.0.0.1:8000"  # a page served by us (127.0.0.1 is in the default ALLOWED_HOSTS)
FOREIGN = b"https://evil.example"


@pytest.mark.parametrize(("origin", "allowed"), [
    ("http://127.0.0.1:8000", True),
    ("http://localhost", True),
    ("https://[::1]:8443", True),
    ("https://app.example.com", True),  # in CSRF_TRUSTED_ORIGINS
    ("https://eu.api.example.org", True),  # a subdomain of a trusted wildcard origin
    ("http://app.example.com", False),  # trusted only over https
    ("https://evil.example", False),
    ("https://127.0.0.1.evil.example", False),
    ("null", False),
    ("", False),
    (None, False),
    ("http://[not-an-address", False),
])
def test_it_allows_the_origins_of_our_own_pages(origin, allowed):
    hosts = ["localhost", "127.0.0.1", "[::1]"]
    trusted = ["https://app.example.com", "https://*.example.org"]

    assert origin_allowed(origin, allowed_hosts=hosts, trusted_origins=trusted) is allowed


@pytest.fixture
def session_cookie(db):
    """The cookie of a drawing page logged in as carol (the session Django's login makes)."""
    from django.contrib.auth import get_user_model

    client = Client()
    client.force_login(get_user_model().objects.create_user(username="carol"))
    return f"sessionid={client.cookies['sessionid'].value}".encode()


@pytest.fixture
def token(db):
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    return Token.objects.create(user=get_user_model().objects.create_user(username="dave")).key


async def handshake(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[bool, int | None]:
    """Whether the socket was accepted, and the code it was closed with after that (if any)."""
    from potocolom.asgi import application

    communicator = WebsocketCommunicator(application, path, headers=headers)
    try:
        connected, _ = await communicator.connect(timeout=5)
        if not connected:
            return False, None
        output = await communicator.receive_output(5)
        return True, output.get("code") if output["type"] == "websocket.close" else None
    finally:
        await communicator.disconnect()
        await close_sync_thread_connections()


# A model no one registered: an authenticated socket is accepted, then closed with NO_MODEL_FITS;
# an unauthenticated one with NOT_AUTHENTICATED.
SESSION = "/ws/session/?model_id=not-registered"


async def test_a_session_cookie_from_our_own_page_authenticates(session_cookie):
    assert await handshake(SESSION, [(b"cookie", session_cookie), (b"origin", OWN)]) == (
        True, close_codes.NO_MODEL_FITS)


@pytest.mark.parametrize("origin", [FOREIGN, b"null", None])
async def test_a_session_cookie_from_another_or_no_origin_is_refused_at_the_handshake(session_cookie, origin):
    headers = [(b"cookie", session_cookie)] + ([(b"origin", origin)] if origin else [])

    assert await handshake(SESSION, headers) == (False, None)


async def test_a_token_socket_is_not_origin_checked(token):
    assert await handshake(f"{SESSION}&token={token}", [(b"origin", FOREIGN)]) == (True, close_codes.NO_MODEL_FITS)
    assert await handshake(f"{SESSION}&token={token}", []) == (True, close_codes.NO_MODEL_FITS)


async def test_from_a_foreign_page_only_the_token_counts_never_the_cookie(session_cookie):
    headers = [(b"cookie", session_cookie), (b"origin", FOREIGN)]

    assert await handshake(f"{SESSION}&token=not-a-token", headers) == (True, close_codes.NOT_AUTHENTICATED)


async def test_a_socket_without_credentials_is_still_told_4001():
    assert await handshake(SESSION, [(b"origin", FOREIGN)]) == (True, close_codes.NOT_AUTHENTICATED)
    assert await handshake(SESSION, []) == (True, close_codes.NOT_AUTHENTICATED)


async def test_the_worker_socket_is_never_origin_checked(session_cookie):
    headers = [(b"cookie", session_cookie), (b"origin", FOREIGN)]

    assert await handshake("/ws/worker/?token=not-a-worker-token", headers) == (True, close_codes.NOT_AUTHENTICATED)


@pytest.mark.parametrize("path", ["/ws/nowhere/", "/", "/ws/session/extra/", "/api/v1/jobs/"])
async def test_a_socket_to_an_unknown_path_is_refused_without_an_error(path, caplog):
    with caplog.at_level(logging.WARNING):
        assert await handshake(path, []) == (False, None)

    assert not [record for record in caplog.records if record.exc_info or record.levelno >= logging.ERROR]

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
HOST = b"127.0.0.1:8000"  # where that page opens its sockets
FOREIGN = b"https://evil.example"


HOSTS = ["localhost", "127.0.0.1", "[::1]", "app.example.com"]
TRUSTED = ["https://app.example.com", "https://*.example.org", "http://127.0.0.1:9000"]
# (Origin, the handshake's Host, whether the deployment is HTTPS, allowed)
ORIGINS = [
    ("http://127.0.0.1:8000", "127.0.0.1:8000", False, True),  # the page this socket's host serves
    ("http://localhost", "localhost", False, True),
    ("https://[::1]:8443", "[::1]:8443", True, True),
    ("http://127.0.0.1:8001", "127.0.0.1:8000", False, False),  # another port of the same host
    ("http://localhost:8000", "127.0.0.1:8000", False, False),  # another allowed host is another site
    ("http://app.example.com", "app.example.com", True, False),  # a plain-http page, HTTPS deployment
    ("https://app.example.com:8443", "app.example.com", True, False),  # another port
    ("https://app.example.com", "app.example.com", True, True),
    ("http://app.example.com", "app.example.com", False, True),  # a plain-http deployment's own page
    ("https://app.example.com", "127.0.0.1:8000", False, True),  # in CSRF_TRUSTED_ORIGINS, whatever the Host
    ("http://127.0.0.1:9000", "localhost", False, True),
    ("http://127.0.0.1:9001", "localhost", False, False),
    ("https://eu.api.example.org", "localhost", False, True),  # a subdomain of a trusted wildcard origin
    ("http://eu.api.example.org", "localhost", False, False),  # ... over another scheme
    ("https://eu.example.org:444", "localhost", True, False),  # ... or port
    ("https://evil.example", "evil.example", True, False),  # its own Host, which ALLOWED_HOSTS refuses
    ("https://127.0.0.1.evil.example", "127.0.0.1", True, False),
    ("null", "localhost", False, False),
    ("http://[not-an-address", "localhost", False, False),
    ("http://127.0.0.1:8000", None, False, True),  # no Host header: the server's address (PEP 333)
    ("http://127.0.0.1", None, False, False),
]


def scope_of(origin: str | None, host: str | None) -> dict:
    headers = [(b"origin", origin.encode())] if origin is not None else []
    return {"type": "websocket", "server": ("127.0.0.1", 8000),
            "headers": headers + ([(b"host", host.encode())] if host is not None else [])}


@pytest.mark.parametrize(("origin", "host", "secure", "allowed"), ORIGINS)
def test_it_allows_the_origins_of_our_own_pages(settings, origin, host, secure, allowed):
    settings.ALLOWED_HOSTS, settings.CSRF_TRUSTED_ORIGINS = HOSTS, TRUSTED

    assert origin_allowed(scope_of(origin, host), secure=secure) is allowed


@pytest.mark.parametrize(("origin", "host", "secure", "allowed"), ORIGINS)
def test_it_decides_as_djangos_csrf_origin_check_does_for_a_post(settings, origin, host, secure, allowed):
    from django.middleware.csrf import CsrfViewMiddleware
    from django.test import RequestFactory

    settings.ALLOWED_HOSTS, settings.CSRF_TRUSTED_ORIGINS = HOSTS, TRUSTED
    where = {"HTTP_HOST": host} if host is not None else {"SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000"}
    post = RequestFactory().post("/", secure=secure, HTTP_ORIGIN=origin, **where)

    assert CsrfViewMiddleware(lambda request: None)._origin_verified(post) is allowed


@pytest.mark.parametrize("origin", [None, ""])
def test_no_origin_is_no_page_of_ours(origin):
    assert origin_allowed(scope_of(origin, "127.0.0.1:8000"), secure=False) is False


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
    assert await handshake(SESSION, [(b"cookie", session_cookie), (b"origin", OWN), (b"host", HOST)]) == (
        True, close_codes.NO_MODEL_FITS)


@pytest.mark.parametrize(("origin", "https"), [(b"http://127.0.0.1:8001", False), (OWN, True),
                                               (b"https://127.0.0.1:8000", False)])
async def test_a_session_cookie_from_another_port_or_scheme_of_our_host_is_refused(session_cookie, settings,
                                                                                    origin, https):
    settings.HTTPS = https

    assert await handshake(SESSION, [(b"cookie", session_cookie), (b"origin", origin), (b"host", HOST)]) == (
        False, None)


@pytest.mark.parametrize("origin", [FOREIGN, b"null", None])
async def test_a_session_cookie_from_another_or_no_origin_is_refused_at_the_handshake(session_cookie, origin):
    headers = [(b"cookie", session_cookie), (b"host", HOST)] + ([(b"origin", origin)] if origin else [])

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

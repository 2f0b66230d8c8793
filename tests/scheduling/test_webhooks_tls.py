"""An https webhook (scheduling/webhooks/sending.py): the connection goes to the checked address,
the URL's host is the TLS server name (SNI), and a certificate that does not verify for it is a
failed attempt with its error, before any request is sent."""
from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

from scheduling.webhooks.addresses import parse_webhook_url
from scheduling.webhooks.sending import post

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")


@pytest.fixture
def tls_server(tmp_path: Path):
    """A TLS listener on 127.0.0.1 with a self-signed certificate for hooks.example, keeping the
    server names clients asked for."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=hooks.example", "-addext", "subjectAltName=DNS:hooks.example", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    names: list[str | None] = []
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            try:
                context.wrap_socket(conn, server_side=True).close()
            except (ssl.SSLError, OSError):
                pass  # the client refused our certificate, as it should

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], names, thread
    listener.close()


def test_the_url_host_is_the_server_name_and_an_unverified_certificate_fails_the_attempt(tls_server):
    port, names, thread = tls_server
    target = parse_webhook_url(f"https://hooks.example:{port}/in")
    result = post(target, address="127.0.0.1", headers={}, body=b"{}", timeout=10)
    thread.join(30)
    assert names == ["hooks.example"]
    assert result.status_code is None and result.error == "tls: certificate not verified"

"""The drawing page at /: login required, the img2img models to pick from, the socket path, and its
JS served by Django itself (whitenoise), with no build step."""
from __future__ import annotations

import re

import pytest
from django.test import Client

# STATIC_ROOT exists only after an optional collectstatic; whitenoise says so once per handler.
pytestmark = [pytest.mark.django_db, pytest.mark.filterwarnings("ignore:No directory at:UserWarning")]


def test_it_sends_an_anonymous_visitor_to_the_login_page() -> None:
    response = Client().get("/")

    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/?next=/"


def test_it_shows_a_usable_login_form() -> None:
    response = Client().get("/accounts/login/?next=/")

    assert response.status_code == 200
    body = response.content.decode()
    assert 'name="username"' in body and 'name="password"' in body and 'name="next" value="/"' in body


def test_it_logs_in_through_the_form_and_lands_on_the_drawing_page(alice, models) -> None:
    client = Client()
    response = client.post("/accounts/login/", {"username": "alice", "password": "pw", "next": "/"}, follow=True)

    assert response.redirect_chain == [("/", 302)]
    assert response.status_code == 200 and b'id="canvas"' in response.content


def test_it_offers_the_img2img_models_cheapest_first_and_picks_the_cheapest(alice, models) -> None:
    client = Client()
    client.force_login(alice)

    response = client.get("/")

    assert response.status_code == 200
    assert [m.model_id for m in response.context["models"]] == ["tiny-a", "tiny-b", "std-a"]
    body = response.content.decode()
    options = re.findall(r'<option value="([^"]+)"( selected)?', body)
    assert options == [("tiny-a", " selected"), ("tiny-b", ""), ("std-a", "")]
    assert "tiny-c" not in body  # txt2img only: never a session's model


def test_it_tells_the_page_where_the_session_socket_is(alice, models) -> None:
    client = Client()
    client.force_login(alice)

    body = client.get("/").content.decode()

    assert 'data-socket="/ws/session/"' in body
    assert '<script src="/static/realtime/drawing.js">' in body
    assert 'id="output"' in body and 'id="prompt"' in body and 'id="strength"' in body


def test_it_says_so_when_no_model_can_hold_a_session(alice) -> None:
    client = Client()
    client.force_login(alice)

    response = client.get("/")

    assert response.status_code == 200 and list(response.context["models"]) == []
    assert b"No drawing model is registered yet." in response.content


@pytest.mark.parametrize(("path", "content_type"), [
    ("/static/realtime/drawing.js", "text/javascript"),
    ("/static/realtime/drawing.css", "text/css"),
])
def test_it_serves_the_page_static_files_without_collectstatic(path: str, content_type: str) -> None:
    response = Client().get(path)

    assert response.status_code == 200
    assert response["Content-Type"].startswith(content_type)
    body = b"".join(response.streaming_content) if response.streaming else response.content
    assert len(body) > 100

"""The jobs page at /jobs/: login required, the text-to-image models and tiers to pick from, the jobs
socket's path, a CSRF token for its REST calls, and its JS served by Django itself (no build step)."""
from __future__ import annotations

import pytest
from django.test import Client

from tests.helpers import register_model

# STATIC_ROOT exists only after an optional collectstatic; whitenoise says so once per handler.
pytestmark = [pytest.mark.django_db, pytest.mark.filterwarnings("ignore:No directory at:UserWarning")]


def test_it_sends_an_anonymous_visitor_to_the_login_page() -> None:
    response = Client().get("/jobs/")

    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/?next=/jobs/"


def test_it_offers_the_text_to_image_models_and_the_tiers(alice) -> None:
    register_model("tiny-a", cost=1.0)
    register_model("drawing-only", cost=0.5, capabilities=("img2img",))
    client = Client()
    client.force_login(alice)

    body = client.get("/jobs/").content.decode()

    assert '<option value="tiny-a">' in body and "drawing-only" not in body
    assert all(f'<option value="tier:{tier}">' in body for tier in ("draft", "standard", "premium"))
    assert 'data-socket="/ws/jobs/"' in body and 'name="csrfmiddlewaretoken"' in body
    assert 'aria-current="page">Jobs</a>' in body


def test_its_script_is_served_from_this_host(alice) -> None:
    client = Client()
    client.force_login(alice)
    response = client.get("/static/scheduling/jobs.js")

    assert response.status_code == 200
    assert b"new WebSocket(" in b"".join(response.streaming_content)

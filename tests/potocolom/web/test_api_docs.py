"""The API documentation for people: /api/v1/docs/ (Swagger UI) loads every file from this host, and the
OpenAPI schema it shows generates with no warning ("REST" in docs/protocol.md)."""
from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest
from django.core.management import call_command
from django.test import Client

pytestmark = pytest.mark.django_db


class Assets(HTMLParser):
    """Every address a page makes the browser load: script src, link href, img src."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        for attribute in ("src", "href"):
            if tag in {"script", "link", "img"} and named.get(attribute):
                self.urls.append(str(named[attribute]))


def test_the_docs_page_is_swagger_ui_whose_files_all_come_from_this_host() -> None:
    client = Client()  # no login: the page and the schema are public, the calls it makes are not
    response = client.get("/api/v1/docs/")

    assert response.status_code == 200 and response["Content-Type"].startswith("text/html")
    page = response.content.decode()
    assets = Assets()
    assets.feed(page)
    assert any(url.endswith("swagger-ui-bundle.js") for url in assets.urls)
    assert all(url.startswith("/") and not url.startswith("//") for url in assets.urls), assets.urls
    assert not re.search(r"https?://", page), "the page names another host"
    assert '"/api/v1/schema/"' in page
    for url in assets.urls:  # and this host really serves each of them
        served = client.get(url)
        assert served.status_code == 200, url
        assert b"".join(served.streaming_content if served.streaming else [served.content])  # type: ignore[arg-type]


def test_the_api_root_points_people_at_the_docs() -> None:
    assert Client().get("/api/v1/").json()["docs"] == "/api/v1/docs/"


def test_the_schema_generates_and_validates_with_no_warning(tmp_path) -> None:
    target = tmp_path / "schema.json"

    # --fail-on-warn turns any warning or error of drf-spectacular into a failure of the command
    call_command("spectacular", "--validate", "--fail-on-warn", "--format", "openapi-json", "--file", str(target))

    schema = json.loads(target.read_text())
    assert schema["info"]["title"] == "potocolom API"
    assert {"/api/v1/jobs/", "/api/v1/jobs/{id}/", "/api/v1/models/", "/api/v1/usage/"} <= set(schema["paths"])

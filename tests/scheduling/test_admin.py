"""The admin's job pages: a row per job an operator can read (short id, thumbnails, model, state, owner,
created, how long it waited and ran), a read-only job page with its images and no Save, and nothing of
it (pages or pictures) for anyone but staff."""
from __future__ import annotations

import base64
import io
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from PIL import Image

from tests.helpers import register_model

pytestmark = pytest.mark.django_db

WORKER = "host-a:0"


def png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def finished_job(account, *, images: list[bytes], params: dict | None = None) -> str:
    """A job submitted, started on a worker 3 s later and finished 2.5 s after that, its images stored
    by the same service a worker's job_result goes through."""
    from scheduling.models import Job, JobState
    from scheduling.services import JobRequest, job_finish, job_submit

    created = timezone.now() - timedelta(seconds=60)
    job = job_submit(account=account, now=created,
                     request=JobRequest(params=params or {"prompt": "a red square"}, model_id="model-a"))
    Job.objects.filter(id=job.id).update(state=JobState.RUNNING, worker_id=WORKER,  # as a dispatch leaves it
                                         started_at=created + timedelta(seconds=3))
    assert job_finish(worker_id=WORKER, job_id=str(job.id), images=[base64.b64encode(i).decode() for i in images],
                      gpu_ms=2400.0, rung="full", now=created + timedelta(seconds=5.5))
    return str(job.id)


@pytest.fixture
def staff_client(make_account) -> Client:
    operator = make_account("operator", staff=True)
    operator.is_superuser = True  # as `create_account --staff` makes it
    operator.save()
    client = Client()
    client.force_login(operator)
    return client


@pytest.fixture(autouse=True)
def model_a() -> None:
    register_model("model-a")


def thumbnail_urls(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]+/thumbnail/\d+/)"', page)


def test_the_job_list_shows_readable_rows_with_thumbnails(staff_client: Client, alice) -> None:
    job_id = finished_job(alice, images=[png(300, 200, (255, 0, 0)), png(64, 64, (0, 0, 255))])

    page = staff_client.get("/admin/scheduling/job/").content.decode()

    row = re.search(r'<tr[^>]*>(?:(?!</tr>).)*' + job_id[:8] + r'(?:(?!</tr>).)*</tr>', page, re.S)
    assert row is not None, "no row with the job's short id"
    cells = dict(re.findall(r'<t[dh] class="field-([a-z_]+)[^"]*"[^>]*>(.*?)</t[dh]>', row.group(0), re.S))
    assert re.sub(r"<[^>]+>", "", cells["short_id"]).strip() == job_id[:8]
    assert cells["model_id"] == "model-a" and cells["state"].lower() == "succeeded" and cells["owner"] == "alice"
    assert cells["waited"] == "3.00 s" and cells["ran"] == "2.50 s" and cells["gpu_time"] == "2.40 s"
    assert cells["created_at"]
    urls = thumbnail_urls(cells["thumbnails"])
    assert len(urls) == 2
    first = staff_client.get(urls[0])
    assert first.status_code == 200 and first["Content-Type"] == "image/jpeg"
    with Image.open(io.BytesIO(first.content)) as small:
        assert max(small.size) <= 96 and small.size[0] > small.size[1]  # scaled down, shape kept
        red, green, blue = small.convert("RGB").getpixel((small.width // 2, small.height // 2))  # type: ignore[misc]
        assert red > 200 and green < 60 and blue < 60  # the first image, the red one


def test_the_job_page_shows_its_images_and_no_save_button(staff_client: Client, alice) -> None:
    job_id = finished_job(alice, images=[png(128, 128, (0, 255, 0))])

    response = staff_client.get(f"/admin/scheduling/job/{job_id}/change/")

    assert response.status_code == 200
    page = response.content.decode()
    assert len(thumbnail_urls(page)) == 1
    full = re.search(r'<a href="([^"]+/images/0/)"><img', page)
    assert full is not None
    image = staff_client.get(full.group(1))
    assert image.status_code == 200 and image["Content-Type"] == "image/png"
    assert b"".join(image.streaming_content) == png(128, 128, (0, 255, 0))  # type: ignore[attr-defined]
    assert not re.search(r'<input[^>]+type="submit"[^>]+value="Save', page)
    assert 'name="_save"' not in page and 'name="_continue"' not in page
    assert "a red square" in page  # its params, shown


def test_the_job_page_cannot_be_saved(staff_client: Client, alice) -> None:
    from scheduling.models import Job

    job_id = finished_job(alice, images=[png(8, 8, (0, 0, 0))])

    response = staff_client.post(f"/admin/scheduling/job/{job_id}/change/", {"state": "queued", "_save": "Save"})

    assert response.status_code == 403
    assert Job.objects.get(id=job_id).state == "succeeded"


def test_the_job_page_shows_the_init_image_as_a_picture_not_its_base64(staff_client: Client, alice) -> None:
    init = base64.b64encode(png(200, 100, (10, 20, 30))).decode()
    job_id = finished_job(alice, images=[], params={"prompt": "repaint", "init_image": init})

    page = staff_client.get(f"/admin/scheduling/job/{job_id}/change/").content.decode()

    assert init not in page and init[:40] not in page
    url = re.search(r'<img src="([^"]+/init-image/thumbnail/\d+/)"', page)
    assert url is not None
    response = staff_client.get(url.group(1))
    assert response.status_code == 200 and response["Content-Type"] == "image/jpeg"


def test_a_missing_image_is_404_not_an_error(staff_client: Client, alice) -> None:
    job_id = finished_job(alice, images=[png(8, 8, (0, 0, 0))])

    assert staff_client.get(f"/admin/scheduling/job/{job_id}/images/5/").status_code == 404
    assert staff_client.get(f"/admin/scheduling/job/{job_id}/images/5/thumbnail/96/").status_code == 404
    assert staff_client.get(f"/admin/scheduling/job/{job_id}/images/0/thumbnail/100000/").status_code == 404
    assert staff_client.get(f"/admin/scheduling/job/{job_id}/init-image/thumbnail/96/").status_code == 404


def test_non_staff_get_neither_the_pages_nor_the_pictures(alice, bob) -> None:
    job_id = finished_job(alice, images=[png(8, 8, (0, 0, 0))])
    owner = Client()
    owner.force_login(alice)  # even the job's own account: the admin is for staff

    for path in ["/admin/scheduling/job/", f"/admin/scheduling/job/{job_id}/change/",
                 f"/admin/scheduling/job/{job_id}/images/0/", f"/admin/scheduling/job/{job_id}/images/0/thumbnail/96/"]:
        for client in (owner, Client()):
            response = client.get(path)
            assert response.status_code == 302 and "/admin/login/" in response["Location"], path

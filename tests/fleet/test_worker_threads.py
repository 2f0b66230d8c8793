"""Each worker socket's database calls on a thread of its own (fleet/consumers.py
WorkerConsumer.__call__): a worker whose report waits on a locked row holds up only itself; another
worker's reports are stored meanwhile. PostgreSQL (a row lock of another connection); an in-memory
SQLite database keeps one shared thread (its shared cache refuses a second writer)."""
from __future__ import annotations

import base64

import pytest
from django.db import connection

from tests.helpers import eventually, job_row, register_model, submit_jobs, tiny_png
from tests.potocolom.web.test_lanes import row_locked, waiting_on_a_lock

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(connection.vendor != "postgresql",
                                 reason="a row lock of another connection: PostgreSQL")]

PNG_B64 = base64.b64encode(tiny_png()).decode()


@pytest.fixture
def models(db):
    return register_model("tiny-b")  # beside tiny-a (conftest)


async def test_a_report_behind_a_row_lock_holds_up_only_its_own_worker(models, alice, workers):
    first, second = workers("host-a:0"), workers("host-b:0")
    await first.join(["tiny-a"])
    await second.join(["tiny-b"])
    [job_a] = await submit_jobs(alice, 1, model_id="tiny-a")
    [job_b] = await submit_jobs(alice, 1, model_id="tiny-b")
    assert [m["job_id"] for m in await first.jobs(1)] == [job_a]
    assert [m["job_id"] for m in await second.jobs(1)] == [job_b]

    with row_locked("scheduling_job", job_a):
        await first.result(job_a, [PNG_B64])
        await eventually(waiting_on_a_lock)  # the first worker's report waits on the lock

        await second.result(job_b, [PNG_B64])

        async def stored() -> bool:
            return (await job_row(job_b))["state"] == "succeeded"

        await eventually(stored)
        assert (await job_row(job_a))["state"] == "dispatched"  # still waiting
    async def first_stored() -> bool:
        return (await job_row(job_a))["state"] == "succeeded"

    await eventually(first_stored)

"""GET /metrics: the Prometheus text of this process's event series (potocolom.metrics) and of the
state read at each scrape through the selectors of scheduling, realtime and workers (the same from
every API process). The story: docs/operations.md, "Metrics"."""
from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from django.conf import settings
from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.views import APIView

from models_registry.selectors import registered_ids
from potocolom.web.metrics_access import MetricsTokenAuthentication, PlainTextRenderer, StaffOrMetricsScraper
from realtime import selectors as session_reads
from scheduling import selectors as job_reads
from scheduling.models import JobState
from workers import selectors as worker_reads


class StateCollector:
    """The series whose truth is the database (or admission's slots), read when scraped: one
    grouped query per family (the job counts serve two)."""

    def __init__(self, *, now: datetime) -> None:
        self.now = now

    def collect(self) -> Iterator[Metric]:
        jobs = job_reads.jobs_per_model_and_state()
        slots_of = session_reads.slots_per_model()
        # a model_id label is a registered model's: what a worker names, the registry does not know, is left out
        known = registered_ids(sorted({model_id for model_id, _ in jobs} | slots_of.keys()))
        jobs = {key: count for key, count in jobs.items() if key[0] in known}
        queued = GaugeMetricFamily("potocolom_jobs_queued", "Jobs waiting for a worker, per model",
                                   labels=["model_id"])
        for model_id in sorted({model_id for model_id, _ in jobs}):
            queued.add_metric([model_id], jobs.get((model_id, JobState.QUEUED.value), 0))
        yield queued
        total = CounterMetricFamily("potocolom_jobs",
                                    "Jobs per model and state, purged ones too (ended states only grow)",
                                    labels=["model_id", "state"])
        for (model_id, state), count in sorted(jobs.items()):
            total.add_metric([model_id, state], count)
        yield total

        sessions = GaugeMetricFamily("potocolom_sessions", "Realtime session rows per state", labels=["state"])
        for state, count in sorted(session_reads.sessions_per_state().items()):
            sessions.add_metric([state], count)
        yield sessions
        slots = GaugeMetricFamily("potocolom_realtime_slots", "Realtime slots of connected workers, per model",
                                  labels=["model_id", "state"])
        for model_id, (free, used) in slots_of.items():
            if model_id not in known:
                continue
            slots.add_metric([model_id, "free"], free)
            slots.add_metric([model_id, "used"], used)
        yield slots

        connected = worker_reads.connected_count(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS, now=self.now)
        yield GaugeMetricFamily("potocolom_workers", "Workers connected to any API process", value=connected)


def metrics_text(*, now: datetime) -> bytes:
    """This process's event series, then the state series."""
    state = CollectorRegistry()
    state.register(StateCollector(now=now))
    return generate_latest(REGISTRY) + generate_latest(state)


class MetricsView(APIView):
    """Staff, or the METRICS_TOKEN bearer: the Prometheus text format."""

    authentication_classes = [MetricsTokenAuthentication, TokenAuthentication, SessionAuthentication]
    permission_classes = [StaffOrMetricsScraper]
    renderer_classes = [JSONRenderer, PlainTextRenderer]

    @extend_schema(exclude=True)  # a scrape target beside the REST API, not a part of it
    def get(self, request: Request) -> HttpResponse:
        return HttpResponse(metrics_text(now=timezone.now()), content_type=CONTENT_TYPE_LATEST)

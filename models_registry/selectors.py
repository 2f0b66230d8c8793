"""Reads of the model registry, as plain manifests for the pure routing rules."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from django.conf import settings

from models_registry.models import ModelManifest
from potocolom.protocol.manifests import Manifest
from potocolom.protocol.params import param_caps
from potocolom.runtime import Slot, runtime

MANIFESTS_FRESH_SECONDS = 1.0  # how long a process routes with the registry as it last read it


class RegisteredManifests:
    """The registry as routing reads it on every submission and session: read again once
    `fresh_seconds` have passed since the last read, or at once after a change this process saved
    (a change another process saves counts within `fresh_seconds`)."""

    def __init__(self, *, fresh_seconds: float = MANIFESTS_FRESH_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fresh_seconds, self.clock = fresh_seconds, clock
        self._lock = threading.Lock()
        self._read: tuple[float, list[Manifest]] | None = None

    def get(self) -> list[Manifest]:
        with self._lock:
            read = self._read
        if read is not None and 0 <= self.clock() - read[0] < self.fresh_seconds:
            return read[1]
        at = self.clock()
        manifests = [to_manifest(row) for row in ModelManifest.objects.all()]
        with self._lock:
            if self._read is None or self._read[0] <= at:
                self._read = (at, manifests)
        return manifests

    def forget(self) -> None:
        """A manifest changed here: the next read goes to the database."""
        with self._lock:
            self._read = None


REGISTERED_MANIFESTS = Slot("models_registry.registered_manifests", make=RegisteredManifests)


def registered_manifests() -> list[Manifest]:
    """Every registered model as plain data, cheapest first (as read at most MANIFESTS_FRESH_SECONDS
    ago: routing reads it on every submission)."""
    return runtime.get(REGISTERED_MANIFESTS).get()


def manifests_changed() -> None:
    """A manifest was saved or deleted in this process (the app's signals call this)."""
    runtime.get(REGISTERED_MANIFESTS).forget()


def registered_ids(model_ids: list[str]) -> set[str]:
    """Those of `model_ids` that are registered."""
    return set(ModelManifest.objects.filter(model_id__in=model_ids).values_list("model_id", flat=True))


def to_manifest(row: ModelManifest) -> Manifest:
    """The row as routing sees it: with the API's MAX_IMAGE_SIDE and MAX_STEPS as caps on the params
    its schema sets no maximum for."""
    return Manifest(model_id=row.model_id, tier=row.tier, cost=row.cost, capabilities=tuple(row.capabilities),
                    pipeline=row.pipeline, source=row.source, params_schema=row.params_schema,
                    caps=param_caps(max_side=settings.MAX_IMAGE_SIDE, max_steps=settings.MAX_STEPS))

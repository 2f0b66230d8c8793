"""The registry as routing reads it on every submission: read once a second at most, and at once
after a change saved in this process."""
from __future__ import annotations

import pytest

from models_registry.models import ModelManifest
from models_registry.selectors import REGISTERED_MANIFESTS, RegisteredManifests, registered_manifests
from potocolom.runtime import runtime
from tests.helpers import register_model

pytestmark = pytest.mark.django_db


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ids(manifests) -> list[str]:
    return sorted(m.model_id for m in manifests)


def test_a_change_another_process_saved_counts_within_the_fresh_window(django_assert_num_queries):
    register_model("tiny-a")
    clock = Clock()
    cache = RegisteredManifests(fresh_seconds=1.0, clock=clock)
    with django_assert_num_queries(1):
        assert ids(cache.get()) == ["tiny-a"]
        assert ids(cache.get()) == ["tiny-a"]  # within the window: no second read
    # another process's change: a write no signal of this process hears
    ModelManifest.objects.filter(model_id="tiny-a").update(model_id="tiny-b")
    clock.now += 0.5
    assert ids(cache.get()) == ["tiny-a"]
    clock.now += 0.5
    assert ids(cache.get()) == ["tiny-b"]


def test_a_change_saved_in_this_process_counts_at_once():
    register_model("tiny-a")
    assert ids(registered_manifests()) == ["tiny-a"]
    register_model("tiny-b")
    assert ids(registered_manifests()) == ["tiny-a", "tiny-b"]
    ModelManifest.objects.get(model_id="tiny-a").delete()
    assert ids(registered_manifests()) == ["tiny-b"]
    assert isinstance(runtime.get(REGISTERED_MANIFESTS), RegisteredManifests)

"""Loaded with `-p tests.environment` before Django's settings: the test process's environment."""
from __future__ import annotations

import os

# Tests build the queue themselves (the fresh_dispatcher fixture); importing potocolom.asgi must not
# start a background load of it.
os.environ["QUEUE_REBUILD_AT_START"] = "0"
# Nor may it start the dead-worker sweep: tests run it with their own clock (tests/fleet/test_sweeper.py).
os.environ["DEAD_WORKER_SWEEP"] = "0"

"""Signals where the app that knows must not import the one that acts: scheduling and realtime say
that work waits or ended, and fleet's placement plans again soon. Receivers return at once (they
only wake a thread)."""
from __future__ import annotations

from django.dispatch import Signal

# kwargs: model_id (str). Sent when a job was queued that no worker of this process took, and when
# a session joined the admission queue.
work_waiting = Signal()

# kwargs: worker_id (str). Sent when a worker stopped holding a job (it ended) or a session (closed,
# idle): memory busy until then may be what a waiting model needs.
work_ended = Signal()

"""ASGI entry point: HTTP (Django) and the sockets (browser sessions, job events, GPU workers)."""
from __future__ import annotations

import logging
import os
import threading

from django.core.wsgi import get_wsgi_application

from potocolom.web.http import OneHopWsgi

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "potocolom.settings")
# Django's synchronous handler in one thread hop per request (see potocolom/web/http.py).
django_http_app = OneHopWsgi(get_wsgi_application())

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from fleet.consumers import WorkerConsumer  # noqa: E402
from potocolom.web.sockets import BrowserOriginCheck, refuse  # noqa: E402
from realtime.consumers import SessionConsumer  # noqa: E402
from scheduling.consumers import JobEventsConsumer  # noqa: E402
from scheduling.dispatcher import dispatcher  # noqa: E402

# Browser-facing sockets (the session cookie may authenticate them) check the page's Origin; the
# worker socket (tokens only) does not; any other path is refused (403), not answered with a 500.
websocket_urls = [
    path("ws/session/", BrowserOriginCheck(SessionConsumer.as_asgi())),  # type: ignore[arg-type]  # an ASGI app
    path("ws/jobs/", BrowserOriginCheck(JobEventsConsumer.as_asgi())),  # type: ignore[arg-type]  # an ASGI app
    path("ws/worker/", WorkerConsumer.as_asgi()),
    re_path(r"", refuse),  # type: ignore[arg-type]  # channels routes ASGI apps
]

def rebuild_queue_at_start() -> None:
    """Load the job queue from the database in the background while Daphne starts listening."""
    try:
        dispatcher()
    except Exception:  # the first request retries the load and reports the error there
        logging.getLogger(__name__).exception("could not rebuild the job queue at start")
    finally:
        connection.close()


if settings.QUEUE_REBUILD_AT_START:
    threading.Thread(target=rebuild_queue_at_start, name="queue-rebuild", daemon=True).start()
if settings.DEAD_WORKER_SWEEP:
    # Dead workers are found by every served process, whether or not a socket is open on it; so
    # is placement planned (PLACEMENT=demand), on its events and every PLACEMENT_SECONDS.
    from fleet.placement.runner import placement_start  # noqa: E402
    from fleet.sweeper import dead_worker_sweep_start  # noqa: E402
    from scheduling.webhooks.runner import webhooks_start  # noqa: E402

    dead_worker_sweep_start()
    placement_start()
    webhooks_start()  # webhook deliveries due in the database, whichever process wrote them

application = ProtocolTypeRouter({
    "http": django_http_app,
    "websocket": AuthMiddlewareStack(URLRouter(websocket_urls)),
})

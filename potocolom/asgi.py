"""The API process's entry point (`daphne potocolom.asgi:application`): HTTP and the three sockets,
routed by potocolom/urls.py, and the one place the process's runtime is started."""
from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "potocolom.settings")

from channels.routing import ProtocolTypeRouter
from django.core.wsgi import get_wsgi_application

from potocolom.runtime import runtime
from potocolom.web.http import OneHopWsgi


def build_application() -> ProtocolTypeRouter:
    """Django's synchronous handler in one thread hop per request (potocolom/web/http.py), and the
    socket routes, which import the apps' consumers and so only once Django is set up."""
    http = OneHopWsgi(get_wsgi_application())  # sets Django up
    from potocolom.urls import websocket_application

    return ProtocolTypeRouter({"http": http, "websocket": websocket_application()})


application = build_application()
# The queue's rebuild, the dead-worker sweep, placement and webhook delivery (each app registers
# its own in its AppConfig.ready; settings may keep them off, as the tests' environment does).
runtime.start()

"""Websocket close codes of both sockets (an app may close with 1000 or 3000-4999 only)."""
from __future__ import annotations

BAD_QUERY = 4000  # browser: a bad query parameter
NOT_AUTHENTICATED = 4001  # both: no account, a wrong token, or an account's token on the worker socket
REPLACED = 4002  # worker: a newer connection with the same worker_id took over
SESSION_LIMIT = 4003  # browser: the account holds ACCOUNT_SESSION_LIMIT sessions already
SOCKET_LIMIT = 4003  # browser: the account holds ACCOUNT_SOCKET_LIMIT /ws/jobs/ sockets already
WORKER_ID_TAKEN = 4003  # worker: its worker_id belongs to another worker token
NO_MODEL_FITS = 4004  # browser: no registered model fits the request
SILENT = 4008  # worker: nothing received for 3 heartbeat periods
MESSAGE_TOO_BIG = 4009  # browser: a message over 4 MiB
SESSION_LOST = 4010  # browser: its session was closed without it (taken for gone): join again

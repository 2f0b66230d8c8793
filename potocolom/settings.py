"""Settings: every setting of the contract (docs/protocol.md) has its default here and is
overridden by an environment variable of the same name; a bad value fails loudly at start."""
from __future__ import annotations

import hashlib
import os
import re
import warnings
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from potocolom.protocol.rungs import MEMORY_MODES
from potocolom.web.secret_key import secret_key_from_file

BASE_DIR = Path(__file__).resolve().parent.parent


def envstr(name: str, default: str | None) -> str | None:
    return os.environ.get(name) or default


def envint(name: str, default: int, *, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    return value


def envfloat(name: str, default: float, *, minimum: float = 0.0, maximum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None
    if not value > minimum:
        raise ImproperlyConfigured(f"{name} must be more than {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{name} must be at most {maximum:g}, got {value}")
    return value


def envbool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean, got {raw!r}")


def envlist(name: str, default: str) -> list[str]:
    """A comma-separated list (blanks dropped)."""
    return [item.strip() for item in (envstr(name, default) or "").split(",") if item.strip()]


DEBUG = envbool("DEBUG", False)
# Never a built-in key: unset, one is made at random at first start and kept (mode 0600).
SECRET_KEY_FILE = Path(envstr("SECRET_KEY_FILE", str(BASE_DIR / ".secret_key")) or "")
SECRET_KEY = envstr("SECRET_KEY", None) or secret_key_from_file(SECRET_KEY_FILE)
# Any other Host header answers 400 (Django's check; its test runner adds "testserver").
ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", "")

# HTTPS=true: served behind a TLS proxy that sets X-Forwarded-Proto (or by Daphne with TLS).
HTTPS = envbool("HTTPS", False)
HSTS_PRELOAD = envbool("HSTS_PRELOAD", False)
if HTTPS:
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = 31536000
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = HSTS_PRELOAD  # hard to undo once browsers ship the list: opt-in

# --- the contract's settings -------------------------------------------------------------------
JOB_DISPATCH_DEPTH = envint("JOB_DISPATCH_DEPTH", 2, minimum=1)
ACCOUNT_SESSION_LIMIT = envint("ACCOUNT_SESSION_LIMIT", 2, minimum=1)
ACCOUNT_SOCKET_LIMIT = envint("ACCOUNT_SOCKET_LIMIT", 20, minimum=1)  # open /ws/jobs/ sockets per account
ACCOUNT_JOB_LIMIT = envint("ACCOUNT_JOB_LIMIT", 200, minimum=1)  # unfinished jobs per account
SESSION_IDLE_SECONDS = envfloat("SESSION_IDLE_SECONDS", 60.0)
SESSION_SWEEP_SECONDS = envfloat("SESSION_SWEEP_SECONDS", 30.0)
FRAME_BUDGET_MS = envfloat("FRAME_BUDGET_MS", 500.0)
WORKER_HEARTBEAT_SECONDS = envfloat("WORKER_HEARTBEAT_SECONDS", 10.0)
# A v2 worker sends a running job's checkpoint this often (welcome.checkpoint_seconds): what the
# job resumes from if its worker dies. 0: never (a dead worker's jobs then restart from step 0).
JOB_CHECKPOINT_SECONDS = envint("JOB_CHECKPOINT_SECONDS", 10, minimum=0)
# v2: a job_progress preview at most every this many steps (0: none), sent in welcome as preview_steps
PREVIEW_STEPS = envint("PREVIEW_STEPS", 4, minimum=0)
# Retention (docs/operations.md, "Retention"): ended jobs finished more than this many days ago are
# purged with their files by a periodic run (0: kept forever; `manage.py purge_jobs` at any time),
# and a job paused more than PAUSED_CHECKPOINT_DAYS ago loses its checkpoint (0: kept while paused).
JOB_RETENTION_DAYS = envint("JOB_RETENTION_DAYS", 0, minimum=0)
PAUSED_CHECKPOINT_DAYS = envint("PAUSED_CHECKPOINT_DAYS", 7, minimum=0)
# Placement across workers (fleet.placement.driver): `demand` loads models where work waits and moves them
# as demand moves; `off` leaves every worker with what it preloaded.
PLACEMENT = envstr("PLACEMENT", "demand")
if PLACEMENT not in ("demand", "off"):
    raise ImproperlyConfigured(f"PLACEMENT must be demand or off, got {PLACEMENT!r}")
PLACEMENT_SECONDS = envfloat("PLACEMENT_SECONDS", 10.0)  # the long-queue and trend rules (copies, idle unloads)
PLACEMENT_TARGET_WAIT_SECONDS = envfloat("PLACEMENT_TARGET_WAIT_SECONDS", 30.0)
PLACEMENT_IDLE_SECONDS = envfloat("PLACEMENT_IDLE_SECONDS", 300.0)
PLACEMENT_MIN_RESIDENCY_SECONDS = envfloat("PLACEMENT_MIN_RESIDENCY_SECONDS", 60.0, minimum=-1.0)
PLACEMENT_FAILED_LOAD_BACKOFF_SECONDS = envfloat("PLACEMENT_FAILED_LOAD_BACKOFF_SECONDS", 60.0, minimum=-1.0)
# Beyond the contract's rules, for a latency target counted in a job's own run (bench/placement.py):
# the target wait in queued jobs' own runs (0: PLACEMENT_TARGET_WAIT_SECONDS alone), the trend
# rule's share (a copy more when a job would find every copy busy more often than this, for a model
# of the fleet's mean size, scaled by the model's size; 0: off),
# and the burst rule (a copy more at once when the last window's arrivals would keep every copy
# busier than the share; 0: off).
PLACEMENT_TARGET_WAIT_JOBS = envfloat("PLACEMENT_TARGET_WAIT_JOBS", 0.0, minimum=-1e-9)
PLACEMENT_COPY_BUSY_SHARE = envfloat("PLACEMENT_COPY_BUSY_SHARE", 0.4, minimum=-1e-9, maximum=1.0)
PLACEMENT_BURST_WINDOW_SECONDS = envfloat("PLACEMENT_BURST_WINDOW_SECONDS", 10.0)
PLACEMENT_BURST_BUSY_SHARE = envfloat("PLACEMENT_BURST_BUSY_SHARE", 0.95, minimum=-1e-9, maximum=1.0)
# ... and unloading spare copies on a rung more than twice as slow as full (group offload) while a
# full copy elsewhere carries their model's work: a job sent there is late by itself (off: the long-queue rule
# unloads only for another model's memory).
PLACEMENT_RETIRE_SLOW_COPIES = envbool("PLACEMENT_RETIRE_SLOW_COPIES", False)
MEMORY_MODE = envstr("MEMORY_MODE", "auto")
if MEMORY_MODE not in MEMORY_MODES:
    raise ImproperlyConfigured(f"MEMORY_MODE must be one of {', '.join(MEMORY_MODES)}, got {MEMORY_MODE!r}")
MODELS_DIR = envstr("MODELS_DIR", str(BASE_DIR / "models"))
REDIS_URL = envstr("REDIS_URL", None)
# Where queued jobs wait: "memory" (one API process owns them) or "redis" (shared by every API
# process on the same database; the default when REDIS_URL is set).
JOB_QUEUE = envstr("JOB_QUEUE", "redis" if REDIS_URL else "memory")
if JOB_QUEUE not in ("memory", "redis") or (JOB_QUEUE == "redis" and not REDIS_URL):
    raise ImproperlyConfigured(f"JOB_QUEUE must be memory, or redis with REDIS_URL set; got {JOB_QUEUE!r}")
# Rebuild the job queue from the database as the API process starts, not at the first worker's hello.
QUEUE_REBUILD_AT_START = envbool("QUEUE_REBUILD_AT_START", True)
# A served process finds dead workers itself (fleet/sweeper.py), whatever is connected to it;
# the test process, which imports potocolom.asgi without serving, switches it off.
DEAD_WORKER_SWEEP = envbool("DEAD_WORKER_SWEEP", True)
# A browser message over this closes the socket with 4009; worker messages carry whole images.
BROWSER_MESSAGE_MAX_BYTES = 4 * 1024 * 1024

# Webhooks (scheduling/webhooks/, docs/operations.md): attempts per event (backoff 1, 2, 4 ... s),
# each bounded by WEBHOOK_TIMEOUT_SECONDS; per API process at most WEBHOOK_CONCURRENCY at once per
# account and WEBHOOK_SENDERS in all, and at most WEBHOOK_LOOKUPS_PER_ACCOUNT host lookups per account
# (one more: 429). A host with an address that is not globally reachable is refused unless
# WEBHOOK_ALLOW_PRIVATE lets its loopback, private or link-local address through (a receiver on the
# same machine or network: development, tests); a public one may use ports 80, 443 and WEBHOOK_PORTS.
WEBHOOK_ATTEMPTS = envint("WEBHOOK_ATTEMPTS", 6, minimum=1)
WEBHOOK_TIMEOUT_SECONDS = envfloat("WEBHOOK_TIMEOUT_SECONDS", 10.0)
WEBHOOK_SENDERS = envint("WEBHOOK_SENDERS", 16, minimum=1)
WEBHOOK_CONCURRENCY = envint("WEBHOOK_CONCURRENCY", 2, minimum=1)
WEBHOOK_LOOKUPS_PER_ACCOUNT = envint("WEBHOOK_LOOKUPS_PER_ACCOUNT", 4, minimum=1)
WEBHOOK_ALLOW_PRIVATE = envbool("WEBHOOK_ALLOW_PRIVATE", False)
WEBHOOK_PORTS = [int(port) for port in envlist("WEBHOOK_PORTS", "") if port.isdigit() and 0 < int(port) < 65536]
if len(WEBHOOK_PORTS) != len(envlist("WEBHOOK_PORTS", "")):
    raise ImproperlyConfigured(f"WEBHOOK_PORTS must list ports (1 to 65535) separated by commas, "
                               f"got {envstr('WEBHOOK_PORTS', '')!r}")
# How webhook hosts are looked up: a callable (host, port) -> addresses, or its dotted path. Not an
# environment setting: the one seam where tests put a resolver of their own.
WEBHOOK_RESOLVER = "scheduling.webhooks.resolving.system_resolve"

# --- limits of what a client may send (docs/operations.md) ------------------------------------
JOB_SUBMIT_RATE = envstr("JOB_SUBMIT_RATE", "600/minute") or ""
if not re.fullmatch(r"[1-9][0-9]*/(s|sec|second|m|min|minute|h|hour|d|day)", JOB_SUBMIT_RATE):
    raise ImproperlyConfigured(f"JOB_SUBMIT_RATE must read like 600/minute (per second, minute, hour or day), "
                               f"got {JOB_SUBMIT_RATE!r}")
# A body over this answers 413 from its Content-Length, before anything reads it; Django's own cap agrees.
MAX_REQUEST_BYTES = envint("MAX_REQUEST_BYTES", 10 * 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES
# Threads serving HTTP requests in one API process (each holds one database connection).
HTTP_THREADS = envint("HTTP_THREADS", 8, minimum=1)
# Of them, how many one caller (a token, a session, an address) may hold at once, and how many more of
# its requests may wait for those without a thread; one more answers 429 `throttled`.
HTTP_THREADS_PER_CALLER = envint("HTTP_THREADS_PER_CALLER", max(1, HTTP_THREADS // 2), minimum=1)
HTTP_WAITING_PER_CALLER = envint("HTTP_WAITING_PER_CALLER", 64, minimum=0)
# How long a process keeps a REST token's account (0: read it on every request). A token revoked
# or a user deactivated through another process stops working within this.
TOKEN_FRESH_SECONDS = envfloat("TOKEN_FRESH_SECONDS", 1.0, minimum=-0.001, maximum=60.0)  # 0 allowed
MAX_IMAGE_PIXELS = envint("MAX_IMAGE_PIXELS", 4194304, minimum=1)
# Caps for a model whose params_schema sets no maximum of its own.
MAX_IMAGE_SIDE = envint("MAX_IMAGE_SIDE", 2048, minimum=8)
MAX_STEPS = envint("MAX_STEPS", 150, minimum=1)
LOGIN_FAILURE_LIMIT = envint("LOGIN_FAILURE_LIMIT", 10, minimum=1)  # per username (normalised) and address
LOGIN_ADDRESS_FAILURE_LIMIT = envint("LOGIN_ADDRESS_FAILURE_LIMIT", 50, minimum=1)  # per address, any usernames
LOGIN_FAILURE_SECONDS = 15 * 60  # the window the failures are counted in, and the lockout after them
# PostgreSQL's connect, statement and lock timeouts, and Redis's (0: none): waiting longer answers 503.
DATABASE_TIMEOUT_SECONDS = envint("DATABASE_TIMEOUT_SECONDS", 5, minimum=0)
# GET /metrics also answers `Authorization: Bearer <METRICS_TOKEN>` (a scraper); empty: staff only.
METRICS_TOKEN = envstr("METRICS_TOKEN", "") or ""

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files for /api/v1/docs/, served from this host
    "channels",
    "models_registry",
    "scheduling",
    "realtime",
    "workers",
    "fleet",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Serves /static/ (the drawing page's JS and the admin's files) straight from the apps' static
    # folders: no collectstatic, no build step, no separate file server.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Too many failed logins for one username and address, or from one address: 429 for a while.
    "potocolom.web.logins.LoginFailureMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # A lost database answers 503 (with Retry-After), not 500, until it is back.
    "potocolom.web.middleware.DatabaseUnavailableMiddleware",
]

ROOT_URLCONF = "potocolom.urls"
ASGI_APPLICATION = "potocolom.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Persistent connections without a health check: the check is a round trip before every request
# and consumer call (15% of an API process's time under load). A connection broken by a database
# restart fails its request (503) and is dropped at its end; the next request opens a new one.
DATABASES = {
    "default": dj_database_url.parse(
        envstr("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}") or "", conn_max_age=600,
        conn_health_checks=False,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Daphne's threads and the worker consumers write at once: wait for the lock instead of failing.
    # WAL with synchronous=NORMAL: a commit survives a crash of the process, with no fsync per commit.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE",
         "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"}
    )

if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql" and DATABASE_TIMEOUT_SECONDS:
    # A statement or lock wait past the timeout fails (OperationalError) and the request answers 503.
    milliseconds = DATABASE_TIMEOUT_SECONDS * 1000
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"connect_timeout": max(DATABASE_TIMEOUT_SECONDS, 2),  # libpq takes 2 s as its least
         "options": f"-c statement_timeout={milliseconds} -c lock_timeout={milliseconds}"}
    )

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Redis's timeouts: a connect waits DATABASE_TIMEOUT_SECONDS; a read as long, past the channel
# layer's own 5 s blocking pop (a shorter read timeout closes idle sockets, channels_redis issue 422).
REDIS_CONNECT_TIMEOUT = float(DATABASE_TIMEOUT_SECONDS) or None
REDIS_READ_TIMEOUT = 5.0 + DATABASE_TIMEOUT_SECONDS if DATABASE_TIMEOUT_SECONDS else None

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # redis-py 8's defaults close idle sockets after 5 s (code 1011) and cap the pool at 100
            # connections (channels_redis issue 422): no socket timeout, a larger pool.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": REDIS_READ_TIMEOUT,
                                  "socket_connect_timeout": REDIS_CONNECT_TIMEOUT, "max_connections": 1000}],
                       "capacity": 1000, "expiry": 60},
        }
    }
    # One cache for every API process: the job submission rate and login failures hold across them.
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            # Its keys name accounts by id: one namespace per database, so servers on other databases
            # sharing this Redis (tests, staging) never count each other's requests.
            "KEY_PREFIX": "potocolom:" + hashlib.sha256(
                f"{DATABASES['default'].get('HOST')}:{DATABASES['default'].get('PORT')}/"
                f"{DATABASES['default'].get('NAME')}".encode()).hexdigest()[:12],
            "OPTIONS": {"socket_timeout": REDIS_CONNECT_TIMEOUT, "socket_connect_timeout": REDIS_CONNECT_TIMEOUT},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer", "CONFIG": {"capacity": 1000}}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "potocolom"}}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "potocolom.web.tokens.KeptTokenAuthentication",  # DRF's, each token's account kept a second
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": [
        "potocolom.web.parsers.StrictJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # Only job submission is throttled (scheduling.throttles reads JOB_SUBMIT_RATE); the history
    # lives in Django's cache, shared by every API process when REDIS_URL is set.
    "DEFAULT_THROTTLE_RATES": {"job_submit": JOB_SUBMIT_RATE},
    "EXCEPTION_HANDLER": "potocolom.web.errors.api_exception_handler",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "potocolom API",
    "DESCRIPTION": "Image-generation jobs and realtime drawing sessions on shared GPU workers.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # /api/v1/docs/ (Swagger UI) loads its files from this host's /static/ (no CDN), and never asks
    # swagger.io's online validator about the schema
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": "none"},
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
WHITENOISE_USE_FINDERS = True
# STATIC_ROOT exists only after an optional collectstatic; the finders serve the files without it.
warnings.filterwarnings("ignore", message=r"No directory at: .*staticfiles")
MEDIA_URL = "/media/"
MEDIA_ROOT = Path(envstr("MEDIA_ROOT", str(BASE_DIR / "media")) or "")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": envstr("LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}

"""Deployment settings: what HTTPS, ALLOWED_HOSTS, timeouts and the generated SECRET_KEY turn
into, each read by a fresh process as a deployment would start; and `check --deploy` passing."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from potocolom.web.secret_key import secret_key_from_file

ROOT = Path(__file__).resolve().parents[2]
# Every setting a deployment may set: a test gives each process exactly the ones it names.
SETTINGS = ("DEBUG", "SECRET_KEY", "SECRET_KEY_FILE", "ALLOWED_HOSTS", "CSRF_TRUSTED_ORIGINS", "HTTPS",
            "HSTS_PRELOAD", "DATABASE_URL", "REDIS_URL", "JOB_QUEUE", "DATABASE_TIMEOUT_SECONDS", "JOB_SUBMIT_RATE",
            "MAX_REQUEST_BYTES")


def environment(tmp_path: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env.update({"DJANGO_SETTINGS_MODULE": "potocolom.settings", "QUEUE_REBUILD_AT_START": "0",
                "SECRET_KEY_FILE": str(tmp_path / "secret_key"), **settings})
    return env


def settings_of(tmp_path: Path, *names: str, **settings: str) -> dict:
    """The named settings as a freshly started process sees them."""
    script = ("import json, django; django.setup(); from django.conf import settings; "
              f"print(json.dumps({{n: getattr(settings, n, None) for n in {list(names)!r}}}, default=str))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment(tmp_path, **settings),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


DEPLOY = {"HTTPS": "true", "HSTS_PRELOAD": "true", "ALLOWED_HOSTS": "example.com", "DEBUG": "false"}


@pytest.mark.parametrize("secret_key", [None, "a-real-deployment-key-" + "k3y" * 12], ids=["generated", "given"])
def test_check_deploy_passes_behind_https(tmp_path, secret_key):
    settings = {**DEPLOY, **({"SECRET_KEY": secret_key} if secret_key else {})}

    done = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"], cwd=ROOT,
                          env=environment(tmp_path, **settings), capture_output=True, text=True, timeout=180)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout
    assert (tmp_path / "secret_key").exists() is (secret_key is None)


def test_https_turns_on_secure_cookies_hsts_and_the_proxy_header(tmp_path):
    seen = settings_of(tmp_path, "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_SSL_REDIRECT",
                       "SECURE_HSTS_SECONDS", "SECURE_HSTS_INCLUDE_SUBDOMAINS", "SECURE_HSTS_PRELOAD",
                       "SECURE_PROXY_SSL_HEADER", **DEPLOY)

    assert seen == {"SESSION_COOKIE_SECURE": True, "CSRF_COOKIE_SECURE": True, "SECURE_SSL_REDIRECT": True,
                    "SECURE_HSTS_SECONDS": 31536000, "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
                    "SECURE_HSTS_PRELOAD": True, "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"]}
    assert settings_of(tmp_path, "SECURE_HSTS_PRELOAD", HTTPS="true")["SECURE_HSTS_PRELOAD"] is False


def test_without_https_nothing_is_forced_and_hosts_are_the_local_ones(tmp_path):
    seen = settings_of(tmp_path, "SESSION_COOKIE_SECURE", "SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS",
                       "ALLOWED_HOSTS", "CSRF_TRUSTED_ORIGINS")

    assert seen == {"SESSION_COOKIE_SECURE": False, "SECURE_SSL_REDIRECT": False, "SECURE_HSTS_SECONDS": 0,
                    "ALLOWED_HOSTS": ["localhost", "127.0.0.1", "[::1]"], "CSRF_TRUSTED_ORIGINS": []}
    assert settings_of(tmp_path, "ALLOWED_HOSTS", "CSRF_TRUSTED_ORIGINS", ALLOWED_HOSTS="a.example, b.example",
                       CSRF_TRUSTED_ORIGINS="https://a.example") == {
        "ALLOWED_HOSTS": ["a.example", "b.example"], "CSRF_TRUSTED_ORIGINS": ["https://a.example"]}


def test_postgresql_gets_connect_statement_and_lock_timeouts(tmp_path):
    url = "postgres://someone@db.invalid:5432/somewhere"  # settings only: nothing connects

    options = settings_of(tmp_path, "DATABASES", DATABASE_URL=url)["DATABASES"]["default"]["OPTIONS"]
    assert options == {"connect_timeout": 5, "options": "-c statement_timeout=5000 -c lock_timeout=5000"}
    options = settings_of(tmp_path, "DATABASES", DATABASE_URL=url, DATABASE_TIMEOUT_SECONDS="12")
    assert options["DATABASES"]["default"]["OPTIONS"]["options"] == "-c statement_timeout=12000 -c lock_timeout=12000"
    assert not settings_of(tmp_path, "DATABASES", DATABASE_URL=url,
                           DATABASE_TIMEOUT_SECONDS="0")["DATABASES"]["default"]["OPTIONS"]


def test_redis_gets_timeouts_and_a_shared_cache(tmp_path):
    seen = settings_of(tmp_path, "CACHES", "CHANNEL_LAYERS", REDIS_URL="redis://127.0.0.1:6379/11")

    cache = seen["CACHES"]["default"]
    assert cache["BACKEND"] == "django.core.cache.backends.redis.RedisCache"
    assert cache["OPTIONS"] == {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
    [host] = seen["CHANNEL_LAYERS"]["default"]["CONFIG"]["hosts"]
    # the read timeout outlasts the layer's own 5 s blocking pop, or idle sockets close (1011)
    assert (host["socket_connect_timeout"], host["socket_timeout"]) == (5.0, 10.0)
    local = settings_of(tmp_path, "CACHES")["CACHES"]["default"]
    assert local["BACKEND"] == "django.core.cache.backends.locmem.LocMemCache"


def test_django_s_own_body_cap_agrees_with_max_request_bytes(tmp_path):
    assert settings_of(tmp_path, "MAX_REQUEST_BYTES", "DATA_UPLOAD_MAX_MEMORY_SIZE", MAX_REQUEST_BYTES="5000") == {
        "MAX_REQUEST_BYTES": 5000, "DATA_UPLOAD_MAX_MEMORY_SIZE": 5000}


def test_webhook_ports_are_none_but_80_and_443_unless_listed(tmp_path):
    names = ("WEBHOOK_PORTS", "WEBHOOK_CONCURRENCY", "WEBHOOK_LOOKUPS_PER_ACCOUNT", "WEBHOOK_SENDERS")
    assert settings_of(tmp_path, *names) == {"WEBHOOK_PORTS": [], "WEBHOOK_CONCURRENCY": 2,
                                             "WEBHOOK_LOOKUPS_PER_ACCOUNT": 4, "WEBHOOK_SENDERS": 16}
    assert settings_of(tmp_path, "WEBHOOK_PORTS", WEBHOOK_PORTS="8443, 9000") == {"WEBHOOK_PORTS": [8443, 9000]}


@pytest.mark.parametrize(("name", "value"), [("JOB_SUBMIT_RATE", "600/fortnight"), ("JOB_SUBMIT_RATE", "lots"),
                                             ("MAX_REQUEST_BYTES", "ten"), ("HTTPS", "maybe"),
                                             ("WEBHOOK_PORTS", "8443,ssh"), ("WEBHOOK_PORTS", "70000")])
def test_a_bad_setting_fails_at_start(tmp_path, name, value):
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT,
                          env=environment(tmp_path, **{name: value}), capture_output=True, text=True, timeout=120)

    assert done.returncode != 0 and name in done.stderr


def test_a_generated_key_is_private_and_kept(tmp_path):
    path = tmp_path / "key"

    key = secret_key_from_file(path)

    assert len(key) >= 50 and len(set(key)) >= 5
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert secret_key_from_file(path) == key
    assert secret_key_from_file(tmp_path / "another") != key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["another", "key"]  # no temporary file left


def test_processes_starting_at_once_agree_on_one_key(tmp_path):
    path = tmp_path / "key"
    script = ("import sys; from pathlib import Path; from potocolom.web.secret_key import secret_key_from_file; "
              "print(secret_key_from_file(Path(sys.argv[1])))")
    processes = [subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                                  text=True) for _ in range(6)]

    keys = {process.communicate(timeout=60)[0].strip() for process in processes}

    assert keys == {path.read_text().strip()}


def test_a_key_file_without_a_usable_key_fails_loudly(tmp_path):
    from django.core.exceptions import ImproperlyConfigured

    path = tmp_path / "key"
    path.write_text("short\n")

    with pytest.raises(ImproperlyConfigured, match="no usable key"):
        secret_key_from_file(path)


@pytest.mark.django_db
@pytest.mark.parametrize(("host", "status"), [("127.0.0.1:8000", 200), ("localhost", 200), ("[::1]:8000", 200),
                                              ("evil.example", 400)])
def test_another_host_header_answers_400(client, host, status):
    assert client.get("/api/v1/", HTTP_HOST=host).status_code == status

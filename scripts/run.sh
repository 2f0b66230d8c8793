#!/usr/bin/env bash
# `make run`: migrate, make the tiny model, register it, make a demo account and a worker token, then
# run the API (Daphne on 127.0.0.1:8000) and one CPU worker beside it. Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
MODELS_DIR=${MODELS_DIR:-models}
export MODELS_DIR

last() { tail -n 1; }

$PY manage.py migrate --noinput >/dev/null
if [ ! -f "$MODELS_DIR/tiny-sd/manifest.json" ]; then
    echo "making the tiny model in $MODELS_DIR/tiny-sd ..."
    $PY manage.py make_tiny_model "$MODELS_DIR/tiny-sd" >/dev/null
fi
$PY manage.py load_manifests "$MODELS_DIR"/*/manifest.json | last
# Passwords must pass Django's validators: fresh random ones at each start (or DEMO_PASSWORD/ADMIN_PASSWORD).
new_password() { $PY -c 'import secrets; print(secrets.token_urlsafe(12))'; }
demo_password=${DEMO_PASSWORD:-$(new_password)}
admin_password=${ADMIN_PASSWORD:-$(new_password)}
api_token=$($PY manage.py create_account demo --password="$demo_password" | last)
$PY manage.py create_account admin --password="$admin_password" --staff >/dev/null
worker_token=$($PY manage.py create_worker_token local-cpu-worker | last)

pids=()
stop() { trap - INT TERM EXIT; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop INT TERM EXIT

.venv/bin/daphne -b "$HOST" -p "$PORT" --websocket-max-message-size 16777216 \
    --websocket-max-frame-size 16777216 potocolom.asgi:application &
pids+=($!)
$PY manage.py runworker_gpu --api "ws://$HOST:$PORT" --token "$worker_token" --device cpu \
    --models-dir "$MODELS_DIR" &
pids+=($!)

cat <<MSG

potocolom is running at http://$HOST:$PORT/
  drawing page and login: http://$HOST:$PORT/   (demo / $demo_password)
  admin:                  http://$HOST:$PORT/admin/   (admin / $admin_password)
  API token of demo:      $api_token
  try: curl -s -H "Authorization: Token $api_token" -H 'Content-Type: application/json' \\
         -d '{"params": {"prompt": "a red circle", "width": 64, "height": 64, "steps": 4, "seed": 1}}' \\
         http://$HOST:$PORT/api/v1/jobs/
Ctrl-C stops the API and the worker.
MSG
wait -n "${pids[@]}"

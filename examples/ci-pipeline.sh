#!/usr/bin/env bash
# A CI step gated on training jobs: submit over HTTP, wait, and fail the step unless the job
# succeeded. Twice: with curl alone (any machine), and with `trainq submit --wait`.
#
#   TRAINQ_URL=http://trainq.internal:8000 TRAINQ_TOKEN=tq_... examples/ci-pipeline.sh SPEC
#
# `trainq submit --wait` exit codes: 0 succeeded, 1 failed, 2 bad usage, 3 cancelled,
# 4 timed out, 5 service unreachable/unavailable, 6 refused by the API (401/404/422...).
set -euo pipefail

SPEC=${1:-examples/tiny-ddp.yaml}
URL=${TRAINQ_URL:-http://127.0.0.1:8000}
# One key per pipeline run: a retried CI step finds its job instead of submitting another.
KEY=${CI_RUN_ID:-local-$(date +%s)}-$(basename "$SPEC" .yaml)
AUTH=()
if [ -n "${TRAINQ_TOKEN:-}" ]; then AUTH=(-H "Authorization: Bearer $TRAINQ_TOKEN"); fi
field() { python3 -c 'import json, sys; print(json.load(sys.stdin).get(sys.argv[1]) or "")' "$1"; }

echo "== curl: submit $SPEC"
job=$(curl -fsS "${AUTH[@]}" -X POST "$URL/v1/jobs" \
  -H 'Content-Type: application/yaml' -H "Idempotency-Key: $KEY-curl" --data-binary @"$SPEC")
id=$(field id <<<"$job")
echo "job $id: $URL/v1/jobs/$id"
deadline=$(( $(date +%s) + ${WAIT_S:-3600} ))
while :; do
  status=$(curl -fsS "${AUTH[@]}" "$URL/v1/jobs/$id" | field status)
  case "$status" in
    succeeded) echo "job $id succeeded"; break ;;
    failed|cancelled) echo "job $id $status" >&2; exit 1 ;;
  esac
  if [ "$(date +%s)" -gt "$deadline" ]; then echo "job $id still $status; giving up" >&2; exit 4; fi
  sleep 2
done

echo "== trainq submit --wait"
set +e
TRAINQ_URL=$URL trainq submit "$SPEC" --wait --idempotency-key "$KEY-cli"
code=$?
set -e
case $code in
  0) echo "gate passed" ;;
  3) echo "the job was cancelled" >&2 ;;
  5) echo "trainq is unreachable; is the service up?" >&2 ;;
  *) echo "the job did not succeed (exit $code)" >&2 ;;
esac
exit $code

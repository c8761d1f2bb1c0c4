#!/bin/sh
# Installs what strata's build and tests need on a Debian machine, once; quiet when all is there.
# Needs: a Rust toolchain (cargo, rustfmt, clippy), Python 3 with pip, a C compiler; for the
# real-client tests nginx and the pinned `openai` SDK (in a venv inside the strata cache); npm
# for the one test fixture that ships as an npm package.
set -eu

OPENAI_VERSION=3.51.0
PYYAML_VERSION=6.0.3
cache="${STRATA_CACHE:-$HOME/.cache/strata}"
clients_venv="$cache/clients-venv"

missing=""
command -v python3 >/dev/null 2>&1 || missing="$missing python3"
python3 -m pip --version >/dev/null 2>&1 || missing="$missing python3-pip"
python3 -m venv --help >/dev/null 2>&1 || missing="$missing python3-venv"
command -v cc >/dev/null 2>&1 || missing="$missing build-essential"
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$missing nginx"
# npm's own client fetches the pinned Llama-3 tokenizer package (scripts/fetch.py llama3-tokenizer).
command -v npm >/dev/null 2>&1 || missing="$missing npm"
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Debian packages:$missing"
        # Install without starting services: the tests run their own nginx on a free port.
        no_start=""
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
            no_start=1
        fi
        status=0
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null; } || status=$?
        [ -z "$no_start" ] || rm -f /usr/sbin/policy-rc.d
        [ "$status" = 0 ] || exit "$status"
    else
        echo "setup: missing$missing; install them (Debian: sudo apt-get install$missing) and rerun" >&2
        exit 1
    fi
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo not found; install a Rust toolchain (rustup) and rerun" >&2
    exit 1
fi
for comp in rustfmt clippy; do
    if ! cargo "$( [ $comp = rustfmt ] && echo fmt || echo clippy )" --version >/dev/null 2>&1; then
        if command -v rustup >/dev/null 2>&1; then
            rustup component add "$comp"
        else
            echo "setup: cargo $comp is missing; install the $comp component and rerun" >&2
            exit 1
        fi
    fi
done
# The official openai SDK, pinned, for the real-client tests (tests/clients/real_clients.py), and
# PyYAML for the deployment checks (tests/deploy/check_deploy.py).
if ! "$clients_venv/bin/python" -c "import openai, yaml, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION' or yaml.__version__ != '$PYYAML_VERSION')" >/dev/null 2>&1; then
    echo "setup: installing openai==$OPENAI_VERSION pyyaml==$PYYAML_VERSION into $clients_venv"
    python3 -m venv "$clients_venv"
    "$clients_venv/bin/python" -m pip install -q --disable-pip-version-check "openai==$OPENAI_VERSION" "pyyaml==$PYYAML_VERSION"
fi

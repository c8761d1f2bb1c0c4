#!/bin/sh
# Installs what strata's build and tests need on a Debian machine, once; quiet when all is there.
# Needs: a Rust toolchain (cargo, rustfmt, clippy), Python 3 with pip, a C compiler.
set -eu

missing=""
command -v python3 >/dev/null 2>&1 || missing="$missing python3"
python3 -m pip --version >/dev/null 2>&1 || missing="$missing python3-pip"
command -v cc >/dev/null 2>&1 || missing="$missing build-essential"
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Debian packages:$missing"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
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

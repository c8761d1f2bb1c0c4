# syntax=docker/dockerfile:1
# strata in a container. Two images from one build stage:
#   docker build -t strata .                       CPU: `strata serve` on the default model, port 8000
#   docker build --target cuda -t strata:cuda .    NVIDIA GPUs: run with `--gpus all` (NVIDIA's
#                                                  container toolkit brings the driver from the host)
# The default model is fetched at first start into /var/cache/strata (mount a volume there to keep it
# and the compiled CUDA kernels); serve your own with `-v /srv/models:/models:ro ... --model /models/M`.
# Compose, nginx, Prometheus and Grafana: deploy/compose.yaml. See README.md, "Deployment".

# ---- build: the release binary. cudarc loads every CUDA library at run time, so no CUDA here.
FROM rust:1.95-slim-trixie AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates ./crates
# `cuda` is also a default feature of strata-cli: the CPU image carries the same binary, which falls
# back to the CPU (and says why) when no driver answers. Debug info is dropped, symbols are kept.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p strata-cli --features cuda \
    && strip --strip-debug -o /usr/local/bin/strata target/release/strata

# ---- cuda-libs: NVRTC, cuBLAS(Lt) and NCCL from their hash-pinned wheels, only the .so files.
FROM python:3.13-slim-trixie AS cuda-libs
COPY deploy/install-cuda-libs.sh deploy/cuda-requirements.txt /tmp/
RUN sh /tmp/install-cuda-libs.sh /opt/strata/cuda/lib /tmp/cuda-requirements.txt

# ---- runtime: what both images share. Python runs scripts/fetch.py (the pinned default model, via
# pip) at first start and the health check; nothing else is installed.
FROM python:3.13-slim-trixie AS runtime
RUN useradd --system --uid 10001 --user-group --home-dir /var/cache/strata --shell /usr/sbin/nologin strata \
    && install -d -o strata -g strata -m 0750 /var/cache/strata
COPY --from=build /usr/local/bin/strata /usr/local/bin/strata
COPY scripts/fetch.py deploy/healthcheck.py /opt/strata/
COPY --chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/strata-entrypoint
ENV STRATA_CACHE=/var/cache/strata \
    STRATA_HOST=0.0.0.0 \
    STRATA_PORT=8000 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
USER strata
WORKDIR /var/cache/strata
EXPOSE 8000
# A first start downloads the default model (98 MB) and, on a GPU, compiles the kernels: minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "/opt/strata/healthcheck.py"]
ENTRYPOINT ["/usr/local/bin/strata-entrypoint"]
CMD []

# ---- cuda: the runtime plus the CUDA libraries, found through LD_LIBRARY_PATH (strata adds the
# driver's folder itself and re-executes once). Needs a driver for CUDA 13 (580 or later) on the host.
FROM runtime AS cuda
COPY --from=cuda-libs /opt/strata/cuda/lib/ /opt/strata/cuda/lib/
ENV LD_LIBRARY_PATH=/opt/strata/cuda/lib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# ---- cpu (the default target, last): the runtime as it is.
FROM runtime AS cpu

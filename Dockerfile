# syntax=docker/dockerfile:1
# The tokenonce image for builders with a registry (docker build / podman build): a Rust
# builder stage, then a slim Debian bookworm runtime with libssl3 and ca-certificates, run as a
# non-root user, serving the embedded default config when given no arguments. The same layout
# is built here from Debian packages alone by tests/image/build.sh (docs/container.md).

ARG RUST_VERSION=1.95
ARG DEBIAN_SUITE=bookworm

FROM docker.io/library/rust:${RUST_VERSION}-slim-${DEBIAN_SUITE} AS build
# cmake builds pingora's zlib-ng; pkg-config finds Debian's OpenSSL (.cargo/config.toml sets
# OPENSSL_NO_VENDOR=1, so openssl-sys links libssl3 instead of building OpenSSL).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake make pkg-config libssl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The commit `tokenonce --version` reports (the context has no .git), seen by build.rs as an
# environment variable: --build-arg TOKENONCE_BUILD_COMMIT=$(git rev-parse --short=12 HEAD).
# DL3064 reads "TOKEN" in the name as a secret; it is a public commit id.
# hadolint ignore=DL3064
ARG TOKENONCE_BUILD_COMMIT=""
# No debug info: a smaller binary and a shorter build (panics still name their functions).
ENV CARGO_PROFILE_RELEASE_DEBUG=0
# The cache mounts keep crates and compiled dependencies between builds; the binary is copied
# out of the cached target dir in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin tokenonce \
 && install -D -m 0755 target/release/tokenonce /out/tokenonce

FROM docker.io/library/debian:${DEBIAN_SUITE}-slim
# libssl3: the binary links Debian's OpenSSL; ca-certificates: TLS to engines and trace
# collectors. Unpinned on purpose: a bookworm point release replaces these versions (security
# fixes), and a pinned version that left the archive would break the build.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libssl3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 tokenonce \
 && useradd --system --uid 10001 --gid tokenonce --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tokenonce
COPY --from=build /out/tokenonce /usr/local/bin/tokenonce
# A copy of the embedded default, to read, check or start a mounted config from.
COPY conf/default.toml /etc/tokenonce/tokenonce.toml
LABEL org.opencontainers.image.title="tokenonce" \
      org.opencontainers.image.description="A P/D sidecar reverse proxy for vLLM that tokenizes each prompt once" \
      org.opencontainers.image.licenses="Apache-2.0"
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
# 8000: the API listener; 9000: admin (/metrics, /healthz, /readyz). The embedded default binds
# admin to 127.0.0.1 inside the container: mount a config with admin_listen = "0.0.0.0:9000"
# to reach it from outside. No HEALTHCHECK: the image has no HTTP client, and Kubernetes
# probes /healthz and /readyz itself.
EXPOSE 8000 9000
ENTRYPOINT ["/usr/local/bin/tokenonce"]

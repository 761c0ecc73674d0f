# One image for every fleet role that runs our code (worker, reconciler, web UI,
# schedule-lineage CLI), plus two small side targets built from the same file:
#   flower   the app image plus Flower (not a project dependency, so only here)
#   git-ssh  sshd + git-shell serving the shared bare repository to other hosts
# docker-compose.yml picks the target per service.
#
# Build from a clean checkout and tell the image which commit it holds: an
# installed wheel is not a git checkout, and `schedule-lineage init` refuses to
# record a lineage without the exact commit of the instrument it ran under.
#   docker compose build --build-arg OUROBOROS_INSTRUMENT_COMMIT=$(git rev-parse HEAD)
# (deploy/compose/build.sh does that and refuses a dirty tree).
#
# No `# syntax=` line: it makes the builder fetch its Dockerfile frontend from a
# registry, so every build fails on a host without one; the frontend built into
# BuildKit handles everything here (COPY --chmod, RUN --mount).
#
# pip trusts the CA bundle passed as the build secret `build-ca` when one is
# given (deploy/compose/no-registry.yml passes the build host's: egress proxies
# that re-sign TLS). A secret mount never lands in a layer; without it (the
# default) pip uses its own bundle.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG DEBIAN_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base

# Each process keeps the fleet's bytecode in its user's private, checked cache
# (~/.cache/ouroboros-fleet/pycache, see worker/__init__.py), never in site-packages.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# bubblewrap + emacs-nox: the sandbox and the organism's interpreter.
# git + openssh-client: the shared lineage repository (path, file:// or ssh://).
# util-linux (setpriv, mount) is Essential in Debian and already present.
# libseccomp2: the library the worker compiles each life's syscall filter with.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      bubblewrap emacs-nox git openssh-client ca-certificates libseccomp2 \
 && rm -rf /var/lib/apt/lists/*

# A fixed uid/gid shared with the git-ssh target, so that the bare repository on
# the shared volume has one owner whichever container pushes to it (git refuses
# repositories owned by someone else: safe.directory).
RUN groupadd --system --gid 10001 ouroboros \
 && useradd --system --uid 10001 --gid ouroboros --home-dir /var/lib/ouroboros \
      --create-home --shell /usr/sbin/nologin ouroboros \
 && install -d -o ouroboros -g ouroboros -m 0750 /srv/git /var/lib/ouroboros

# The dependencies first, in a layer keyed on pyproject.toml alone: a change to the
# code rebuilds only the package's own small layer below, not this one.
COPY pyproject.toml /src/pyproject.toml
RUN --mount=type=secret,id=build-ca,required=false \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
 && python -c 'import tomllib; print("\n".join(tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]))' \
      >/tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm -rf /tmp/requirements.txt /src

COPY . /src
RUN --mount=type=secret,id=build-ca,required=false \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
 && pip install /src && rm -rf /src

ARG OUROBOROS_INSTRUMENT_COMMIT=""
ENV OUROBOROS_INSTRUMENT_COMMIT=${OUROBOROS_INSTRUMENT_COMMIT}
LABEL org.opencontainers.image.title="ouroboros-fleet" \
      org.opencontainers.image.revision="${OUROBOROS_INSTRUMENT_COMMIT}"

COPY --chmod=0755 deploy/docker/worker-entrypoint.sh /usr/local/libexec/ouroboros/worker-entrypoint.sh

# Everything but the worker runs unprivileged as-is. The worker service starts
# as root only to make its cgroup subtree writable, then drops to this user
# (deploy/docker/worker-entrypoint.sh).
USER ouroboros
WORKDIR /var/lib/ouroboros

# ---------------------------------------------------------------------------
# Flower runs `celery -A worker flower`: it imports our Celery app (JSON-only
# serializers, our queues, the visibility timeout) with exactly our celery and
# kombu versions, which the official mher/flower image (broker URL only) cannot
# promise. A side target keeps Flower and its web stack out of the worker image.
FROM base AS flower
USER root
RUN --mount=type=secret,id=build-ca,required=false \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
 && pip install "flower>=2.0,<3"
USER ouroboros

# ---------------------------------------------------------------------------
FROM ${DEBIAN_IMAGE} AS git-ssh
LABEL org.opencontainers.image.title="ouroboros-git-ssh"
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      openssh-server git \
 && rm -rf /var/lib/apt/lists/* \
 && rm -f /etc/ssh/ssh_host_*
# Same uid/gid as the app image's ouroboros user (see above). The login shell is
# git-shell: push and fetch only, no command execution. The password field is
# '*' (no password, not locked) because sshd refuses key logins to locked accounts.
RUN groupadd --system --gid 10001 git \
 && useradd --system --uid 10001 --gid git --home-dir /srv/git \
      --no-create-home --shell /usr/bin/git-shell git \
 && usermod -p '*' git \
 && install -d -o git -g git -m 0750 /srv/git \
 && install -d -m 0755 /run/sshd /etc/ssh/keys
COPY deploy/compose/git-ssh/sshd_config /etc/ssh/sshd_config
COPY --chmod=0755 deploy/compose/git-ssh/authorized-keys.sh /usr/local/libexec/git-authorized-keys
COPY --chmod=0755 deploy/compose/git-ssh/entrypoint.sh /usr/local/libexec/git-ssh-entrypoint
EXPOSE 22
ENTRYPOINT ["/usr/local/libexec/git-ssh-entrypoint"]

# ---------------------------------------------------------------------------
# The default target (last stage): the app image.
FROM base AS app

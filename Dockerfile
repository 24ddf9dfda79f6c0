# The deferral image: every service and the `deferral` command. Built by compose.yaml; the build
# context is this repository (.dockerignore keeps .env, the venv and caches out of it).
# The base is pinned to a release (a rebuild gets the same Python and Debian); bump it on purpose.
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Services run as this user, never as root (the uid matches on every host for mounted DAGs).
RUN useradd --create-home --uid 50000 --user-group deferral

# Every dependency at the version the release was tested with (constraints.txt); the file stays
# in the image, so that an image extending this one adds its packages under the same pins
# (docker/Dockerfile.extend).
COPY constraints.txt /opt/deferral/constraints.txt
COPY . /opt/deferral/src
# The version `deferral --version` and deferral_build_info report comes from git (setuptools-scm),
# and the build context has no git data: pass it, as
# `--build-arg DEFERRAL_VERSION=$(python -m setuptools_scm)`; without it the image says 0.0.
ARG DEFERRAL_VERSION=
RUN SETUPTOOLS_SCM_PRETEND_VERSION_FOR_DEFERRAL="$DEFERRAL_VERSION" \
    pip install -c /opt/deferral/constraints.txt /opt/deferral/src && rm -rf /opt/deferral/src

USER deferral
WORKDIR /home/deferral
# compose.yaml names each service's command: `scheduler consume`, `worker consume`, ...
CMD ["deferral", "--help"]

# The deferral image: every service and the `deferral` command. Built by compose.yaml; the build
# context is this repository (.dockerignore keeps .env, the venv and caches out of it).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Services run as this user, never as root (the uid matches on every host for mounted DAGs).
RUN useradd --create-home --uid 50000 --user-group deferral

COPY . /opt/deferral/src
RUN pip install /opt/deferral/src && rm -rf /opt/deferral/src

USER deferral
WORKDIR /home/deferral
# compose.yaml names each service's command: `scheduler consume`, `worker consume`, ...
CMD ["deferral", "--help"]

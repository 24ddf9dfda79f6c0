"""The web UI (``deferral webserver``): server-rendered pages and a JSON API over what
Postgres and Redis hold, and the user actions of the ``deferral`` command behind a login."""

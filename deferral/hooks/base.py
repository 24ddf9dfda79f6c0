"""``BaseHook``: the base class of user hooks, as Airflow's ``airflow.hooks.base.BaseHook``."""

from __future__ import annotations

import logging
from typing import Any

from deferral.connections import Connection


class BaseHook:
    """Subclass it for a client of an external system; read its settings from a connection::

    class WarehouseHook(BaseHook):
        conn_name_attr = "warehouse_conn_id"
        default_conn_name = "warehouse_default"
        conn_type = "postgres"
        hook_name = "Warehouse"

        def __init__(self, warehouse_conn_id: str = default_conn_name) -> None:
            super().__init__()
            self.warehouse_conn_id = warehouse_conn_id

        def get_conn(self):
            conn = self.get_connection(self.warehouse_conn_id)
            return connect(host=conn.host, user=conn.login, password=conn.password)
    """

    conn_name_attr: str = ""
    default_conn_name: str = ""
    conn_type: str = ""
    hook_name: str = ""

    def __init__(self, logger_name: str | None = None) -> None:
        cls = type(self)
        self.log = logging.getLogger(logger_name or f"{cls.__module__}.{cls.__qualname__}")

    @classmethod
    def get_connection(cls, conn_id: str) -> Connection:
        """The connection ``conn_id``: ``DEFERRAL_CONN_<CONN_ID>`` first, then the table.
        Raises ``deferral.connections.ConnectionNotFound`` naming it when neither has it."""
        conn = Connection.get_connection_from_secrets(conn_id)
        logging.getLogger(__name__).info("Using connection ID '%s' for task execution.", conn_id)
        return conn

    def get_conn(self) -> Any:
        """The client object of this hook's system."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_conn()")

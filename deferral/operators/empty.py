"""EmptyOperator."""

from __future__ import annotations

from deferral.baseoperator import BaseOperator
from deferral.context import Context


class EmptyOperator(BaseOperator):
    """Does nothing; useful to shape a graph."""

    def execute(self, context: Context) -> None:
        return None

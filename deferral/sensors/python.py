"""PythonSensor (Airflow's ``airflow.sensors.python``)."""

from __future__ import annotations

from deferral.context import Context
from deferral.operators.python import PythonCallableMixin
from deferral.sensors.base import BaseSensorOperator, PokeReturnValue


class PythonSensor(PythonCallableMixin, BaseSensorOperator):
    """Pokes ``python_callable(*op_args, **op_kwargs)`` (plus the context entries its signature
    names, ``templates_dict`` among them) until it returns something true, or a
    ``PokeReturnValue`` that is done (its ``xcom_value`` becomes the sensor's value)."""

    def poke(self, context: Context) -> bool | PokeReturnValue:
        result = self.call_python_callable(context)
        return result if isinstance(result, PokeReturnValue) else bool(result)

"""Tasks that run in another Python: a virtualenv made for the task (``@task.virtualenv``,
PythonVirtualenvOperator) and an existing interpreter (ExternalPythonOperator). The function's
source runs there, so it imports what it uses inside its body; its arguments and return value
travel as pickles. ``requirements`` would be installed with pip; this example asks for none, so
it runs offline. An alert goes to ``email`` if a task fails, once ``DEFERRAL_SMTP_HOST`` is set.
"""

from __future__ import annotations

import sys

from deferral import DAG, task
from deferral.operators.python import ExternalPythonOperator, PythonVirtualenvOperator


def report(ds: str, rows: int) -> str:
    import platform

    return f"{rows} rows on {ds}, counted by Python {platform.python_version()}"


with DAG(
    "example_virtualenv",
    schedule=None,
    default_args={"email": ["data-team@example.com"], "email_on_retry": False},
    doc_md=__doc__,
) as dag:

    @task.virtualenv(requirements=[], system_site_packages=True)
    def count_rows() -> int:
        import csv
        import io

        table = io.StringIO("id,amount\n1,10\n2,32\n")
        return sum(1 for _ in csv.DictReader(table))

    rows = count_rows()
    in_a_virtualenv = PythonVirtualenvOperator(
        task_id="report_in_a_virtualenv", python_callable=report, op_kwargs={"rows": rows}
    )
    with_this_python = ExternalPythonOperator(
        task_id="report_with_this_python",
        python=sys.executable,
        python_callable=report,
        op_kwargs={"rows": rows},
    )

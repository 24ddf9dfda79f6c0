"""BashOperator: the last line of output is the task's XCom; exit code 99 skips the task; the
command runs in its own process group, stopped as a whole if it outlives its execution_timeout.
"""

from __future__ import annotations

import datetime as dt

from deferral import DAG
from deferral.operators import BashOperator, PythonOperator


def show(ti: object) -> str:
    line = ti.xcom_pull(task_ids="count_files")  # type: ignore[attr-defined]
    print(f"the command said: {line}")
    return str(line)


with DAG("example_bash", schedule=None) as dag:
    count = BashOperator(
        task_id="count_files",
        bash_command='echo "run $DEFERRAL_CTX_DAG_RUN_ID"; ls "$TARGET" | wc -l',
        env={"TARGET": "/"},
        append_env=True,
        execution_timeout=dt.timedelta(minutes=1),
    )
    count >> PythonOperator(task_id="show", python_callable=show)
    BashOperator(task_id="nothing_to_do", bash_command="echo 'no new files'; exit 99")

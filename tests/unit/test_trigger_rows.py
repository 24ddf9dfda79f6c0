"""broker.trigger_rows.spec_check: a trigger spec runs only when its trigger row in PostgreSQL
confirms its classpath, task instance and try; a spec nobody waits on is stale, not refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from broker.streams import TriggerSpec
from broker.trigger_rows import RUN, TriggerRow, spec_check

CLASSPATH = "deferral.triggers.temporal.DateTimeTrigger"
SPEC = TriggerSpec(7, CLASSPATH, {}, 3, "d.r.t", 2)
# The row of a trigger its task (3, at try 2) defers on, unshared.
ROW = TriggerRow(CLASSPATH, False, True, "d.r.t", 2, True)


@pytest.mark.parametrize(
    ("spec", "row", "refused"),
    [
        (SPEC, ROW, None),
        (TriggerSpec(7, CLASSPATH, {}, 3, "d.r.t", 0), ROW, None),  # written before tries
        (
            TriggerSpec(7, "deferral.triggers.file.FileTrigger", {}, 3, "d.r.t", 2),
            ROW,
            "classpath check: 'deferral.triggers.file.FileTrigger' is not trigger 7's"
            f" ({CLASSPATH!r})",
        ),
        (
            TriggerSpec(7, CLASSPATH, {}, 3, "d.r.other", 2),
            ROW,
            "task check: task instance 3 is 'd.r.t', not 'd.r.other'",
        ),
        (
            SPEC,
            replace(ROW, task=None),
            "task check: no task instance 3",
        ),
        (
            SPEC,
            replace(ROW, deferred_on_it=False),
            "task check: task instance 3 does not wait on trigger 7",
        ),
        (
            TriggerSpec(7, CLASSPATH, {}, 3, "d.r.t", 1),
            ROW,
            "try check: task instance 3 deferred on trigger 7 in try 2, not 1",
        ),
        (
            TriggerSpec(7, CLASSPATH, {}, 3, "d.r.t", 5),
            ROW,
            "try check: task instance 3 is at try 2, not 5",
        ),
        # A shared trigger: whoever it was started for may have moved on; others wait on it.
        (SPEC, replace(ROW, shared=True, deferred_on_it=False), None),
        (SPEC, replace(ROW, shared=True, task=None, deferred_on_it=False), None),
        (TriggerSpec(7, CLASSPATH, {}, 3, "d.r.t", 1), replace(ROW, shared=True), None),
        (
            TriggerSpec(7, CLASSPATH, {}, 3, "d.r.t", 3),
            replace(ROW, shared=True),
            "try check: task instance 3 is at try 2, not 3",
        ),
    ],
)
def test_what_the_row_confirms_runs_and_the_rest_names_the_failed_check(
    spec: TriggerSpec, row: TriggerRow, refused: str | None
) -> None:
    verdict = spec_check(spec, row)
    assert verdict.refused == refused
    assert verdict.stale is None
    if refused is None:
        assert verdict == RUN


@pytest.mark.parametrize(
    "row",
    [
        replace(ROW, classpath=None, waited_on=False, deferred_on_it=False),  # no trigger row
        replace(ROW, waited_on=False, deferred_on_it=False),  # nobody defers on it any more
    ],
)
def test_a_spec_nobody_waits_on_is_stale_not_refused(row: TriggerRow) -> None:
    # Even one whose classpath disagrees: it is retired unrun either way.
    spec = TriggerSpec(7, "deferral.triggers.file.FileTrigger", {}, 3, "d.r.t", 2)
    verdict = spec_check(spec, row)
    assert verdict.refused is None
    assert verdict.stale == "trigger 7 is no longer waited on"

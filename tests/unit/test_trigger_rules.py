"""deferral.trigger_rules.evaluate, checked against Airflow's trigger-rule semantics.

Airflow decides a waiting task as soon as the outcome can no longer change: a failure makes
all_success / none_failed upstream_failed at once, a success makes one_success run at once, and so
on; otherwise it waits until every upstream task is done.
"""

from __future__ import annotations

import pytest

from deferral.states import TaskState
from deferral.trigger_rules import TriggerRule, evaluate

R = TriggerRule
RUN = TaskState.SCHEDULED
SKIP = TaskState.SKIPPED
UF = TaskState.UPSTREAM_FAILED
WAIT = None

S, F, K, U = "success", "failed", "skipped", "upstream_failed"
RUNNING, NONE, DEFERRED, QUEUED = "running", "none", "deferred", "queued"
RETRY, RESCHEDULE, SCHEDULED = "up_for_retry", "up_for_reschedule", "scheduled"

CASES: list[tuple[TriggerRule, list[str], TaskState | None]] = [
    # all_success
    (R.ALL_SUCCESS, [S, S, S], RUN),
    (R.ALL_SUCCESS, [S, F], UF),
    (R.ALL_SUCCESS, [S, U], UF),
    (R.ALL_SUCCESS, [S, K], SKIP),
    (R.ALL_SUCCESS, [K, F], UF),  # a failure outranks a skip
    (R.ALL_SUCCESS, [S, RUNNING], WAIT),
    (R.ALL_SUCCESS, [F, RUNNING], UF),  # decided early
    (R.ALL_SUCCESS, [K, DEFERRED], SKIP),  # decided early
    (R.ALL_SUCCESS, [S, NONE], WAIT),
    (R.ALL_SUCCESS, [S, DEFERRED], WAIT),
    (R.ALL_SUCCESS, [S, RETRY], WAIT),
    # all_failed
    (R.ALL_FAILED, [F, F], RUN),
    (R.ALL_FAILED, [F, U], RUN),
    (R.ALL_FAILED, [F, S], SKIP),
    (R.ALL_FAILED, [F, K], SKIP),
    (R.ALL_FAILED, [S, RUNNING], SKIP),  # decided early
    (R.ALL_FAILED, [F, RUNNING], WAIT),
    (R.ALL_FAILED, [F, DEFERRED], WAIT),
    # all_done
    (R.ALL_DONE, [S, F, K, U], RUN),
    (R.ALL_DONE, [F, F], RUN),
    (R.ALL_DONE, [S, RUNNING], WAIT),
    (R.ALL_DONE, [F, DEFERRED], WAIT),
    (R.ALL_DONE, [S, NONE], WAIT),
    (R.ALL_DONE, [S, RETRY], WAIT),
    # one_failed
    (R.ONE_FAILED, [F, RUNNING], RUN),  # decided early
    (R.ONE_FAILED, [U, NONE], RUN),
    (R.ONE_FAILED, [S, S], SKIP),
    (R.ONE_FAILED, [S, K], SKIP),
    (R.ONE_FAILED, [S, RUNNING], WAIT),
    (R.ONE_FAILED, [S, DEFERRED], WAIT),
    # one_success
    (R.ONE_SUCCESS, [S, RUNNING], RUN),  # decided early
    (R.ONE_SUCCESS, [S, F], RUN),
    (R.ONE_SUCCESS, [F, RUNNING], WAIT),
    (R.ONE_SUCCESS, [K, DEFERRED], WAIT),
    (R.ONE_SUCCESS, [K, K], SKIP),
    (R.ONE_SUCCESS, [F, F], UF),
    (R.ONE_SUCCESS, [K, F], UF),
    (R.ONE_SUCCESS, [K, U], UF),
    # none_failed
    (R.NONE_FAILED, [S, K], RUN),
    (R.NONE_FAILED, [K, K], RUN),  # unlike none_failed_min_one_success
    (R.NONE_FAILED, [S, S], RUN),
    (R.NONE_FAILED, [S, F], UF),
    (R.NONE_FAILED, [K, U], UF),
    (R.NONE_FAILED, [F, RUNNING], UF),  # decided early
    (R.NONE_FAILED, [S, RUNNING], WAIT),
    (R.NONE_FAILED, [K, DEFERRED], WAIT),
    # none_failed_min_one_success
    (R.NONE_FAILED_MIN_ONE_SUCCESS, [S, K], RUN),
    (R.NONE_FAILED_MIN_ONE_SUCCESS, [S, S], RUN),
    (R.NONE_FAILED_MIN_ONE_SUCCESS, [K, K], SKIP),
    (R.NONE_FAILED_MIN_ONE_SUCCESS, [S, F], UF),
    (R.NONE_FAILED_MIN_ONE_SUCCESS, [K, U], UF),
    (R.NONE_FAILED_MIN_ONE_SUCCESS, [U, RUNNING], UF),
    (R.NONE_FAILED_MIN_ONE_SUCCESS, [S, RUNNING], WAIT),
    (R.NONE_FAILED_MIN_ONE_SUCCESS, [K, NONE], WAIT),
    # none_skipped
    (R.NONE_SKIPPED, [S, S], RUN),
    (R.NONE_SKIPPED, [S, F], RUN),
    (R.NONE_SKIPPED, [U, F], RUN),
    (R.NONE_SKIPPED, [S, K], SKIP),
    (R.NONE_SKIPPED, [K, RUNNING], SKIP),  # decided early
    (R.NONE_SKIPPED, [S, RUNNING], WAIT),
    (R.NONE_SKIPPED, [F, DEFERRED], WAIT),
    # always
    (R.ALWAYS, [RUNNING, NONE, DEFERRED], RUN),
    (R.ALWAYS, [F, U, K], RUN),
    (R.ALWAYS, [S], RUN),
]


@pytest.mark.parametrize(
    ("rule", "states", "expected"),
    CASES,
    ids=[f"{rule.value}-{'+'.join(states)}" for rule, states, _ in CASES],
)
def test_evaluate(rule: TriggerRule, states: list[str], expected: TaskState | None) -> None:
    assert evaluate(rule, states) == expected


@pytest.mark.parametrize("rule", list(TriggerRule))
def test_empty_upstream_always_runs(rule: TriggerRule) -> None:
    assert evaluate(rule, []) is TaskState.SCHEDULED


@pytest.mark.parametrize("waiting", [NONE, SCHEDULED, QUEUED, RUNNING, DEFERRED, RETRY, RESCHEDULE])
@pytest.mark.parametrize(
    "rule",
    [R.ALL_SUCCESS, R.ALL_DONE, R.NONE_FAILED, R.NONE_FAILED_MIN_ONE_SUCCESS, R.NONE_SKIPPED],
)
def test_every_unfinished_state_makes_rules_wait(rule: TriggerRule, waiting: str) -> None:
    assert evaluate(rule, [S, waiting]) is None


@pytest.mark.parametrize("rule", list(TriggerRule))
def test_order_of_upstream_states_does_not_matter(rule: TriggerRule) -> None:
    mixes = [[S, F, RUNNING], [K, S, S], [U, K], [F, F, S], [K, K, RUNNING]]
    for mix in mixes:
        assert evaluate(rule, mix) == evaluate(rule, list(reversed(mix)))


def test_accepts_any_iterable_of_state_strings() -> None:
    assert evaluate(R.ALL_SUCCESS, (s for s in ["success", "success"])) is TaskState.SCHEDULED
    assert evaluate(R.ALL_SUCCESS, [TaskState.SUCCESS]) is TaskState.SCHEDULED


def test_unknown_state_is_refused() -> None:
    with pytest.raises(ValueError):
        evaluate(R.ALL_SUCCESS, ["exploded"])


def test_trigger_rule_values_match_airflow_names() -> None:
    assert {r.value for r in TriggerRule} == {
        "all_success",
        "all_failed",
        "all_done",
        "one_failed",
        "one_success",
        "none_failed",
        "none_failed_min_one_success",
        "none_skipped",
        "always",
        "all_done_setup_success",
    }

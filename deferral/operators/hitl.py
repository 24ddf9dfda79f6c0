"""Human in the loop (Airflow 3.1's ``airflow.providers.standard.operators.hitl``): a task that asks
a person to choose among options (and fill in params), then goes on with the answer.

``execute`` raises ``TaskAwaitingInput``; the worker records the request and the task waits in
state awaiting_input, holding no worker slot, pool slot or trigger. A response (web UI, API,
``deferral approvals respond``) or the response timeout resumes it at ``execute_complete``, whose
return value, ``{"chosen_options": [...], "params_input": {...}}``, is the task's XCom.

The response timeout is the task's ``execution_timeout``, as in Airflow: when it passes, the
default options are taken, or the task fails with HITLTimeoutError if it has none. It is the
timeout of the wait, so it is not also enforced on ``execute`` and ``execute_complete``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, NoReturn

from deferral.baseoperator import BaseOperator
from deferral.context import Context
from deferral.exceptions import HITLRejectException, HITLTimeoutError, TaskAwaitingInput
from deferral.models.param import ParamsDict
from deferral.operators.branch import branch_skips
from deferral.store.seam import InputRequest, check_request


class HITLOperator(BaseOperator):
    """Ask ``subject`` (and ``body``, Markdown) with ``options``; ``defaults`` are taken when the
    response timeout (``execution_timeout``) passes; ``multiple`` lets several options be chosen;
    ``params`` are a form (as a DAG's params) whose values come back in ``params_input``."""

    template_fields: Sequence[str] = ("subject", "body")
    ui_color = "#f5e6ff"

    def __init__(
        self,
        *,
        subject: str,
        options: list[str],
        body: str | None = None,
        defaults: str | list[str] | None = None,
        multiple: bool = False,
        params: ParamsDict | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        timeout = kwargs.pop("execution_timeout", None)
        super().__init__(**kwargs)
        self.subject = subject
        self.body = body
        self.options = list(options)
        self.defaults = [defaults] if isinstance(defaults, str) else defaults
        self.multiple = multiple
        self.hitl_params = params if isinstance(params, ParamsDict) else ParamsDict(params or {})
        self.response_timeout: dt.timedelta | None = timeout
        check_request(self._request(), f"task {self.task_id!r}")

    def _request(self) -> InputRequest:
        return InputRequest(
            subject=self.subject,
            body=self.body,
            options=tuple(self.options),
            defaults=None if self.defaults is None else tuple(self.defaults),
            multiple=self.multiple,
            params=self.hitl_params.dump(),
            timeout=self.response_timeout,
        )

    def execute(self, context: Context) -> NoReturn:
        raise TaskAwaitingInput(self._request())

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        chosen = event.get("chosen_options")
        if chosen is None:
            raise HITLTimeoutError(
                f"task {self.task_id!r}: no response before its timeout and no default options"
            )
        params_input = dict(event.get("params_input") or {})
        return {"chosen_options": list(chosen), "params_input": params_input}


class ApprovalOperator(HITLOperator):
    """Options ``Approve`` and ``Reject``: approving lets the downstream tasks run; rejecting
    skips the directly-downstream ones (all downstream with ``ignore_downstream_trigger_rules``),
    or fails the task with ``fail_on_reject``."""

    FIXED_ARGS = ("options", "multiple")
    APPROVE = "Approve"
    REJECT = "Reject"

    def __init__(
        self,
        *,
        ignore_downstream_trigger_rules: bool = False,
        fail_on_reject: bool = False,
        **kwargs: Any,
    ) -> None:
        for name in self.FIXED_ARGS:
            if name in kwargs:
                raise ValueError(f"Passing {name} to ApprovalOperator is not allowed.")
        self.ignore_downstream_trigger_rules = ignore_downstream_trigger_rules
        self.fail_on_reject = fail_on_reject
        super().__init__(options=[self.APPROVE, self.REJECT], multiple=False, **kwargs)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        result = super().execute_complete(context, event)
        if result["chosen_options"] == [self.APPROVE]:
            return result
        if self.fail_on_reject:
            raise HITLRejectException(f"task {self.task_id!r} was rejected")
        dag = self.dag
        assert dag is not None
        skipped = (
            dag.downstream_of(self.task_id)
            if self.ignore_downstream_trigger_rules
            else set(self.downstream_task_ids)
        )
        context["ti"].skip_task_ids.update(
            task_id for task_id in skipped if not dag.task_dict[task_id].is_teardown
        )
        return result


class HITLBranchOperator(HITLOperator):
    """The chosen options are the branches followed (task ids or task group ids, or mapped to
    them by ``options_mapping``); the other directly-downstream tasks are skipped."""

    def __init__(self, *, options_mapping: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.options_mapping = dict(options_mapping or {})
        unknown = sorted(set(self.options_mapping) - set(self.options))
        if unknown:
            raise ValueError(
                f"task {self.task_id!r}: options_mapping key {unknown[0]!r} is not an option"
            )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        result = super().execute_complete(context, event)
        branches = [self.options_mapping.get(o, o) for o in result["chosen_options"]]
        context["ti"].skip_task_ids.update(branch_skips(self, branches))
        return result


class HITLEntryOperator(HITLOperator):
    """A form to fill in (``params``) with one option, ``OK``, taken by default."""

    OK = "OK"

    def __init__(self, **kwargs: Any) -> None:
        if "options" not in kwargs:
            kwargs["options"] = [self.OK]
            kwargs.setdefault("defaults", [self.OK])
        super().__init__(**kwargs)

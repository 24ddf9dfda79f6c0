"""The Reference pages, generated from the code at every build so they cannot drift: every
command and option of the console scripts (walking their click groups), every setting
(``deferral.runtime.config.SETTINGS``) and every metric (``deferral.runtime.metrics``' definitions).
``tests/unit/test_docs.py`` checks that each item has help text."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import click

import scheduler.cli
import triggerer.cli
import worker.cli
from deferral.authoring import airflow_arguments
from deferral.runtime import config, metrics
from deferral.runtime.process import CONTEXT_SETTINGS
from deferral_cli import main as deferral_main

CONSOLE_SCRIPTS: dict[str, click.Command] = {
    "deferral": deferral_main,
    "scheduler": scheduler.cli.main,
    "worker": worker.cli.main,
    "triggerer": triggerer.cli.main,
}


@dataclass(frozen=True)
class Documented:
    """One reference item: what it is called and the text that documents it."""

    kind: str  # "command", "option", "setting" or "metric"
    name: str
    help: str


def walk_commands(name: str, command: click.Command) -> Iterator[tuple[str, click.Command]]:
    """``command`` and every command under it, by full path (``deferral dags trigger``)."""
    yield name, command
    if isinstance(command, click.Group):
        context = click.Context(command)
        for sub_name in command.list_commands(context):
            sub = command.get_command(context, sub_name)  # imports a lazy command
            if sub is not None and not sub.hidden:
                yield from walk_commands(f"{name} {sub_name}", sub)


def _params(command: click.Command) -> list[click.Parameter]:
    return [p for p in command.params if not getattr(p, "hidden", False)]


def _command_help(command: click.Command) -> str:
    return inspect.cleandoc(command.help or command.short_help or "")


def _help_markdown(text: str) -> str:
    """Click help as Markdown: a paragraph click must not rewrap (its first line ``\\b``)
    becomes a text block, so that its columns stay columns."""
    paragraphs = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.splitlines()
        if lines and lines[0].strip() == "\b":
            paragraphs.append("\n".join(["```text", *lines[1:], "```"]))
        else:
            paragraphs.append(_prose(paragraph))
    return "\n\n".join(paragraphs)


def items() -> Iterator[Documented]:
    """Every command, option, setting and metric the reference documents."""
    for script, root in CONSOLE_SCRIPTS.items():
        for path, command in walk_commands(script, root):
            yield Documented("command", path, _command_help(command))
            for param in _params(command):
                if isinstance(param, click.Option):
                    yield Documented("option", f"{path} {param.opts[0]}", param.help or "")
    for setting in config.SETTINGS:
        yield Documented("setting", config.ENV_PREFIX + setting.name, setting.help)
    for row in metric_rows():
        yield Documented("metric", row.definition.name, row.definition.help)


def _prose(text: str) -> str:
    """``text`` with ``<`` outside code spans escaped (``DEFERRAL_CONN_<CONN_ID>`` would read
    as an HTML tag and vanish)."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def _cell(text: str) -> str:
    return _prose(" ".join(text.split())).replace("|", "\\|")


def _usage(path: str, command: click.Command) -> str:
    # The programs' context settings (-h as well as --help): click caches a command's help option
    # from the first context it sees, so a bare context here would drop -h from later invocations.
    context = click.Context(command, info_name=path, **CONTEXT_SETTINGS)
    return " ".join(command.collect_usage_pieces(context))


def cli_page() -> str:
    lines = [
        "# Command line",
        "",
        "Generated from the click definitions of the console scripts at each docs build.",
        "",
    ]
    for script, root in CONSOLE_SCRIPTS.items():
        for path, command in walk_commands(script, root):
            depth = min(path.count(" ") + 2, 4)
            lines += [f"{'#' * depth} `{path}`", "", _help_markdown(_command_help(command)), ""]
            lines += ["```", f"{path} {_usage(path, command)}".rstrip(), "```", ""]
            options = [p for p in _params(command) if isinstance(p, click.Option)]
            arguments = [p for p in _params(command) if isinstance(p, click.Argument)]
            if arguments:
                names = ", ".join(f"`{a.human_readable_name}`" for a in arguments)
                lines += [f"Arguments: {names}", ""]
            if options:
                lines += ["| Option | Default | Help |", "|---|---|---|"]
                for option in options:
                    lines.append(
                        f"| `{', '.join(option.opts + option.secondary_opts)}` "
                        f"| {_default(option)} | {_cell(option.help or '')} |"
                    )
                lines.append("")
    return "\n".join(lines)


def _default(option: click.Option) -> str:
    envvar = f" (`{option.envvar}`)" if isinstance(option.envvar, str) else ""
    if option.is_flag or option.default is None or callable(option.default):
        return envvar.strip()
    default: Any = option.default
    return _cell(f"`{default}`{envvar}")


def settings_page() -> str:
    lines = [
        "# Settings",
        "",
        "Every `DEFERRAL_*` environment variable, generated from"
        " `deferral.runtime.config.SETTINGS`. Many may also be given in a `deferral.toml` file"
        " (see Configuration under"
        " [Operations](../operations.md)); the environment wins. Secrets ("
        + ", ".join(f"`{name}`" for name in config.SECRET_SETTINGS)
        + ")"
        " may instead be read from the file that `<name>_FILE` names (Docker secrets).",
        "",
    ]
    sections = dict.fromkeys(setting.section for setting in config.SETTINGS)
    for section in sections:
        lines += [f"## {section.capitalize()}", "", "| Setting | Default | Meaning |"]
        lines.append("|---|---|---|")
        for setting in config.SETTINGS:
            if setting.section == section:
                default = "" if setting.default is None else f"`{setting.default}`"
                name = config.ENV_PREFIX + setting.name
                lines.append(f"| `{name}` | {default} | {_cell(setting.help)} |")
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class MetricRow:
    definition: metrics.Definition
    processes: tuple[str, ...]  # the processes that serve it


def metric_rows() -> list[MetricRow]:
    """Every deferral metric with the processes that serve it (standard process_* aside)."""
    served: dict[str, list[str]] = {}
    defined: dict[str, metrics.Definition] = {}
    for process in metrics.PROCESSES:
        for definition in metrics.definitions(process):
            defined[definition.name] = definition
            served.setdefault(definition.name, []).append(process)
    return [MetricRow(defined[name], tuple(served[name])) for name in sorted(defined)]


def metrics_page() -> str:
    lines = [
        "# Metrics",
        "",
        "Every Prometheus metric, generated from `deferral.runtime.metrics`. Each process"
        " serves its own at `--metrics-port` (`/metrics`), beside the standard `process_*`"
        " metrics.",
        "",
        "| Metric | Type | Labels | Served by | Meaning |",
        "|---|---|---|---|---|",
    ]
    for row in metric_rows():
        metric = row.definition
        labels = ", ".join(f"`{label}`" for label in metric.labels)
        served = ", ".join(row.processes)
        lines.append(
            f"| `{metric.name}` | {metric.type} | {labels} | {served} | {_cell(metric.help)} |"
        )
    return "\n".join([*lines, ""])


def airflow_arguments_page() -> str:
    """What deferral does with each Airflow argument it does not take as its own."""
    rows = [
        *(
            (name, "task", "kept, shown, not acted on", "")
            for name in sorted(airflow_arguments.TASK_KEPT)
        ),
        *(
            (name, "task", "honoured: email alerts", "")
            for name in airflow_arguments.EMAIL_ARGUMENTS
        ),
        *(
            (name, "task", "honoured: an asset event per asset when the task succeeds", "")
            for name in sorted(airflow_arguments.ASSET_ARGUMENTS)
        ),
        (
            airflow_arguments.WEIGHT_RULE,
            "task",
            "honoured: 'absolute' or a PriorityWeightStrategy (its instance or dotted path)",
            "summing the weights up or down the graph ('downstream', 'upstream') is refused:"
            " not implemented yet",
        ),
        *(
            (name, "task", "honoured when equal to the DAG's", airflow_arguments.TASK_DATES_REASON)
            for name in airflow_arguments.TASK_DATES
        ),
        *(
            (name, on, "honoured, with a DeprecationWarning", why)
            for on, table in (
                ("task", airflow_arguments.TASK_DEPRECATED),
                ("DAG", airflow_arguments.DAG_DEPRECATED),
            )
            for name, why in sorted(table.items())
        ),
        *(
            (name, "task", "accepted only with Airflow's no-op value", inert.reason)
            for name, inert in sorted(airflow_arguments.TASK_INERT.items())
        ),
        *(
            (name, "DAG", "accepted only with Airflow's no-op value", inert.reason)
            for name, inert in sorted(airflow_arguments.DAG_INERT.items())
        ),
    ]
    lines = [
        "# Airflow arguments",
        "",
        "Generated from `deferral.authoring.airflow_arguments`: Airflow 2.10 arguments of `DAG`,"
        " `BaseOperator` and the shipped operators that deferral does not implement as its own."
        " Any other value of a no-op argument is refused when the DAG loads, naming the argument"
        " and the reason; an argument in neither table nor deferral's own is refused as unknown.",
        "",
        "| Argument | On | What deferral does | Why |",
        "|---|---|---|---|",
        *(f"| `{name}` | {on} | {what} | {_cell(why)} |" for name, on, what, why in rows),
    ]
    return "\n".join([*lines, ""])


PAGES = {
    "reference/cli.md": cli_page,
    "reference/settings.md": settings_page,
    "reference/metrics.md": metrics_page,
    "reference/airflow-arguments.md": airflow_arguments_page,
}


def on_files(files: Any, config: Any, **_: Any) -> Any:
    """mkdocs hook: add the generated pages to the site (nothing is written to docs/)."""
    from mkdocs.structure.files import File

    for uri, page in PAGES.items():
        files.append(File.generated(config, uri, content=page()))
    return files

"""The ``deferral`` command group itself, which every command runs under: subcommands imported
only when invoked, an unreachable server said in one line, and output made safe for a terminal.

Kept apart from ``common.py`` (sessions, the DAG bag, listings) and light, so that
``deferral --version`` and ``deferral --help`` import click and little else.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import click

from deferral.runtime import storable
from deferral.runtime.config import ConfigError, Settings, load_settings
from deferral.runtime.controls import escape, escape_all

# -- subcommands imported when invoked ----------------------------------------------------------


@dataclass(frozen=True)
class Lazy:
    """A subcommand of a :class:`LazyGroup`: where it is defined (``module:attribute``) and the
    one line ``--help`` lists it with (its docstring's first sentence, which
    tests/unit/test_lazy_imports.py checks)."""

    target: str
    summary: str


class LazyGroup(click.Group):
    """A click group whose subcommands in ``lazy`` are imported when one is invoked (or asked
    for its help): a command loads its own module and not its siblings'."""

    def __init__(self, *args: Any, lazy: Mapping[str, Lazy] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            module, _, attribute = self.lazy[cmd_name].target.partition(":")
            self.add_command(getattr(importlib.import_module(module), attribute), cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click lists subcommands; one not imported yet by its summary."""
        listed = {name: click.Command(name, help=lazy.summary) for name, lazy in self.lazy.items()}
        listed |= {name: cmd for name, cmd in self.commands.items() if not cmd.hidden}
        if not listed:
            return
        limit = formatter.width - 6 - max(len(name) for name in listed)
        rows = [(name, cmd.get_short_help_str(limit)) for name, cmd in sorted(listed.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


# -- servers that cannot be reached ------------------------------------------------------------


class DeferralGroup(LazyGroup):
    """The ``deferral`` command group: whatever command runs, an unreachable (or transiently
    failing) PostgreSQL or Redis ends it with one line naming the server, exit 2, and a database
    without the schema with one line saying to run ``deferral db upgrade``; never a traceback."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Python hands bytes of argv that are not UTF-8 over as lone surrogates: no command
        # could print, store or compare them.
        for position, arg in enumerate(args, start=1):
            if storable.has_lone_surrogate(arg):
                shown = escape_all(storable.storable_text(arg))[:80]
                click.echo(f"error: argument {position} ('{shown}') is not UTF-8 text", err=True)
                ctx.exit(click.UsageError.exit_code)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with terminal_safe_output():
                return super().invoke(ctx)
        except Exception as exc:
            # Imported on failure only: it reads the drivers' exceptions.
            from readmodel.errors import server_error

            said = server_error(exc, _settings_or_none())
            if said is None:
                raise
            line, code = said
            click.echo(f"error: {line}", err=True)
            ctx.exit(code)


def _settings_or_none() -> Settings | None:
    try:
        return load_settings()
    except ConfigError:
        return None


# -- what is printed ----------------------------------------------------------------------------


class TerminalSafe:
    """A text stream that writes what it is given with control characters escaped (newline and
    tab kept): ids, log lines, XCom values and errors come from users, and an ESC sequence among
    them must not drive the terminal of whoever runs the command. A writer that draws with its
    own control sequences (``dags trigger --wait``'s live block) writes to ``unescaped``."""

    def __init__(self, stream: TextIO) -> None:
        self.unescaped = stream

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # as a text stream does: click then finds no binary writer
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self.unescaped.write(escape(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self.unescaped.flush()

    @property
    def closed(self) -> bool:
        return bool(getattr(self.unescaped, "closed", False))

    def isatty(self) -> bool:
        return self.unescaped.isatty()

    def fileno(self) -> int:
        return self.unescaped.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.unescaped, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:
        return getattr(self.unescaped, "errors", None)


def unescaped(stream: TextIO) -> TextIO:
    """The stream under a :class:`TerminalSafe` (for writers that escape what they write)."""
    return stream.unescaped if isinstance(stream, TerminalSafe) else stream


@contextlib.contextmanager
def terminal_safe_output() -> Iterator[None]:
    """Everything a command prints to stdout and stderr, escaped (see :class:`TerminalSafe`)."""
    saved = sys.stdout, sys.stderr
    sys.stdout = TerminalSafe(saved[0])
    sys.stderr = TerminalSafe(saved[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved

"""The commands of a click program, found by walking its tree, so that tests cover every
command, new ones included."""

from __future__ import annotations

from collections.abc import Iterator

import click


def walk(
    command: click.Command, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every command and group under ``command`` (itself first), with its path of names."""
    yield path, command
    if isinstance(command, click.Group):
        for name in command.list_commands(click.Context(command)):
            yield from walk(subcommand(command, name), (*path, name))


def subcommand(group: click.Group, name: str) -> click.Command:
    """``group``'s subcommand ``name``, imported if the group imports its commands lazily."""
    command = group.get_command(click.Context(group), name)
    assert command is not None, name
    return command


def leaves(root: click.Group) -> list[tuple[str, ...]]:
    """The paths of the commands that run something (not groups)."""
    return [path for path, command in walk(root) if not isinstance(command, click.Group)]


def command_at(root: click.Group, path: tuple[str, ...]) -> click.Command:
    command: click.Command = root
    for name in path:
        assert isinstance(command, click.Group), path
        command = subcommand(command, name)
    return command

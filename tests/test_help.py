"""`--help` is written for users: no coding-rule notes, internal case ids, issue numbers or commit hashes;
every boolean option reads ``--flag / --no-flag``; every command's help renders."""

import re

import click
import pytest
import typer
from typer.testing import CliRunner

from eagle3kit.cli import app

COMMAND = typer.main.get_command(app)
NAMES = sorted(COMMAND.commands)
#: what a user should never read in --help: the length rule's note, case ids (C35), issue numbers, hashes
FORBIDDEN = [r"Over 80 lines", r"\bC\d{2}\b", r"\b[Ii]ssues? #?\d+", r"\b[0-9a-f]{7,40}\b", r"<bool>"]


@pytest.mark.parametrize("name", NAMES)
def test_each_commands_help_is_for_users(name):
    res = CliRunner().invoke(app, [name, "--help"], terminal_width=120)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # a phrase wrapped over two lines is still one phrase
    for pattern in FORBIDDEN:
        assert not re.search(pattern, text), (pattern, res.output)
    for p in COMMAND.commands[name].params:
        if isinstance(p, click.Option) and p.is_flag and p.name != "help":
            both = f"{p.opts[0]} / {p.secondary_opts[0]}" if p.secondary_opts else p.opts[0]
            assert p.secondary_opts and both in res.output, f"{name}: {p.opts} is not --flag/--no-flag"


def test_the_rules_see_what_they_forbid():
    """The patterns above match the notes they exist for (a rule that matches nothing proves nothing)."""
    bad = "skip the check (C35); Over 80 lines because …; see issue 24 at 30a1aff; --json <bool>"
    assert all(re.search(p, bad) for p in FORBIDDEN)
    assert len(NAMES) >= 15 and {"run", "bench", "diagnose", "check"} <= set(NAMES)

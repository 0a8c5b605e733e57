"""Write the reference pages generated from the code: ``docs/reference/cli.md`` (every command's
``--help``, as the installed typer app renders it) and ``docs/reference/config-keys.md`` (every config
key of the pydantic schema: its type, the default a config file that omits it gets, the value the
embedded default run sets, and the field's description). ``tests/test_docs_site.py`` fails when the
committed pages differ from what this writes; rerun it after changing a command or a config field:

    .venv/bin/python tools/gen_reference.py
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path

import typer
from pydantic import BaseModel
from typer.testing import CliRunner

from eagle3kit.cli import app
from eagle3kit.core.config import Config, load_config
from eagle3kit.core.kinds import kind_named, kind_settings_modules

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "reference"


def cli_reference() -> str:
    """Markdown: one section per command, its ``--help`` in a text block (80 columns)."""
    group = typer.main.get_command(app)
    parts = [
        "# Command line\n",
        "Generated from the code by `tools/gen_reference.py`: each command's `--help` as it prints. The guides "
        "say when to use which; [configuration keys](config-keys.md) lists what a config file sets.\n",
    ]
    for name in group.commands:  # in the order the app declares them: the pipeline's
        res = CliRunner().invoke(app, [name, "--help"], terminal_width=80, prog_name="eagle3kit")
        if res.exit_code != 0:
            raise RuntimeError(f"`eagle3kit {name} --help` failed: {res.output}")
        parts.append(f"## `eagle3kit {name}`\n\n```text\n{res.output.rstrip()}\n```\n")
    return "\n".join(parts)


def _type_name(annotation) -> str:
    """A field's type as a user reads it: ``int``, ``list[int] or none``, ``one of a, b``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "none"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section" if annotation.__name__.endswith("Config") else "mapping"
    return getattr(annotation, "__name__", str(annotation)).replace("Strict", "").lower()


def _shown(value) -> str:
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "none"
    text = (
        str(value).lower()
        if isinstance(value, bool)
        else repr(value)
        if isinstance(value, str)
        else str(value)
    )
    return f"`{text}`".replace("|", "\\|")


def _rows(model: type[BaseModel], prefix: str, embedded: BaseModel, fresh: BaseModel) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        sub = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if sub is not None:
            # a section written without this key gets the section's own default (the drafter section's
            # differs from a config without one: plain EAGLE-3 against EAGLE-3.1)
            rows += _rows(sub, key + ".", getattr(embedded, name), sub())
            continue
        default, runs = getattr(fresh, name), getattr(embedded, name)
        run_value = _shown(runs) if runs != default else ""
        about = " ".join((field.description or "").split()).replace("|", "\\|")
        kind = _type_name(annotation)
        if key == "drafter.variant":  # a str the registry checks: the variants its kinds train
            kind = "one of " + ", ".join(
                f"`{v}`" for m in kind_settings_modules().values() for v in m.VARIANTS if v
            )
            kind += " or none"
        rows.append(f"| `{key}` | {kind} | {_shown(default)} | {run_value} | {about} |")
    return rows


def config_reference() -> str:
    """Markdown: every key of :class:`eagle3kit.core.config.Config`, one table row each."""
    head = [
        "# Configuration keys\n",
        "Generated from the code by `tools/gen_reference.py`: every key of the config schema, its type, the "
        "default a config file that leaves it out gets, the value `eagle3kit run` without a config sets where it "
        "differs, and the field's description where the code has one. What each key is for, with examples: "
        "[configuration](../config.md).\n",
        "| key | type | default | default run | description |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(head + _rows(Config, "", load_config(None), Config()) + _kind_rows()) + "\n"


def _kind_rows() -> list[str]:
    """The ``drafter`` keys each other drafter kind adds (its ``settings`` module), under a heading per
    kind, in the registry's order; a kind's keys that another kind's settings already listed are not
    repeated (DSpark reads DFlash's)."""
    out, listed = [], {}
    for name, mod in kind_settings_modules().items():
        if mod.SETTINGS is None:
            continue
        title = kind_named(name).title
        variants = ", ".join(f"`{v}`" for v in mod.VARIANTS)
        if mod.SETTINGS.model_fields.keys() <= listed.keys():
            owner = listed[next(iter(mod.SETTINGS.model_fields))][0]
            own = [
                f"`drafter.{k}`: {f.description}"
                for k, f in mod.SETTINGS.model_fields.items()
                if f.description != listed[k][1]
            ]
            out += [
                "",
                f"`drafter.variant` {variants} ({title}) reads the keys of {owner} above"
                + (", but " + "; ".join(own) if own else "")
                + ".",
            ]
            continue
        fresh = mod.SETTINGS()
        out += [
            "",
            f"## The `drafter` keys of {title} (`drafter.variant` {variants})",
            "",
            "| key | type | default | default run | description |",
            "|---|---|---|---|---|",
        ]
        out += _rows(mod.SETTINGS, "drafter.", fresh, fresh)
        listed |= {k: (title, f.description) for k, f in mod.SETTINGS.model_fields.items()}
    return out


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in (("cli.md", cli_reference()), ("config-keys.md", config_reference())):
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

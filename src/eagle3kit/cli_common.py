"""What every ``eagle3kit`` subcommand shares: the typer app, the ``--config``/``--run-dir`` options, the
config a stage runs with (:func:`setup`) and the guard that turns bad input into exit code 2 with one line
naming the thing and the fix (:func:`guard`)."""

from __future__ import annotations

import errno
import functools
import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from eagle3kit.core.config import dump_config, load_config
from eagle3kit.core.config_base import ConfigError
from eagle3kit.core.rundir import DataError, RunDir, write_failed, write_text
from eagle3kit.core.ui import console, print_table
from eagle3kit.model.contract import ExportError
from eagle3kit.model.target_files import one_command

# plain click help (no rich panels): booleans read "--flag / --no-flag", every default shown, no type column
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help=__doc__.split("\n\n")[0].replace("``", ""),
)

ConfigOpt = typer.Option(
    None, "--config", "-c", help="YAML config (default: <run-dir>/config.yaml, else built-in defaults)"
)
RunDirOpt = typer.Option(None, "--run-dir", "-r", help="run directory (overrides run_dir in the config)")


def setup_stage(
    config: Optional[Path], run_dir: Optional[Path], overrides: dict | None = None, first_stage: bool = False
):
    """Config for a stage: ``--config``, else ``<run-dir>/config.yaml``, else the built-in defaults;
    CLI flags are merged in and validated like the file. Once the stage has succeeded, the config
    it used is written to ``<run-dir>/config.yaml`` so that the next stage run with ``--run-dir``
    alone uses it too (a refused or failed command leaves the stored config as it was)."""

    over = {k: v for k, v in (overrides or {}).items() if v not in (None, {})}
    if run_dir:
        over["run_dir"] = str(run_dir)
    if config is None and run_dir is not None and (run_dir / "config.yaml").exists():
        config = run_dir / "config.yaml"
    cfg = load_config(config, over)
    if not first_stage and not Path(cfg.run_dir).is_dir():
        raise FileNotFoundError(
            f"run directory {cfg.run_dir} does not exist: start with `eagle3kit prompts` "
            "(or `eagle3kit run`), or pass the --run-dir of an earlier run"
        )
    run = RunDir(cfg.run_dir)
    _PENDING.append((run / "config.yaml", dump_config(cfg)))
    return cfg, run


_PENDING: list[tuple[Path, str]] = []  # config.yaml to write once the running command succeeds


def keep_stored_config() -> None:
    """The running command changes nothing in the run's config: :func:`setup_stage`'s pending write of
    ``config.yaml`` is dropped."""
    _PENDING.clear()


def given(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


def guard(fn):

    @functools.wraps(fn)
    def wrapper(*a, **kw):

        try:
            with one_command():  # the command's target located and read once
                out = fn(*a, **kw)
            if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 stores the config
                for path, text in _PENDING:
                    write_text(path, text)
            return out
        except (ConfigError, DataError, ExportError, OSError) as e:
            if isinstance(e, OSError) and e.filename and e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
                e = write_failed(e.filename, e)  # a write the disk refused: the file and the fix, one line
            # brackets in the message are text, not markup
            console.print(f"[bold red]error:[/] {escape(str(e))}")
            raise typer.Exit(2)
        except KeyboardInterrupt:
            console.print(
                f"[yellow]interrupted: `eagle3kit {fn.__name__}` keeps what it finished (appended rows, "
                "written shards, checkpoints); run the same command again to resume"
            )
            raise typer.Exit(130)
        finally:
            _PENDING.clear()

    return wrapper


def show_summary(title: str, values: dict) -> None:
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun rank 0 reports
        return
    print_table(title, [(k, v) for k, v in values.items() if not isinstance(v, (dict, list))])

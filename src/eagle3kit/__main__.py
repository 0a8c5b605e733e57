"""``python -m eagle3kit`` = the ``eagle3kit`` command."""

from eagle3kit.cli import app

app()

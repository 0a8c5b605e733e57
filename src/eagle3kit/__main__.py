"""``python -m eagle3kit`` = the ``eagle3kit`` command."""
from .cli import app

app()

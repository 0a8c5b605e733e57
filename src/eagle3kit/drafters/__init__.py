"""Drafter kinds, one package each (``eagle3/``, ``dflash/``), each exposing ``kind.KIND``; the stages
reach them through :mod:`eagle3kit.core.kinds`."""

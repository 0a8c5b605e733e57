"""Drafter kinds, one package each, each exposing ``kind.KIND`` and its config keys in ``settings``; the
stages reach them through :mod:`eagle3kit.core.kinds`, which lists them."""

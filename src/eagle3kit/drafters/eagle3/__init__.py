"""The EAGLE-3 family drafter kind (``kind.KIND``)."""

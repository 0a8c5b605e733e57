"""The EAGLE-3 family's ``drafter.variant`` values for the registry (:mod:`eagle3kit.core.kinds`); its
flags (``fc_norm``, ``norm_output``, …) are the section's own keys (:mod:`eagle3kit.core.config_train`),
so it adds none (``SETTINGS`` None)."""

VARIANTS = (None, "eagle3", "eagle3.1", "p-eagle")
SETTINGS = None

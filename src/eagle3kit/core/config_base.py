"""What every section of the run configuration shares: the error a bad value raises (:class:`ConfigError`,
naming the field and the fix) and the strict pydantic base (:class:`StrictSection`: unknown keys
refused, and true/false where a number belongs)."""

from __future__ import annotations

import typing

from pydantic import BaseModel, ConfigDict, field_validator


class ConfigError(ValueError):
    """A configuration that contradicts itself or the target; the message names field and fix."""


class StrictSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_true_for_a_number(cls, v, info):
        """YAML's true/false where a number belongs (``epochs: true``, or an item of a list or tuple
        of numbers: ``aux_layer_ids: [true, 5]``, ``betas: [true, 0.9]``) is refused, not read as 1/0."""
        if info.field_name not in cls.model_fields:
            return v
        ann = cls.model_fields[info.field_name].annotation
        kinds = {ann, *typing.get_args(ann)}
        if isinstance(v, (list, tuple)) and any(isinstance(x, bool) for x in v):
            kinds = {a for k in kinds if typing.get_origin(k) in (list, tuple) for a in typing.get_args(k)}
        elif not isinstance(v, bool):
            return v
        if bool not in kinds and kinds & {int, float}:
            raise ValueError("a number is needed here, not true/false")
        return v

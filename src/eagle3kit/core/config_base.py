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


def invalid_config_message(path, e, overrides: dict) -> str:
    """``load_config``'s message for a config pydantic refused (``e``, a ``ValidationError``; ``path``, the
    config file): one line per error, naming the field
    and the value; a value given on the command line (``overrides``) is said to come from there, not
    from the file; a rule over several sections (no field path) is its message alone."""
    flags = {f"{k}.{sub}" for k, v in overrides.items() if isinstance(v, dict) for sub in v}
    flags |= {k for k, v in overrides.items() if not isinstance(v, dict)}
    lines, from_flags = [], []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not loc:
            lines.append(f"  {msg}")
            continue
        flag = any(loc == f or loc.startswith(f + ".") for f in flags)
        from_flags.append(flag)
        lines.append(f"  {loc}: {msg} (got {err.get('input')!r}{', from the command line' if flag else ''})")
    head = (
        f"invalid value on the command line (config {path}):"
        if from_flags and all(from_flags)
        else f"{path}: invalid config:"
    )
    return head + "\n" + "\n".join(lines)

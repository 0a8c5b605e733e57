"""DSpark's keys of the ``drafter`` config section: DFlash's block keys (a DSpark drafter is DFlash's
network plus its heads), with a block that drafts from the anchor itself. Read by
:mod:`eagle3kit.core.kinds` while a config loads (see :mod:`eagle3kit.drafters.dflash.settings`)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, StrictInt

from eagle3kit.drafters.dflash.settings import BlockSettings

VARIANTS = ("dspark",)


class DSparkSettings(BlockSettings):
    """DFlash's block keys; the Markov head drafts the anchor's slot too."""

    TITLE: ClassVar[str] = "DSpark"

    block_size: StrictInt = Field(
        default=8, ge=2, description="the block [anchor, mask × (block_size − 1)]; drafts up to block_size"
    )

    def most_drafts(self) -> int:
        """Draft tokens a block yields: every slot (``block_size``), the anchor's included."""
        return self.block_size


SETTINGS = DSparkSettings

"""DFlash's own keys of the ``drafter`` config section, and the checks across sections a block drafter
needs. Light on purpose (pydantic only): :mod:`eagle3kit.core.kinds` reads it while a config loads.

The registry finds these by convention (:func:`eagle3kit.core.kinds.kind_settings`): ``VARIANTS`` (the
``drafter.variant`` values this kind trains) and ``SETTINGS`` (the section's keys beside ``variant``),
whose ``check_config(cfg)`` the config calls once every section is read.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, StrictInt

from eagle3kit.core.config_base import StrictSection

VARIANTS = ("dflash",)


class BlockSettings(StrictSection):
    """The block drafter's keys (DFlash, arXiv:2602.06036): a block of ``block_size`` slots, the anchor
    then masks, drafted in one non-causal forward of ``num_layers`` decoder layers that read the target's
    states at ``target_layer_ids``."""

    TITLE: ClassVar[str] = "DFlash"  # the kind's name in messages

    block_size: StrictInt = Field(
        default=8,
        ge=2,
        description="DFlash: the block [anchor, mask × (block_size − 1)]; drafts up to block_size − 1",
    )
    num_layers: StrictInt = Field(default=5, ge=1, description="DFlash: decoder layers of the drafter")
    target_layer_ids: list[StrictInt] | None = Field(
        default=None,
        description="DFlash: the target's decoder layers read (0-based outputs, DFlash's convention; default one "
        "per draft layer, spread from layer 1 to N − 3)",
    )
    objective: Literal["ce", "kl"] = Field(
        default="ce",
        description="DFlash: ce, the paper's cross-entropy on the reply's tokens; kl, distil the target's "
        "distribution (as speculators trains)",
    )
    gamma: float | None = Field(
        default=None,
        gt=0,
        description="DFlash: the position weights' decay exp(−(k−1)/γ) (default 4 for block 8, "
        "5 for 10, 7 for 16)",
    )
    max_anchors: StrictInt = Field(
        default=512, ge=1, description="DFlash: blocks drawn per sequence and step"
    )

    def most_drafts(self) -> int:
        """Draft tokens a block yields: its slots after the anchor (``block_size − 1``)."""
        return self.block_size - 1

    def check_config(self, cfg) -> None:
        """What a block drafter needs of the other sections: ``drafter.target_layer_ids`` and
        ``target.aux_layer_ids`` name the same layers when both are set, chain drafting, ``evaluate.k``
        within a block, and none of the train keys its objective does not read (``train.init_from``, an
        EAGLE-3 drafter's weights; ``train.pack_length``, since a block never crosses into another sample;
        ``train.parallel: fsdp``, since the drafter trains data-parallel with DDP) — refused as the config
        loads, before any stage runs.

        Raises:
            ValueError: naming the keys and the fix (pydantic reports it under the config's path)."""
        tc = cfg.train
        for key, bad, fix in (
            ("init_from", tc.init_from, "unset it (the drafter starts from its own initialisation)"),
            ("pack_length", tc.pack_length, "unset it (a block drafter batches whole samples)"),
            ("parallel", tc.parallel == "fsdp", "use parallel: ddp (the drafter is replicated)"),
        ):
            if bad:
                raise ValueError(f"train.{key} is not read by a {self.TITLE} drafter: {fix}")
        ids = self.target_layer_ids
        if ids is not None and cfg.target.aux_layer_ids is not None:
            hf = [i + 1 for i in ids]
            mine = list(cfg.target.aux_layer_ids)
            if cfg.target.aux_layer_convention == "output_of_layer":
                mine = [i + 1 for i in mine]
            if mine != hf:
                raise ValueError(
                    f"drafter.target_layer_ids {ids} (outputs of layers, = aux ids {hf}) and target.aux_layer_ids "
                    f"{list(cfg.target.aux_layer_ids)} name other layers; keep drafter.target_layer_ids"
                )
        if cfg.evaluate.draft == "tree":
            raise ValueError("a block drafter drafts a block (a chain): set evaluate.draft: chain")
        most = self.most_drafts()
        if cfg.evaluate.k > most:
            raise ValueError(
                f"evaluate.k {cfg.evaluate.k} > {most}: a {cfg.drafter.variant} block of "
                f"{self.block_size} drafts at most {most} tokens"
            )


SETTINGS = BlockSettings

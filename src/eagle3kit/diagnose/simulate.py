"""eagle3kit's side of a diagnosis: greedy acceptance simulated on exactly the sequences
the engine produced (its prompt ids and its greedy output), for the drafter as given and for each
planted fault (:mod:`eagle3kit.diagnose.faults`), and the comparison with the engine's counters.

One target pass captures every layer any hypothesis reads (the drafter's aux layers and their
neighbours), so each hypothesis costs one drafter unroll per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle3kit.core.kinds import DrafterKind
from eagle3kit.core.metrics import AcceptanceStats
from eagle3kit.core.ui import progress
from eagle3kit.model.target import Target, capture_layer_inputs


@dataclass
class Sequences:
    """The engine's sequences and the target's states on them: ``ids`` int64 [T] per prompt
    (prompt + output), ``first`` the index of its first output token, ``states`` {layer id:
    [T, Ht]} per prompt (HF index: the residual stream entering that layer)."""

    ids: list[torch.Tensor]
    first: list[int]
    states: list[dict[int, torch.Tensor]] = field(default_factory=list)

    def mask(self, i: int) -> torch.Tensor:
        m = torch.zeros(self.ids[i].numel(), dtype=torch.bool)
        m[self.first[i] :] = True
        return m

    def aux(self, i: int, layer_ids: list[int]) -> torch.Tensor:
        """[T, n·Ht]: the layers' states of prompt i, concatenated in the order given."""
        return torch.cat([self.states[i][j] for j in layer_ids], dim=-1)


@torch.no_grad()
def capture_sequences(
    target: Target, prompt_ids: list[list[int]], outputs: list[list[int]], layer_ids: set[int]
) -> Sequences:
    """One target forward per sequence (prompt + the engine's output), recording ``layer_ids``."""
    seqs = Sequences(
        [torch.tensor(p + o, dtype=torch.long) for p, o in zip(prompt_ids, outputs)],
        [len(p) for p in prompt_ids],
    )
    wanted = sorted(layer_ids)
    with progress() as bar:
        task = bar.add_task("target states (transformers)", total=len(seqs.ids), tokens=0, note="")
        n = 0
        for ids in seqs.ids:
            with capture_layer_inputs(target.parts.layers, wanted) as store:
                target.parts.decoder(input_ids=ids[None].to(target.device), use_cache=False)
            seqs.states.append({j: store[j][0].cpu() for j in wanted})
            n += ids.numel()
            bar.update(task, advance=1, tokens=n)
    return seqs


@dataclass
class Simulated:
    """Pooled acceptance (``stats``) and per prompt (``per_prompt``: one AcceptanceStats each)."""

    stats: AcceptanceStats
    per_prompt: list[AcceptanceStats]

    def as_dict(self) -> dict:
        return {
            "tau": round(self.stats.tau, 4),
            "drafts": self.stats.drafts,
            "accepted": self.stats.accepted,
            "per_position_acceptance": [round(x, 4) for x in self.stats.cumulative_per_position],
            "per_prompt_tau": [round(s.tau, 4) for s in self.per_prompt],
        }


def simulate_on(
    kind: DrafterKind,
    drafter,
    target: Target,
    seqs: Sequences,
    k: int,
    layer_ids: list[int],
    aux=None,
    engine: dict | None = None,
) -> Simulated:
    """Greedy acceptance of ``drafter`` (of ``kind``) reading ``layer_ids`` on every sequence (or the
    aux states ``aux[i]`` [T, n·Ht] of another source, an engine's capture), drafted as the kind drafts
    (:meth:`~eagle3kit.core.kinds.DrafterKind.simulate`: a chain for the EAGLE-3 family, one block a step
    for a block drafter), run as an engine with ``engine`` (a faulty engine's settings, from the kind's ``planted``)."""
    pooled, per = AcceptanceStats(k), []
    dev = next(drafter.parameters()).device
    for i, ids in enumerate(seqs.ids):
        a = aux[i] if aux is not None else seqs.aux(i, layer_ids)
        st = kind.simulate(drafter, target, ids, seqs.mask(i), seqs.first[i], a, k, dev, engine or {})
        pooled.merge(st)
        per.append(st)
    return Simulated(pooled, per)


def engine_per_prompt_tau(per_prompt: list[dict]) -> list[float | None]:
    """τ of each prompt from its counter delta (1 + accepted / drafts; None without drafts)."""
    return [1 + d["accepted"] / d["drafts"] if d["drafts"] else None for d in per_prompt]


def compare(engine_tau: float, engine_per: list[float | None], sim: Simulated, rel_tol: float) -> dict:
    """How far a simulation is from the engine.

    The engine and the simulation run on the same sequences, so a right simulation differs only
    where numerics flip a near-tie (SmolLM2 on vLLM's CPU build: 0.6%, and equal per-prompt τ on
    6 of 8 prompts). τ is ``within`` when ``|τ_engine − τ_sim| ≤ rel_tol · τ_sim``; ``distance``
    is the mean absolute per-prompt τ difference, which tells apart hypotheses of similar pooled τ
    (:func:`explains`). Returns ``{tau, delta, tolerance, distance, within}``."""
    diffs = [e - s.tau for e, s in zip(engine_per, sim.per_prompt) if e is not None]
    tol = rel_tol * sim.stats.tau
    delta = engine_tau - sim.stats.tau
    return {
        "tau": round(sim.stats.tau, 4),
        "delta": round(delta, 4),
        "tolerance": round(tol, 4),
        "distance": round(sum(abs(d) for d in diffs) / len(diffs), 4) if diffs else None,
        "within": abs(delta) <= tol,
    }


#: a hypothesis explains the engine when its τ is within the tolerance and its per-prompt distance
#: to the engine is at most this share of the drafter-as-trained's, and smaller by at least DISTANCE_FLOOR
DISTANCE_RATIO, DISTANCE_FLOOR = 0.5, 0.01


def explains(h: dict, ref: dict) -> bool:
    """Whether hypothesis ``h`` (a :func:`compare` result) reproduces the engine better than the
    drafter as trained (``ref``, also a :func:`compare` result): τ within its tolerance and the
    per-prompt distance at most ``DISTANCE_RATIO`` of the reference's and ``DISTANCE_FLOOR`` below
    it. A fault that costs no τ on this target (adjacent layers of a deep residual stream are
    alike) is still found this way: the engine's per-prompt numbers follow it, not the drafter."""
    if not h.get("within") or h.get("distance") is None or ref.get("distance") is None:
        return False
    return (
        h["distance"] <= DISTANCE_RATIO * ref["distance"]
        and ref["distance"] - h["distance"] >= DISTANCE_FLOOR
    )

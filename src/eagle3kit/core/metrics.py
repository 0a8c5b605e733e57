"""Acceptance arithmetic shared by training validation, simulate and decode (docs/architecture.md; docs/measuring.md).

Conventions (named everywhere they are reported):

* τ (mean acceptance length) = 1 + accepted / drafts, from pooled totals over all verify steps,
  bonus token counted; never a mean of per-request means.
* acceptance rate = accepted / (drafts · K).
* cumulative per-position acceptance a_k = (verify steps whose first k drafts were all accepted)
  / drafts, k = 1..K — what vLLM's per-position counter gives; conditional α_k = a_k / a_{k−1}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TAU_FORMULA = (
    "tau = 1 + accepted / drafts, where drafts = verify steps (vLLM's num_drafts) and accepted = accepted "
    "draft tokens, pooled over all steps; the bonus token is counted"
)


@dataclass
class AcceptanceStats:
    """Pooled counters for chain drafting with K draft tokens per verify step."""

    k: int
    drafts: int = 0  # verify steps
    accepted: int = 0  # accepted draft tokens
    hist: list[int] = field(default_factory=list)  # hist[a] = verify steps that accepted exactly a

    def __post_init__(self) -> None:
        if not self.hist:
            self.hist = [0] * (self.k + 1)

    def add(self, accepted: int) -> None:
        """Record one verify step that accepted ``accepted`` of its K drafts (0 ≤ accepted ≤ K)."""
        if not 0 <= accepted <= self.k:
            raise ValueError(f"accepted {accepted} outside [0, {self.k}]")
        self.drafts += 1
        self.accepted += accepted
        self.hist[accepted] += 1

    def merge(self, other: "AcceptanceStats") -> None:
        self.drafts += other.drafts
        self.accepted += other.accepted
        self.hist = [a + b for a, b in zip(self.hist, other.hist)]

    @property
    def tau(self) -> float:
        """1 + accepted / drafts (1.0 when nothing was drafted)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / (self.drafts * self.k) if self.drafts else 0.0

    @property
    def cumulative_per_position(self) -> list[float]:
        """a_k for k = 1..K."""
        if not self.drafts:
            return [0.0] * self.k
        return [sum(self.hist[j] for j in range(k, self.k + 1)) / self.drafts for k in range(1, self.k + 1)]

    @property
    def conditional_per_position(self) -> list[float]:
        """α_k = a_k / a_{k−1} (a_0 = 1)."""
        cum = [1.0] + self.cumulative_per_position
        return [cum[i] / cum[i - 1] if cum[i - 1] > 0 else 0.0 for i in range(1, len(cum))]

    def as_dict(self) -> dict:
        return {
            "tau": round(self.tau, 4),
            "k": self.k,
            "drafts": self.drafts,
            "draft_tokens": self.drafts * self.k,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accept_histogram": list(self.hist),
            "per_position_acceptance": [round(x, 4) for x in self.cumulative_per_position],
            "per_position_kind": "cumulative a_k = steps whose first k drafts were all accepted / steps",
            "conditional_acceptance": [round(x, 4) for x in self.conditional_per_position],
            "tau_formula": TAU_FORMULA,
        }


def match_runs(draft_tokens: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Leading-match lengths of chain drafts against a sequence.

    Args:
        draft_tokens: int64 [T, K]; row t holds the drafts made at origin t (step k proposes
            the token at index t + k + 2 of ``seq``, docs/conventions.md, alignment).
        seq: int64 [L], the target's greedy sequence (prompt + continuation).
    Returns:
        int64 [T]: for each t the number of leading k with ``draft_tokens[t, k] == seq[t+k+2]``
        (indices past the end of ``seq`` never match).
    """
    T, K = draft_tokens.shape
    L = seq.numel()
    idx = torch.arange(T)[:, None] + torch.arange(K)[None, :] + 2  # [T, K]
    valid = idx < L
    ref = seq[idx.clamp(max=L - 1)]
    ok = (draft_tokens == ref) & valid
    return ok.long().cumprod(dim=1).sum(dim=1)


def walk_chain(
    runs: torch.Tensor, start: int, end: int, k: int, stats: AcceptanceStats | None = None
) -> AcceptanceStats:
    """Replay greedy chain decoding over a known greedy sequence.

    The first verify step has origin ``start`` (the last prompt position: the target's prefill
    already produced the first new token at ``start + 1``). A step at origin t accepts
    a = min(runs[t], K) drafts and the target adds one token, so the next origin is t + a + 1.
    Steps continue while the sequence (length ``end``) still has a token after ``origin + 1``.
    """
    st = stats if stats is not None else AcceptanceStats(k)
    t = start
    while t + 2 <= end - 1:
        a = min(int(runs[t]), k)
        st.add(a)
        t += a + 1
    return st

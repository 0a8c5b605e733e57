import torch

from eagle3kit.core.metrics import AcceptanceStats, match_runs, walk_chain


def test_c33_acceptance_rate_and_tokens_per_step_are_named_apart():
    for acc, rate, tokens in ((0, 0.0, 1), (2, 0.5, 3), (4, 1.0, 5)):
        s = AcceptanceStats(4)
        s.add(acc)
        d = s.as_dict()
        assert d["acceptance_rate"] == rate and d["tau"] == tokens


def test_c34_tau_from_pooled_totals():
    s = AcceptanceStats(3)
    for a in (2, 0, 3, 1):
        s.add(a)
    assert s.tau == 2.5 and "1 + accepted / drafts" in s.as_dict()["tau_formula"]
    assert s.cumulative_per_position == [0.75, 0.5, 0.25]
    assert s.conditional_per_position == [0.75, 2 / 3, 0.5]


def test_walk_replays_chain_decoding():
    seq = torch.arange(20)
    drafts = torch.stack([seq[(torch.arange(3) + t + 2).clamp(max=19)] for t in range(20)])
    drafts[5, 1] = -1  # at origin 5 only the first draft matches
    runs = match_runs(drafts, seq)
    assert runs[5] == 1 and runs[4] == 3 and (runs[16], runs[17], runs[18]) == (2, 1, 0)
    s = walk_chain(runs, 1, 20, 3)
    # origins 1 (a=3) → 5 (a=1) → 7 (a=3) → 11 (a=3) → 15 (a=3: the last 3 tokens, no bonus needed)
    assert (s.drafts, s.accepted, s.hist) == (5, 13, [0, 1, 0, 4])

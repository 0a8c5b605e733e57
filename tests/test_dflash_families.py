"""A DFlash drafter on the tiny target of every family `train` supports (Llama, Qwen3, Qwen3-MoE,
DeepSeek-V3, Kimi-K2.5 in both layouts, gpt-oss): built from the target's config the way the DFlash
trainer builds it, trained on two GSM8K conversations until it drafts them, exported in vLLM's layout,
read back with every tensor equal and the same drafts, and found servable by `check` against that target.

The whole pipeline (``eagle3kit run`` with ``drafter.variant: dflash``) and vLLM serving it run on SmolLM2
in tests/test_engine_acceptance.py; this module covers what differs by family: the text config (nested for
Kimi-K2.5, attention of MLA and of sliding windows in the target), the aux states the target hands over,
its embedding and lm_head (shared by the drafter), its rope copied into the drafter.
"""

import family_targets
import pytest
import torch
from conftest import gsm8k_token_samples

from eagle3kit.core.config import TargetConfig
from eagle3kit.core.config_train import DrafterVariantConfig
from eagle3kit.drafters.dflash.folder import read_dflash, write_dflash
from eagle3kit.drafters.dflash.network import DFlashConfig, DFlashDrafter
from eagle3kit.drafters.dflash.objective import dflash_batch, dflash_loss, pick_anchors, simulate_block_tau
from eagle3kit.model.target import load_target, resolve_aux_layer_ids
from eagle3kit.serve.check import check_drafter
from eagle3kit.train.batches import Sample
from eagle3kit.train.samples import compute_features, mask_token

BLOCK, STEPS, LENGTH = 4, 30, 80  # tokens of each conversation kept: the second half supervised


@pytest.mark.parametrize("family", family_targets.FAMILIES)
def test_a_dflash_drafter_trains_exports_and_checks_servable_on_each_family(
    family, smollm2_tok_dir, tmp_path
):
    folder = family_targets.build(family, tmp_path / "target", smollm2_tok_dir)
    tcfg = TargetConfig(model=str(folder), dtype="float32")
    target = load_target(tcfg, device="cpu")
    section = DrafterVariantConfig(variant="dflash", num_layers=2, block_size=BLOCK)
    aux = list(resolve_aux_layer_ids(tcfg, target.num_layers, section))
    assert aux == [2, 6]  # default target layers of an 8-layer target for 2 draft layers: [1, 5]
    samples = [
        Sample(torch.tensor(i[:LENGTH]), torch.tensor(m[:LENGTH], dtype=torch.bool))
        for i, m in gsm8k_token_samples(target.tokenizer, 2)
    ]
    compute_features(target, samples, aux, 4096, torch.device("cpu"), torch.device("cpu"))
    mid = mask_token(samples, target.tokenizer, target.vocab_size, None)
    dcfg = DFlashConfig.from_target(target.config, mid, 2, BLOCK, [a - 1 for a in aux])
    assert dcfg.hidden_size == target.hidden_size and dcfg.vocab_size == target.vocab_size

    torch.manual_seed(0)
    d = DFlashDrafter(dcfg)
    batch = dflash_batch(samples, [0, 1], "cpu")
    # every position whose next token is supervised, as anchors: the whole completion
    anchors = pick_anchors(batch["mask"], [s.ids.numel() for s in samples], BLOCK, 10**6, torch.Generator())
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    before = simulate_block_tau(d.eval(), target, samples, BLOCK - 1, "cpu").tau
    for step in range(STEPS):
        loss, _ = dflash_loss(d.train(), target, batch, anchors, gamma=2.0)
        if step == 0:
            first = float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = simulate_block_tau(d.eval(), target, samples, BLOCK - 1, "cpu")
    print(f"{family}: loss {first:.3f} → {float(loss):.3f}, τ {before:.3f} → {after.tau:.3f}")
    assert float(loss) < 0.9 * first and after.tau > before  # it learned to draft some of these replies

    out = write_dflash(d, tmp_path / "drafter", dtype=torch.float32)
    back = read_dflash(out).eval()
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), back.state_dict().values()))
    assert back.cfg.aux_layer_ids == aux and back.cfg.mask_token_id == mid
    assert simulate_block_tau(back, target, samples, BLOCK - 1, "cpu").accepted == after.accepted
    findings = check_drafter(out, tcfg, num_speculative_tokens=BLOCK - 1)
    assert not [f for f in findings if f.severity == "error"], [f"{f.code}: {f.message}" for f in findings]

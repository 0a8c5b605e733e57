"""The DFlash drafter: its forward equals speculators 0.9's ``DFlashDraftModel`` on the same weights and
inputs (eager attention; full-attention layers, non-causal inside the block, as vLLM serves them),
speculators loads our speculators export with every tensor equal, a folder speculators' own code
saved is read by eagle3kit and drafts what speculators drafts, and the config refuses what cannot be
trained or served."""

import json

import pytest
import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.drafters.dflash.folder import read_dflash, read_dflash_config, write_dflash
from eagle3kit.drafters.dflash.network import (
    DFlashConfig,
    DFlashDrafter,
    block_inputs,
    block_mask,
    default_target_layer_ids,
)

V, H, BLOCK, MASK = 320, 64, 4, 5
pytest.importorskip("speculators")


def _qwen3_layer(**kw):
    from transformers import Qwen3Config

    fields = dict(
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=V,
        max_position_embeddings=512,
    )
    return Qwen3Config(**{**fields, **kw})


def _ours(seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    target = _qwen3_layer(num_hidden_layers=8)
    d = DFlashDrafter(
        DFlashConfig.from_target(target, MASK, num_layers=2, block_size=BLOCK, target_layer_ids=[1, 3, 5])
    )
    for p in d.parameters():
        if p.dim() == 1:  # norms away from 1, so a norm read in the wrong place shows
            p.data.normal_(1.0, 0.2)
    return d.float()


def _speculators_model(aux_ids: list[int], attn: str = "eager"):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = _qwen3_layer()
    layer._attn_implementation = attn
    cfg = DFlashSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=V,
        block_size=BLOCK,
        aux_hidden_state_layer_ids=aux_ids,
        mask_token_id=MASK,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    return DFlashDraftModel(cfg)


def _their_blocks(model, T=24, seed=1):
    """speculators' backbone on random context states and tokens: its post-norm block states and the
    anchors it drew."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, 3 * H, generator=g)
    ids = torch.randint(0, V, (1, T), generator=g)
    loss_mask = torch.ones(1, T)
    loss_mask[:, :3] = 0
    hidden, _, _, _, idx = model._backbone_forward(
        aux, ids, loss_mask, torch.randn(1, T, H), torch.zeros(1, T, dtype=torch.long), max_anchors=4
    )
    return aux, ids, hidden, idx[::BLOCK].view(1, -1)


def _our_blocks(d: DFlashDrafter, aux, ids, anchors, embed):
    T = ids.shape[1]
    tokens, pos = block_inputs(ids, anchors, BLOCK, MASK)
    mask = block_mask(anchors, torch.ones(1, T, dtype=torch.bool), BLOCK)
    return d(d.context(aux), torch.arange(T)[None], embed[tokens], pos, mask)


def test_our_forward_equals_speculators_dflash_draft_model_on_the_same_weights(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = _ours()
    theirs = _speculators_model([2, 4, 6])
    state = {k: v for k, v in ours.state_dict().items() if not k.startswith("rotary.")}
    missing = theirs.load_state_dict(state, strict=False).missing_keys
    assert sorted(missing) == [
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]
    embed = torch.randn(V, H)
    theirs.embed_tokens.weight.data.copy_(embed)
    with torch.no_grad():
        aux, ids, hidden, anchors = _their_blocks(theirs)
        mine = _our_blocks(ours, aux, ids, anchors, embed)
    assert anchors.numel() == 4 and hidden.shape == mine.shape == (1, 4 * BLOCK, H)
    assert (mine - hidden).abs().max() < 1e-5 * hidden.abs().max()
    # a context position at or after the anchor is not read: change it and nothing moves
    aux2 = aux.clone()
    aux2[0, int(anchors.max()) :] += 1.0
    with torch.no_grad():
        last_block = _our_blocks(ours, aux2, ids, anchors, embed)[0, -BLOCK:]
    assert torch.equal(last_block, mine[0, -BLOCK:])


def test_speculators_loads_our_speculators_export_with_every_tensor_equal(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from speculators.models.dflash.core import DFlashDraftModel
    from transformers import Qwen3ForCausalLM

    verifier = tmp_path / "verifier"  # speculators reads the verifier's embedding and lm_head
    Qwen3ForCausalLM(_qwen3_layer(num_hidden_layers=8)).save_pretrained(verifier)

    ours = _ours()
    folder = write_dflash(
        ours,
        tmp_path / "spec",
        "speculators",
        torch.float32,
        verifier={"name_or_path": str(verifier), "architectures": ["Qwen3ForCausalLM"]},
    )
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["aux_hidden_state_layer_ids"] == [2, 4, 6] and cfg["sliding_window_non_causal"] is True
    loaded = DFlashDraftModel.from_pretrained(str(folder), verifier=None)
    theirs = loaded.state_dict()
    for k, v in ours.state_dict().items():
        if not k.startswith("rotary."):
            assert torch.equal(theirs[k], v), k
    assert loaded.config.block_size == BLOCK and loaded.config.mask_token_id == MASK


def test_a_folder_saved_by_speculators_is_read_and_drafts_what_speculators_drafts(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    theirs = _speculators_model([2, 4, 6])
    torch.manual_seed(3)
    for p in theirs.parameters():
        p.data.normal_(0, 0.05) if p.dim() > 1 else p.data.normal_(1.0, 0.2)
    theirs.save_pretrained(tmp_path / "saved")
    d = read_dflash(tmp_path / "saved")
    assert d.cfg.target_layer_ids == [1, 3, 5] and d.cfg.aux_layer_ids == [2, 4, 6]  # HF index − 1
    assert d.cfg.block_size == BLOCK and d.cfg.mask_token_id == MASK
    embed = theirs.embed_tokens.weight.detach().clone()
    with torch.no_grad():
        aux, ids, hidden, anchors = _their_blocks(theirs, seed=4)
        mine = _our_blocks(d, aux, ids, anchors, embed)
    assert (mine - hidden).abs().max() < 1e-5 * hidden.abs().max()


def test_the_vllm_layout_names_decoder_layers_and_reads_back(tmp_path):
    ours = _ours()
    folder = write_dflash(ours, tmp_path / "vllm", "vllm", torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {
        "mask_token_id": MASK,
        "target_layer_ids": [1, 3, 5],
    }  # 0-based, vLLM adds 1
    assert cfg["block_size"] == BLOCK and cfg["num_target_layers"] == 8
    back = read_dflash(folder)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ours.state_dict().items())
    assert read_dflash_config(cfg).aux_layer_ids == [2, 4, 6]


def test_default_target_layers_are_spread_from_layer_1_to_n_minus_3():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the public Qwen3-8B drafter's
    assert default_target_layer_ids(30, 2) == [1, 27]
    with pytest.raises(ConfigError, match="no 6 distinct layers"):
        default_target_layer_ids(6, 6)


@pytest.mark.parametrize(
    "drafter, evaluate, said",
    [
        ({"variant": "dflash", "fc_norm": True}, {}, "fc_norm is an EAGLE-3 flag: drop it"),
        (
            {"variant": "dflash", "blocksize": 4},
            {},
            "drafter.blocksize: Extra inputs are not permitted; did you mean drafter.block_size?",
        ),
        (
            {"fc_nrom": True},
            {},
            "drafter.fc_nrom: an unknown key (Extra inputs are not permitted); did you mean drafter.fc_norm?",
        ),
        ({"block_size": 16}, {}, "drafter.block_size is read only with drafter.variant: dflash"),
        (
            {"variant": "dflash", "block_size": 4},
            {"k": 4},
            "evaluate.k 4 > 3: a dflash block of 4 drafts at most 3",
        ),
        (
            {"variant": "dspark", "block_size": 4},
            {"k": 5},
            "evaluate.k 5 > 4: a dspark block of 4 drafts at most 4",
        ),
        ({"variant": "dflash"}, {"draft": "tree", "mode": "decode"}, "drafts a block (a chain)"),
    ],
)
def test_the_config_refuses_a_dflash_drafter_it_cannot_train_or_evaluate(drafter, evaluate, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        Config.model_validate({"drafter": drafter, "evaluate": evaluate})


@pytest.mark.parametrize(
    "variant, train, said",
    [
        ("dflash", {"pack_length": 2048}, "train.pack_length is not read by a DFlash drafter: unset it"),
        ("dflash", {"parallel": "fsdp"}, "train.parallel is not read by a DFlash drafter: use parallel: ddp"),
        ("dspark", {"init_from": "DRAFTER"}, "train.init_from is not read by a DSpark drafter: unset it"),
    ],
)
def test_train_keys_a_block_drafter_does_not_read_are_refused_before_any_stage(
    tmp_path, variant, train, said
):
    """Refused as the config loads (``eagle3kit run`` on it writes nothing), not once prompts, generate,
    tokenize and vocab have run; the EAGLE-3 drafter takes the same keys."""
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    if train.get("init_from"):  # an EAGLE-3 drafter's folder
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "config.json").write_text("{}")
        train = {"init_from": str(tmp_path / "d")}
    cfg = {"run_dir": str(tmp_path / "run"), "drafter": {"variant": variant}, "train": train}
    with pytest.raises(ValueError, match=said):
        Config.model_validate(cfg)
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["run", "-c", str(tmp_path / "c.yaml")])
    assert res.exit_code == 2 and said in " ".join(res.output.split()) and not (tmp_path / "run").exists()
    Config.model_validate({**cfg, "drafter": {"variant": "eagle3.1"}})


def test_a_block_sees_the_context_before_its_anchor_and_its_own_block_only():
    anchors = torch.tensor([[2, 5, -1]])
    m = block_mask(anchors, torch.tensor([[True] * 6 + [False] * 2]), 3)[0, 0]
    assert m.shape == (9, 8 + 9)
    assert m[0, :8].tolist() == [True, True, False, False, False, False, False, False]
    assert m[3, :8].tolist() == [True] * 5 + [False] * 3
    assert m[6, :8].sum() == 0  # a padding anchor reads no context
    assert m[4, 8:].tolist() == [False] * 3 + [True] * 3 + [False] * 3  # its own block, both ways


def test_all_blocks_drafted_at_once_equal_each_block_drafted_alone():
    """Simulation drafts from every position in one forward; each block must see exactly what a server's
    block sees when drafted alone (the context before its bonus token, its own k + 1 positions)."""
    import types

    from eagle3kit.drafters.dflash.objective import block_drafts, draft_block

    d = _ours()
    g = torch.Generator().manual_seed(7)
    for p in d.parameters():  # weights large enough that the context moves the drafts
        if p.dim() > 1:
            p.data = torch.randn(p.shape, generator=g) * 0.3
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.data = torch.randn(V, H, generator=g) * 3
    target = types.SimpleNamespace(parts=types.SimpleNamespace(embed=torch.nn.Embedding(V, H), lm_head=head))
    T = 30
    aux, ids = torch.randn(T, 3 * H, generator=g), torch.randint(0, V, (T,), generator=g)
    every = block_drafts(d, target, aux, ids, 5, 3)
    ctx = d.context(aux[None])
    alone = [draft_block(d, target, ctx, ids[None], p, 3) for p in range(5, T - 1)]
    assert every.tolist() == alone
    assert len({tuple(a) for a in alone}) > 5  # the drafts differ from block to block


def test_a_causal_block_mask_hides_the_later_slots_and_nothing_else():
    """``causal`` (what diagnose simulates for an engine attending causally inside the block): the block
    part is lower-triangular, the context part unchanged."""
    anchors, valid = torch.tensor([[2, 5]]), torch.ones(1, 8, dtype=torch.bool)
    full, causal = block_mask(anchors, valid, 3)[0, 0], block_mask(anchors, valid, 3, causal=True)[0, 0]
    assert torch.equal(causal[:, :8], full[:, :8])
    assert (
        torch.equal(causal[:, 8:], full[:, 8:].tril())
        and full[:, 8:].sum() == 18
        and causal[:, 8:].sum() == 12
    )


def test_check_refuses_a_dflash_folder_whose_rope_is_not_the_targets(tiny_target_dir, tmp_path):
    """A DFlash export whose rope_theta was changed (1e6 against the target's) is not servable as trained:
    vLLM positions the block with the drafter's rope. As for EAGLE, every spelling is read as the engine
    reads it; the folder as exported (the target's rope copied) has no rope finding."""
    import shutil

    from transformers import AutoConfig

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.serve.check import check_drafter

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    d = DFlashDrafter(DFlashConfig.from_target(tc, 5, num_layers=1, block_size=4, target_layer_ids=[1, 4]))
    good = write_dflash(d, tmp_path / "good", dtype=torch.float32)
    tcfg = TargetConfig(model=str(tiny_target_dir), dtype="float32")
    assert not [f for f in check_drafter(good, tcfg, num_speculative_tokens=3) if f.code.startswith("rope")]
    theta = float(json.loads((good / "config.json").read_text()).get("rope_theta") or 0)
    inside = tmp_path / "inside"  # the target's theta spelled inside rope_scaling only: the same rope
    shutil.copytree(good, inside)
    cfg = {k: v for k, v in json.loads((good / "config.json").read_text()).items() if k != "rope_theta"}
    (inside / "config.json").write_text(
        json.dumps({**cfg, "rope_scaling": {"rope_type": "default", "rope_theta": theta}})
    )
    assert not [f for f in check_drafter(inside, tcfg, num_speculative_tokens=3) if f.code.startswith("rope")]
    for name, edit in (
        ("theta", {"rope_theta": 1e6}),
        ("params", {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}),
    ):
        bad = tmp_path / name
        shutil.copytree(good, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg.pop("rope_theta", None) if name == "params" else None
        (bad / "config.json").write_text(json.dumps({**cfg, **edit}))
        found = [f for f in check_drafter(bad, tcfg, num_speculative_tokens=3) if f.severity == "error"]
        assert [f.code for f in found] == ["rope"], [f"{f.code}: {f.message}" for f in found]
        assert "theta 1000000.0" in found[0].message and f"target's (theta {theta}" in found[0].message


def test_check_names_a_missing_verifier_in_a_dflash_speculators_folder(tiny_target_dir, tmp_path):
    """A DFlash speculators folder whose target (its verifier) was moved away: `vllm serve FOLDER` fails to
    start, so check must not say servable — as for an EAGLE folder moved the same way. The verifier that is
    there gets no finding."""
    from transformers import AutoConfig

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.serve.check import check_drafter

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    d = DFlashDrafter(DFlashConfig.from_target(tc, 5, num_layers=1, block_size=4, target_layer_ids=[1, 4]))
    tcfg = TargetConfig(model=str(tiny_target_dir), dtype="float32")
    here = {"name_or_path": str(tiny_target_dir), "architectures": ["LlamaForCausalLM"]}
    ok = write_dflash(d, tmp_path / "ok", layout="speculators", verifier=here, dtype=torch.float32)
    assert not [f for f in check_drafter(ok, tcfg, num_speculative_tokens=3) if f.code.startswith("verifier")]
    gone = {**here, "name_or_path": str(tmp_path / "moved-away")}
    bad = write_dflash(d, tmp_path / "bad", layout="speculators", verifier=gone, dtype=torch.float32)
    found = [f for f in check_drafter(bad, tcfg, num_speculative_tokens=3) if f.severity == "error"]
    assert [f.code for f in found] == ["verifier_missing"] and "moved-away" in found[0].message
    import shutil

    for name, verifier in (
        ("empty", {**here, "name_or_path": ""}),
        ("none", {"architectures": ["LlamaForCausalLM"]}),
    ):
        bad = tmp_path / name
        shutil.copytree(ok, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg["speculators_config"]["verifier"] = verifier
        (bad / "config.json").write_text(json.dumps(cfg))
        found = [f for f in check_drafter(bad, tcfg, num_speculative_tokens=3) if f.severity == "error"]
        assert "verifier_missing" in {f.code for f in found} and "names no target" in found[0].message, name


def test_check_refuses_sliding_layers_in_a_dflash_folder_eagle3kit_trained_full_attention(
    tiny_target_dir, tmp_path
):
    """layer_types all sliding_attention with a window smaller than the block: vLLM serves those layers
    sliding (and causal), unlike what eagle3kit trained (full attention): an error for eagle3kit's folder, a
    warning for a foreign one (evaluate simulates full attention, so its τ is not what is served)."""
    import shutil

    from transformers import AutoConfig

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.serve.check import check_drafter

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    d = DFlashDrafter(DFlashConfig.from_target(tc, 5, num_layers=2, block_size=4, target_layer_ids=[1, 4]))
    good = write_dflash(d, tmp_path / "good", dtype=torch.float32)
    tcfg = TargetConfig(model=str(tiny_target_dir), dtype="float32")
    assert not [f for f in check_drafter(good, tcfg, num_speculative_tokens=3) if f.code == "dflash_sliding"]
    cfg = json.loads((good / "config.json").read_text())
    for name, extra in (("ours", {}), ("foreign", {"eagle3kit": None})):
        bad = tmp_path / name
        shutil.copytree(good, bad)
        edited = {**cfg, "layer_types": ["sliding_attention"] * 2, "sliding_window": 2, **extra}
        (bad / "config.json").write_text(json.dumps({k: v for k, v in edited.items() if v is not None}))
        found = [f for f in check_drafter(bad, tcfg, num_speculative_tokens=3) if f.code == "dflash_sliding"]
        assert len(found) == 1 and "2 of 2 layers sliding-window attention (window 2)" in found[0].message
        assert found[0].severity == ("error" if name == "ours" else "warning")
    # the same layers made sliding the other ways vLLM resolves them, and a layer_types transformers refuses
    dc = cfg.get("dflash_config") or {}
    for name, edit, code in (
        ("use_swa", {"dflash_config": {**dc, "use_swa": True, "swa_window_size": 2}}, "dflash_sliding"),
        (
            "derived",
            {"use_sliding_window": True, "sliding_window": 2, "max_window_layers": 0},
            "dflash_sliding",
        ),
        ("short", {"layer_types": ["full_attention"]}, "layer_types"),
    ):
        bad = tmp_path / name
        shutil.copytree(good, bad)
        (bad / "config.json").write_text(
            json.dumps({**{k: v for k, v in cfg.items() if k != "layer_types"}, **edit})
        )
        found = [f for f in check_drafter(bad, tcfg, num_speculative_tokens=3) if f.severity == "error"]
        assert code in {f.code for f in found}, (name, [f"{f.code}: {f.message}" for f in found])

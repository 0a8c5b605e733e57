"""Issue 24, points 3 and the speculators CI test: folders the peer tools' own code wrote
(tests/peer_writers.py) import strictly, and the speculators library loads eagle3kit's export.

* speculators 0.9.0 (its own ``Eagle3DraftModel``) loads eagle3kit's speculators export of every
  variant with every tensor equal to eagle3kit's, and its own training forward drafts exactly the
  tokens eagle3kit's forward drafts; a drafter speculators trains (``norm_before_residual: true``,
  EAGLE-3.1's norms) imports to speculators' tensors and drafts what speculators drafts, and
  ``train --init-from`` starts from it.
* SpecForge 0.2.0's ``export --to hf`` (its own exporter) is detected as SpecForge; its missing aux
  ids are refused with SpecForge's default named, and read with ``--aux-layer-ids``; its
  ``norm_output: true`` (SpecForge's "final norm before lm_head", with pre-norm feedback) imports as
  the network SpecForge trained.
"""

from __future__ import annotations

import json

import pytest
import torch
from peer_writers import specforge_export, speculators_folder

from eagle3kit.core.config import ConfigError, TargetConfig
from eagle3kit.model.contract import DrafterImportError
from eagle3kit.model.draft_vocab import DraftVocab
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.folder import export_drafter
from eagle3kit.model.folder_read import read_drafter

DRAFT_IDS = (torch.arange(512) * 7 + 3).tolist()  # offsets ≠ 0 everywhere but draft id 0
T, S = 128, 3  # speculators' flex attention takes whole 128-token blocks


@pytest.fixture(scope="module")
def tc(tiny_target_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_target_dir)


def ours(tc, seed=0, **flags) -> Eagle3Drafter:
    """An eagle3kit drafter for the tiny target with random weights (norms in U(0.5, 1.5))."""
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5], **flags))
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1)
    d.set_vocab(DraftVocab(ids=torch.tensor(DRAFT_IDS), vocab_size=tc.vocab_size))
    return d.eval()


def inputs(tiny_target, seed=1):
    """A random sequence (T + S tokens) and the target's aux states at its first T positions."""
    from eagle3kit.model.target import target_features

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (T + S + 1,), generator=g)
    aux, _ = target_features(tiny_target, ids[None, :T], None, (2, 4, 5))
    return ids, aux.float()


@torch.no_grad()
def our_drafts(d: Eagle3Drafter, embed, ids, aux) -> list[torch.Tensor]:
    """Per TTT step k, the draft ids eagle3kit's forward proposes at positions 0..T−1 (step k reads
    x_{t+k+1} at t; the draft of step k is the argmax over the draft vocabulary)."""
    toks = [ids[k + 1 : k + 1 + T][None] for k in range(S)]
    outs = d.ttt_forward(aux, [embed(x).float() for x in d.step_tokens(toks)], torch.arange(T)[None])
    return [d.logits(o[0]).argmax(-1) for o in outs]


@torch.no_grad()
def speculators_drafts(model, ids, aux) -> list[torch.Tensor]:
    """The same from speculators' own training forward (its step k reads the ids shifted by k,
    zero-padded at the end: compare positions t < T − k)."""
    model.eval()
    return [
        x[0]
        for x in model(
            hidden_states=aux,
            input_ids=ids[1 : T + 1][None],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None],
            ttt_steps=S,
        )
    ]


def speculators_model(folder):
    """speculators' ``Eagle3DraftModel.from_pretrained(folder)`` with the verifier's embedding
    (speculators 0.9.0 fills ``embed_tokens`` from the verifier only where it is NaN, and under
    transformers 5.19 a tensor missing from the folder starts at zero: its own verifier loader is
    called to fill it)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(str(folder))
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model


def same_drafts(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x[: T - k], y[: T - k]) for k, (x, y) in enumerate(zip(a, b)))


SPEC_VARIANTS = {
    "eagle3": {},
    "speculators_default": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
    "eagle3.1": {"norm_before_residual": True, "fc_norm": True, "norm_output": True},
}


@pytest.mark.parametrize("name", list(SPEC_VARIANTS))
def test_speculators_loads_our_speculators_export_and_drafts_what_we_draft(
    name, tc, tiny_target_dir, tiny_target, tmp_path
):
    """The speculators library (PyPI 0.9.0) reads eagle3kit's speculators export: its model has
    every tensor of ours, equal, and its own forward proposes exactly our drafts; the variant's
    flag is live (off, the drafts differ)."""
    d = ours(tc, **SPEC_VARIANTS[name])
    verifier = {"name_or_path": str(tiny_target_dir), "architectures": ["LlamaForCausalLM"]}
    out = export_drafter(d, tmp_path / "spec", fmt="speculators", verifier=verifier)
    model = speculators_model(out)
    theirs = {k.replace("layers.0.", "midlayer."): v for k, v in model.state_dict().items()}
    mine = d.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in mine.items()), [
        k for k, v in mine.items() if not torch.equal(theirs[k], v)
    ]
    embed = tiny_target.parts.embed
    ids, aux = inputs(tiny_target)
    a, b = our_drafts(d, embed, ids, aux), speculators_drafts(model, ids, aux)
    assert same_drafts(a, b), name
    if SPEC_VARIANTS[name]:  # the variant matters: the plain drafter with the same weights drafts otherwise
        plain = ours(tc)
        plain.load_state_dict({k: v for k, v in mine.items() if k in plain.state_dict()})
        assert not same_drafts(our_drafts(plain, embed, ids, aux), b)


def test_speculators_loads_our_p_eagle_export_as_its_peagle_model(tc, tiny_target_dir, tmp_path):
    from speculators.model import SpeculatorModel

    d = ours(tc, parallel_drafting=True, mask_token_id=7)
    verifier = {"name_or_path": str(tiny_target_dir), "architectures": ["LlamaForCausalLM"]}
    out = export_drafter(d, tmp_path / "spec", fmt="speculators", verifier=verifier)
    model = SpeculatorModel.from_pretrained(str(out))
    assert type(model).__name__ == "PEagleDraftModel" and model.mask_token_id == 7
    theirs = {k.replace("layers.0.", "midlayer."): v for k, v in model.state_dict().items()}
    assert all(torch.equal(theirs[k], v) for k, v in d.state_dict().items())


@pytest.mark.parametrize("name", ["speculators_default", "eagle3.1"])
def test_a_drafter_speculators_wrote_imports_as_the_network_it_trains(
    name, tc, tiny_target_dir, tiny_target, tmp_path
):
    """A folder written by speculators' own ``save_pretrained`` (norm_before_residual true, its
    default, with EAGLE-3.1's norms): eagle3kit reads every tensor as speculators holds it, builds
    the same variant, drafts what speculators drafts, and ``train --init-from`` starts from it (a
    run of another variant is told which drafter settings to write)."""
    from eagle3kit.train.checkpoints import init_from_drafter

    src, state = speculators_folder(tmp_path / "theirs", tiny_target_dir, DRAFT_IDS, **SPEC_VARIANTS[name])
    target = TargetConfig(model=str(tiny_target_dir))
    imp = read_drafter(src, target=target)
    assert imp.layout == "speculators"
    flags = {k: True for k, v in SPEC_VARIANTS[name].items() if v}
    assert imp.drafter.config.variant() == flags
    got = imp.drafter.state_dict()
    for k, v in state.items():
        if k.startswith(("verifier_", "embed_tokens")):
            continue
        assert torch.equal(got[k.replace("layers.0.", "midlayer.")], v), k
    ids, aux = inputs(tiny_target)
    model = speculators_model(src)
    assert same_drafts(
        our_drafts(imp.drafter.float(), tiny_target.parts.embed, ids, aux),
        speculators_drafts(model, ids, aux),
    )
    fresh = Eagle3Drafter(DrafterConfig.from_target(tc, 256, [2, 4, 5], **flags))
    fresh.set_vocab(DraftVocab(ids=torch.arange(256) * 14 + 3, vocab_size=tc.vocab_size))
    rep = init_from_drafter(fresh, src, target)
    assert rep["lm_head_rows_copied"] == 256 and torch.equal(fresh.fc.weight, got["fc.weight"])
    with pytest.raises(
        ConfigError, match="set in the config's drafter section: .*norm_before_residual: true"
    ):
        init_from_drafter(Eagle3Drafter(DrafterConfig.from_target(tc, 256, [2, 4, 5])), src, target)


@pytest.fixture(scope="module")
def specforge_folders(tiny_target_dir, tmp_path_factory):
    """SpecForge's own export of its EAGLE-3 drafter, and of its EAGLE-3.1 config (fc_norm and
    norm_output: true, as configs/qwen3-30B-A3B-eagle3.1.json)."""
    tmp = tmp_path_factory.mktemp("specforge")
    return {
        "eagle3": specforge_export(tmp / "eagle3", tiny_target_dir, DRAFT_IDS),
        "eagle3.1": specforge_export(
            tmp / "eagle31", tiny_target_dir, DRAFT_IDS, {"fc_norm": True, "norm_output": True}
        ),
    }


def test_specforge_export_is_detected_and_its_unstated_aux_ids_are_refused_until_given(
    specforge_folders, tiny_target_dir, tmp_path
):
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    src = specforge_folders["eagle3"]
    cfg = json.loads((src / "config.json").read_text())
    assert "eagle_config" not in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg  # what SpecForge wrote
    target = TargetConfig(model=str(tiny_target_dir))
    with pytest.raises(DrafterImportError) as e:
        read_drafter(src, target=target)
    assert "SpecForge's export --to hf" in str(e.value) and "[1, N//2 − 1, N − 4]" in str(e.value)
    assert "--aux-layer-ids 2,4,5" in str(e.value)  # SpecForge's default on this 8-layer target
    with pytest.raises(DrafterImportError, match="contradicts"):
        read_drafter(specforge_export_with_ids(src, tmp_path), target=target, aux_layer_ids=[2, 4, 6])
    res = CliRunner().invoke(
        app, ["import", str(src), "--out", str(tmp_path / "o"), "--target", str(tiny_target_dir)]
    )
    assert res.exit_code == 2 and "--aux-layer-ids" in res.output and not (tmp_path / "o").exists()
    args = ["import", str(src), "--out", str(tmp_path / "o"), "--target", str(tiny_target_dir)]
    res = CliRunner().invoke(app, [*args, "--aux-layer-ids", "2,4,5"])
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "o" / "config.json").read_text())
    assert (
        out["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
        and out["eagle3kit"]["imported_from"]["layout"] == "specforge"
    )
    # train --init-from: the export itself names no layers, so the run is told to import it first; the import serves
    from transformers import AutoConfig

    from eagle3kit.train.checkpoints import init_from_drafter

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    fresh = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5]))
    fresh.set_vocab(DraftVocab(ids=torch.tensor(DRAFT_IDS), vocab_size=tc.vocab_size))
    with pytest.raises(ConfigError, match="Import it first with `eagle3kit import"):
        init_from_drafter(fresh, src, target)
    assert init_from_drafter(fresh, tmp_path / "o", target)["lm_head_rows_copied"] == 512
    imported = read_drafter(tmp_path / "o", target=target).drafter
    assert torch.equal(fresh.fc.weight, imported.fc.weight.float())


def specforge_export_with_ids(src, tmp_path):
    """SpecForge's export with the ids its draft config could carry (``eagle_config``, output of layer j)."""
    import shutil

    out = tmp_path / "with_ids"
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("name", ["eagle3", "eagle3.1"])
def test_specforge_export_imports_as_the_network_specforge_trained(name, specforge_folders, tiny_target_dir):
    from safetensors.torch import load_file

    src = specforge_folders[name]
    imp = read_drafter(src, target=TargetConfig(model=str(tiny_target_dir)), aux_layer_ids=[2, 4, 5])
    assert imp.layout == "specforge"
    trained = load_file(str(src.parent / "state.safetensors"))  # the weights SpecForge's model held
    got = imp.drafter.state_dict()
    assert all(torch.equal(got[k], v) for k, v in trained.items()), name
    if name == "eagle3.1":
        assert json.loads((src / "config.json").read_text())["norm_output"] is True
        # SpecForge 0.2 feeds the pre-norm output back whatever norm_output says (its norm_output: the final
        # norm before lm_head): the import keeps fc_norm and turns the feedback back to pre-norm
        assert imp.drafter.config.variant() == {"fc_norm": True}
        assert any("vLLM reads it as post-norm feedback" in n for n in imp.notes)
    else:
        assert imp.drafter.config.variant() == {}

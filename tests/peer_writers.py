"""Drafter folders written by the peer tools' own code, for tests/test_peers.py.

* SpecForge 0.2.0 (installed by install.sh with ``--no-deps`` into ``.venv/peers``, apart from
  eagle3kit's environment): :func:`specforge_export` runs, in a child process with that folder on
  ``PYTHONPATH``, SpecForge's own ``AutoDraftModel`` (its ``LlamaForCausalLMEagle3``) with seeded
  random weights and a draft vocabulary, saves the ``training_state.pt`` its trainer writes
  (``{"draft_state_dict": …}``, embeddings excluded) and exports it with its own
  ``specforge.export.to_hf.export_to_hf`` — the ``export --to hf`` path.
* speculators 0.9.0 (installed in eagle3kit's environment, without its GPU extras):
  :func:`speculators_folder` builds speculators' ``Eagle3DraftModel`` from its own
  ``Eagle3SpeculatorConfig`` and saves it with ``save_pretrained``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PEERS = Path(__file__).resolve().parents[1] / ".venv" / "peers"

SPECFORGE_DRAFT = {  # a SpecForge draft config (configs/*-eagle3.json) for the tiny 8-layer target
    "architectures": ["LlamaForCausalLMEagle3"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 49152,
    "draft_vocab_size": 512,
}


def specforge_export(out: Path, target: Path, draft_ids: list[int], extra: dict | None = None) -> Path:
    """``out/hf``: SpecForge's ``export --to hf`` of a seeded random drafter for ``target`` whose
    draft vocabulary is ``draft_ids`` (``extra``: fields added to the draft config, e.g.
    SpecForge's EAGLE-3.1 ``fc_norm``/``norm_output``). ``out/state.safetensors`` holds the state
    SpecForge trained (to compare with).

    Raises:
        RuntimeError: SpecForge is not installed in ``.venv/peers`` (run install.sh) or failed."""
    if not (PEERS / "specforge").is_dir():
        raise RuntimeError(f"SpecForge 0.2.0 is not installed in {PEERS}: run ./install.sh")
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_config.json").write_text(json.dumps({**SPECFORGE_DRAFT, **(extra or {})}))
    (out / "draft_ids.json").write_text(json.dumps(draft_ids))
    env = {**os.environ, "PYTHONPATH": str(PEERS)}
    res = subprocess.run(
        [sys.executable, __file__, "specforge", str(out), str(target)],
        env=env,
        capture_output=True,
        text=True,
    )
    if res.returncode:
        raise RuntimeError(f"SpecForge's export failed:\n{res.stderr[-3000:]}")
    return out / "hf"


def _specforge_main(out: Path, target: str) -> None:
    """In the child process: SpecForge's own model, training state and exporter."""
    import torch
    from safetensors.torch import save_file
    from specforge.export.to_hf import export_to_hf
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    model = AutoDraftModel.from_config(
        AutoDraftModelConfig.from_file(str(out / "draft_config.json")), torch_dtype=torch.bfloat16
    )
    torch.manual_seed(0)
    ids = torch.tensor(json.loads((out / "draft_ids.json").read_text()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.05)
        model.d2t.copy_(ids - torch.arange(len(ids)))
        model.t2d.zero_()
        model.t2d[ids] = True
    state = {k: v for k, v in model.state_dict().items() if "embed" not in k}
    torch.save({"draft_state_dict": state}, out / "training_state.pt")
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "state.safetensors"))
    export_to_hf(
        str(out / "training_state.pt"),
        str(out / "draft_config.json"),
        str(out / "hf"),
        embedding_source=target,
    )


def speculators_folder(out: Path, target: Path, draft_ids, seed: int = 0, **flags) -> tuple[Path, dict]:
    """``out``: speculators' own ``Eagle3DraftModel`` (its config from ``flags``: its
    ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``; aux ids [2, 4, 5])
    for ``target`` with seeded random weights and the draft vocabulary ``draft_ids``, saved with
    ``save_pretrained``; returns the folder and its state dict."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, LlamaConfig

    tc = AutoConfig.from_pretrained(target)
    layer = LlamaConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        num_hidden_layers=1,
        vocab_size=tc.vocab_size,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=dict(tc.rope_parameters),
    )
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=len(draft_ids),
        eagle_aux_hidden_state_layer_ids=[2, 4, 5],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target), architectures=["LlamaForCausalLM"]),
        ),
        **flags,
    )
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    ids = torch.as_tensor(draft_ids)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "verifier" in name or "embed" in name:
                continue
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1)
        model.d2t.copy_(ids - torch.arange(len(ids)))
        model.t2d.zero_()
        model.t2d[ids] = True
    model.save_pretrained(out)
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    if sys.argv[1] == "specforge":
        _specforge_main(Path(sys.argv[2]), sys.argv[3])

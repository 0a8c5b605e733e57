"""Does a target sharded over the GPUs of one machine (``target.device_map``) give the same
features and the same training loss as the same target on one GPU?

A Llama-3.1-8B-shaped target with random weights (bf16, hidden 4096, MLP 14336, GQA 32/8,
vocab 128256; ``--layers`` decoder layers) is saved as safetensors and loaded twice through
``eagle3kit.model.target.load_target``: once on ``cuda:0`` and once with ``device_map: balanced``
(accelerate spreads the layers over every visible GPU). On the same batch it compares

* the captured aux states and the post-norm last state (``target_features``),
* the full-vocabulary teacher argmax and the draft-vocabulary teacher logits,
* the top-K teacher record ``extract --teacher topk:16`` stores,
* one TTT loss and its gradient norm for the same drafter (online training's step).

Prints one table and writes benchmarks/results/device_map.json. Needs ≥ 2 GPUs to mean anything
(with one GPU both loads are the same).

    python benchmarks/device_map_check.py [--layers 16] [--batch 4] [--seq 1024]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def save_random_target(folder: Path, layers: int, tiny: bool, dev: str) -> None:
    """A random Llama-3.1-8B-shaped checkpoint (safetensors) and a word-level tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
    )
    if tiny:
        cfg.update(
            dict(
                hidden_size=256,
                intermediate_size=512,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
            )
        )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder)
    del model
    tok = Tokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)


def main() -> None:
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.core.ui import print_table
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.model.target import load_target, target_features, teacher_argmax, teacher_logits
    from eagle3kit.train.batches import Sample, make_batch
    from eagle3kit.train.extract import pack_sample_states
    from eagle3kit.train.ttt import ttt_loss

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument(
        "--tiny", action="store_true", help="hidden 256 on the CPU: a smoke run of the script itself"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "device_map.json"))
    args = ap.parse_args()
    n_gpu = torch.cuda.device_count()
    dev = "cuda:0" if n_gpu else "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="e3k-devmap-"))
    t0 = time.perf_counter()
    save_random_target(tmp, args.layers, args.tiny, dev)
    loads = {}
    for name, kw in (
        ("one_gpu", {"device": dev}),
        ("device_map", {"device_map": "balanced" if n_gpu else "cpu"}),
    ):
        t = time.perf_counter()
        loads[name] = load_target(TargetConfig(model=str(tmp), dtype="bfloat16", **kw))
        print(f"{name}: loaded in {time.perf_counter() - t:.1f} s", flush=True)
    sharded = loads["device_map"]
    layer_devices = [str(next(layer.parameters()).device) for layer in sharded.parts.layers]
    placement = {
        "embed": str(sharded.parts.embed.weight.device),
        "layers": layer_devices,
        "lm_head": str(sharded.parts.lm_head.weight.device),
    }
    N = args.layers
    aux_ids = (2, N // 2, N - 3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128256, (args.batch, args.seq), generator=g)
    vd = args.draft_vocab
    draft_ids = torch.arange(vd, dtype=torch.int64) * 4  # every 4th target id, as a draft vocabulary
    t2d = torch.zeros(128256, dtype=torch.bool)
    t2d[draft_ids] = True
    dcfg = DrafterConfig.from_target(sharded.config, vd, aux_ids, vocab_size=128256)
    torch.manual_seed(2)
    drafter0 = Eagle3Drafter(dcfg)
    drafter0.d2t.copy_(draft_ids - torch.arange(vd))
    drafter0.t2d.copy_(t2d)
    res = {}
    for name, target in loads.items():
        with torch.no_grad():
            aux, last = target_features(target, ids.to(dev), torch.ones_like(ids).to(dev), aux_ids)
            argmax = torch.stack([teacher_argmax(target, last[b]) for b in range(args.batch)])
            logits = teacher_logits(target, last[0, :64], draft_ids.to(dev))
            packed = pack_sample_states(
                aux[0], last[0], "bf16", 16, target, draft_ids.to(target.device), t2d.to(target.device)
            )
        drafter = Eagle3Drafter(dcfg).to(dev, torch.bfloat16)
        drafter.load_state_dict(drafter0.state_dict())
        samples = [
            Sample(ids[b], torch.ones(args.seq, dtype=torch.bool), aux[b], last[b], argmax[b])
            for b in range(args.batch)
        ]
        batch = make_batch(samples, list(range(args.batch)), 3, dev)
        loss, st = ttt_loss(drafter, target, batch, draft_ids.to(dev), 3, 0.8)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1e9)
        res[name] = {
            "aux": aux.float().cpu(),
            "last": last.float().cpu(),
            "argmax": argmax.cpu(),
            "logits": logits.cpu(),
            "topk_ids": packed["topk_ids"].cpu(),
            "loss": float(loss.detach()),
            "grad_norm": float(gnorm),
            "acc": st["acc"],
        }
    a, b = res["one_gpu"], res["device_map"]

    def maxdiff(k):
        return float((a[k] - b[k]).abs().max())

    rows = [
        ("aux states max |Δ|", f"{maxdiff('aux'):.3g}", f"of max |x| {float(a['aux'].abs().max()):.3g}"),
        ("last state max |Δ|", f"{maxdiff('last'):.3g}", f"of max |x| {float(a['last'].abs().max()):.3g}"),
        (
            "teacher argmax agreement",
            f"{float((a['argmax'] == b['argmax']).float().mean()):.4f}",
            f"{a['argmax'].numel()} tokens",
        ),
        ("draft-vocab logits max |Δ|", f"{maxdiff('logits'):.3g}", "fp32"),
        (
            "top-16 ids equal",
            f"{float((a['topk_ids'] == b['topk_ids']).float().mean()):.4f}",
            "extract --teacher topk:16",
        ),
        ("TTT loss", f"{a['loss']:.6f} vs {b['loss']:.6f}", "one GPU vs device_map"),
        ("grad norm", f"{a['grad_norm']:.6f} vs {b['grad_norm']:.6f}", ""),
    ]
    print_table(
        f"device_map: balanced over {n_gpu} GPUs vs one GPU ({args.layers} layers, {args.batch}×{args.seq} tokens)",
        [(q, f"{v}  ({note})" if note else v) for q, v, note in rows],
    )
    out = {
        "gpus": n_gpu,
        "gpu": torch.cuda.get_device_name(0) if n_gpu else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "target": f"Llama-3.1-8B-shaped, {args.layers} layers, random bf16",
        "tokens": args.batch * args.seq,
        "placement": placement,
        "devices_used": sorted(set(layer_devices) | {placement["embed"], placement["lm_head"]}),
        "aux_max_abs_diff": maxdiff("aux"),
        "last_max_abs_diff": maxdiff("last"),
        "argmax_agreement": float((a["argmax"] == b["argmax"]).float().mean()),
        "logits_max_abs_diff": maxdiff("logits"),
        "topk_ids_agreement": float((a["topk_ids"] == b["topk_ids"]).float().mean()),
        "ttt_loss": {"one_gpu": a["loss"], "device_map": b["loss"]},
        "grad_norm": {"one_gpu": a["grad_norm"], "device_map": b["grad_norm"]},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("devices_used", "aux_max_abs_diff", "ttt_loss")}))


if __name__ == "__main__":
    main()

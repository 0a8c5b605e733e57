"""How far two feature sources disagree, before anyone trains on them (``eagle3kit parity``).

Two feature folders written for the same token samples (``extract`` by the transformers backend,
or an engine's capture in the same format, :mod:`eagle3kit.features`) are read shard by shard,
token by token. Per aux layer and for the teacher state:

* cosine similarity, mean over tokens;
* relative error ‖a − b‖ / ‖a‖ over all tokens (a = the first folder, the reference);
* top-1 agreement of the implied next-token distribution: ``lm_head(final_norm(aux))`` for an
  aux state (the logit lens: an aux state is a pre-norm residual stream), ``lm_head(last)`` for
  the teacher state (already post-norm, DESIGN.md §3).

A layer passes when all three meet :data:`TOLERANCES`. What the checks catch: features captured
one layer off (cosine and top-1 drop), the teacher state taken before instead of after the final
norm (its scale changes: relative error), another quantization or kernel (small, within
tolerance), a different target (everything fails).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import ConfigError
from .features import dequantize_fp8, read_index

#: pass thresholds, per aux layer and teacher state
TOLERANCES = {"cosine_min": 0.99, "relative_error_max": 0.10, "top1_agreement_min": 0.95}


def _shards(folder: Path) -> tuple[dict, list[dict]]:
    if not folder.is_dir():
        raise ConfigError(f"--features {folder} is not a folder; give a folder `eagle3kit extract` wrote")
    index = read_index(folder)
    if index is None:
        raise ConfigError(f"{folder} holds no index.json; give a folder `eagle3kit extract` wrote")
    return index, index["shards"]


def _states(folder: Path, shard: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """aux float32 [n, 3, H] and last float32 [n, H] (None for a top-K teacher) of one shard."""
    from safetensors.torch import load_file

    t = load_file(str(folder / shard["file"]))
    aux = dequantize_fp8(t["aux"], t["aux_scale"], torch.float32) if "aux_scale" in t else t["aux"].float()
    last = None
    if "last" in t:
        last = dequantize_fp8(t["last"], t["last_scale"], torch.float32) if "last_scale" in t else t["last"].float()
    return aux, last


class _Acc:
    def __init__(self):
        self.cos_sum = self.n = self.agree = 0.0
        self.diff2 = self.ref2 = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor, top_a: torch.Tensor, top_b: torch.Tensor) -> None:
        self.cos_sum += float(torch.nn.functional.cosine_similarity(a, b, dim=-1).sum())
        self.n += a.shape[0]
        self.diff2 += float(((a - b) ** 2).sum())
        self.ref2 += float((a ** 2).sum())
        self.agree += float((top_a == top_b).sum())

    def result(self) -> dict:
        r = {"tokens": int(self.n), "cosine": round(self.cos_sum / self.n, 6),
             "relative_error": round((self.diff2 / max(self.ref2, 1e-30)) ** 0.5, 6),
             "top1_agreement": round(self.agree / self.n, 6)}
        r["pass"] = (r["cosine"] >= TOLERANCES["cosine_min"] and r["relative_error"] <= TOLERANCES["relative_error_max"]
                     and r["top1_agreement"] >= TOLERANCES["top1_agreement_min"])
        return r


@torch.no_grad()
def compare_features(target, a: str | Path, b: str | Path, max_tokens: int | None = None) -> dict:
    """Compare feature folders ``a`` (the reference) and ``b`` on their common samples.

    Args:
        target: the loaded :class:`eagle3kit.target.Target` (its final norm and lm_head give the
            implied next-token distributions); max_tokens: stop after this many tokens (None: all).
    Returns: ``{"layers": {"aux[i] (layer L)": {...}, "teacher": {...}}, "tolerances", "verdict"}``
        where each entry holds tokens, cosine, relative_error, top1_agreement and pass.
    Raises:
        ConfigError: a folder is not a feature folder, the two were made from other token samples
            or aux ids that cannot be compared (different counts), or hold no common tokens.
    """
    a, b = Path(a), Path(b)
    ia, sa = _shards(a)
    ib, sb = _shards(b)
    for key in ("tokens", "hidden_size"):
        if ia["inputs"].get(key) != ib["inputs"].get(key):
            raise ConfigError(f"{a} and {b} were made from different {key} ({ia['inputs'].get(key)!r} vs "
                              f"{ib['inputs'].get(key)!r}); extract both from the same run's token samples")
    dev = target.device
    norm, head = target.parts.final_norm, target.parts.lm_head
    aux_ids = ia["inputs"].get("aux_layer_ids") or [0, 1, 2]
    accs = [_Acc() for _ in range(3)]
    teacher = _Acc()
    have_teacher = True
    done, ib_by_first = 0, {s["first_sample"]: s for s in sb}
    for s in sa:
        other = ib_by_first.get(s["first_sample"])
        if other is None or other["samples"] != s["samples"]:
            continue
        ax, lx = _states(a, s)
        bx, lb = _states(b, other)
        if ax.shape != bx.shape:
            raise ConfigError(f"{a / s['file']} and {b / other['file']} hold different shapes {tuple(ax.shape)} and "
                              f"{tuple(bx.shape)}")
        n = ax.shape[0] if max_tokens is None else min(ax.shape[0], max_tokens - done)
        for i in range(3):
            xa, xb = ax[:n, i].to(dev), bx[:n, i].to(dev)
            ta = head(norm(xa.to(target.dtype))).argmax(-1)
            tb = head(norm(xb.to(target.dtype))).argmax(-1)
            accs[i].add(xa, xb, ta, tb)
        if lx is None or lb is None:
            have_teacher = False
        else:
            xa, xb = lx[:n].to(dev), lb[:n].to(dev)
            teacher.add(xa, xb, head(xa.to(target.dtype)).argmax(-1), head(xb.to(target.dtype)).argmax(-1))
        done += n
        if max_tokens is not None and done >= max_tokens:
            break
    if not done:
        raise ConfigError(f"{a} and {b} share no shard of the same samples; extract both with the same --shard-tokens")
    layers = {f"aux[{i}] (layer {aux_ids[i]})": accs[i].result() for i in range(3)}
    if have_teacher:
        layers["teacher (post-norm last)"] = teacher.result()
    return {"a": str(a), "b": str(b), "a_source": ia["inputs"].get("source", "transformers"),
            "b_source": ib["inputs"].get("source", "transformers"), "tolerances": TOLERANCES, "layers": layers,
            "verdict": "agree" if all(v["pass"] for v in layers.values()) else "disagree"}

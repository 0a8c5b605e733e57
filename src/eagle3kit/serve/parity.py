"""How far two feature sources disagree, before anyone trains on them (``eagle3kit parity``).

Two feature folders written for the same token samples (``extract`` by the transformers backend,
or an engine's capture in the same format, :mod:`eagle3kit.train.features`) are read shard by shard,
token by token. Per aux layer and for the teacher state:

* cosine similarity, mean over tokens;
* relative error ‖a − b‖ / ‖a‖ over all tokens (a = the first folder, the reference);
* top-1 agreement of the implied next-token distribution: ``lm_head(final_norm(aux))`` for an
  aux state (the logit lens: an aux state is a pre-norm residual stream), ``lm_head(last)`` for
  the teacher state (already post-norm, docs/conventions.md, layer ids).

* mean |Δ log-prob|: per token, how far the second source moves the log-probability of the first
  source's own top token under that distribution — for the teacher state, the target's own
  next-token log-probabilities rebuilt from the captured final state.

A layer passes when the first two meet :data:`TOLERANCES` and the last two the bounds of
:data:`LOGPROB_TOLERANCES` for the precision the states were stored in (the coarser of the two
sources): bounds measured as twice the storage's own noise on a tiny target, which a 2% change of one
layer's weights exceeds in fp32 and bf16 (fp8 storage cannot see one that small). The report names
the first layer, in the order the target computes them, that fails. What the checks catch: features
captured one layer off (cosine and top-1 drop), the teacher state taken before instead of after the
final norm (its scale changes: relative error), a target perturbed in one layer (its log-probabilities
move), another quantization or kernel (small, within tolerance), a different target (everything fails).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3kit.core.config import ConfigError
from eagle3kit.train.features import dequantize_fp8, read_index

#: pass thresholds, per aux layer and teacher state
TOLERANCES = {"cosine_min": 0.99, "relative_error_max": 0.10}
#: per storage precision: (largest mean |Δ log-prob|, smallest top-1 agreement). Measured on the tiny
#: 8-layer Llama of the tests against its fp32 states: bf16 storage 0.0013 / 0.993, fp8 0.019 / 0.931; a 2%
#: change of one layer's weights 0.0030 / 0.985, 5% 0.0074 / 0.969 (fp32). Bounds: twice the noise.
LOGPROB_TOLERANCES = {"fp32": (1e-3, 0.995), "bf16": (2.5e-3, 0.985), "fp8": (0.04, 0.90)}


def _shards(folder: Path) -> tuple[dict, list[dict]]:
    if not folder.is_dir():
        raise ConfigError(f"--features {folder} is not a folder; give a folder `eagle3kit extract` wrote")
    index = read_index(folder)
    if index is None:
        raise ConfigError(f"{folder} holds no index.json; give a folder `eagle3kit extract` wrote")
    return index, index["shards"]


def _states(folder: Path, shard: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """aux float32 [n, 3, H] and last float32 [n, H] (None for a top-K teacher) of one shard."""

    try:
        t = load_file(str(folder / shard["file"]))
    except Exception as e:  # missing, truncated, not safetensors
        raise ConfigError(
            f"{folder / shard['file']} cannot be read ({' '.join(str(e).split())[:200]}); rerun "
            f"`eagle3kit extract` into {folder} with the same settings: it re-extracts from the first "
            "bad shard"
        ) from None
    if "aux" not in t or "offsets" not in t:
        raise ConfigError(
            f"{folder / shard['file']} holds no aux states; give a folder `eagle3kit extract` wrote"
        )
    aux = dequantize_fp8(t["aux"], t["aux_scale"], torch.float32) if "aux_scale" in t else t["aux"].float()
    last = None
    if "last" in t:
        last = (
            dequantize_fp8(t["last"], t["last_scale"], torch.float32)
            if "last_scale" in t
            else t["last"].float()
        )
    return aux, last


class _Acc:
    def __init__(self, precision: str = "fp32"):
        self.cos_sum = self.n = self.agree = self.dlogp = 0.0
        self.diff2 = self.ref2 = 0.0
        self.precision = precision

    def add(self, a: torch.Tensor, b: torch.Tensor, logits_a: torch.Tensor, logits_b: torch.Tensor) -> None:
        self.cos_sum += float(torch.nn.functional.cosine_similarity(a, b, dim=-1).sum())
        self.n += a.shape[0]
        self.diff2 += float(((a - b) ** 2).sum())
        self.ref2 += float((a**2).sum())
        lp_a, lp_b = torch.log_softmax(logits_a.float(), -1), torch.log_softmax(logits_b.float(), -1)
        top = lp_a.argmax(-1, keepdim=True)
        self.agree += float((top[:, 0] == lp_b.argmax(-1)).sum())
        self.dlogp += float((lp_a.gather(-1, top) - lp_b.gather(-1, top)).abs().sum())

    def result(self) -> dict:
        r = {
            "tokens": int(self.n),
            "cosine": round(self.cos_sum / self.n, 6),
            "relative_error": round((self.diff2 / max(self.ref2, 1e-30)) ** 0.5, 6),
            "top1_agreement": round(self.agree / self.n, 6),
            "mean_abs_dlogprob": round(self.dlogp / self.n, 6),
        }
        most_dlogp, least_top1 = LOGPROB_TOLERANCES[self.precision]
        r["pass"] = (
            r["cosine"] >= TOLERANCES["cosine_min"]
            and r["relative_error"] <= TOLERANCES["relative_error_max"]
            and r["top1_agreement"] >= least_top1
            and r["mean_abs_dlogprob"] <= most_dlogp
        )
        return r


class StateAgreement:
    """Agreement of two sources' hidden states on the same tokens, per aux layer and for the
    teacher (the module docstring's three measures against :data:`TOLERANCES`); fed chunk by chunk.

    Args:
        target: the loaded :class:`eagle3kit.model.target.Target` (final norm and lm_head).
        aux_ids: the aux layer ids (HF index; three for the EAGLE-3 family), for the layer names.
    """

    def __init__(self, target, aux_ids, precision: str = "fp32"):
        self.target, self.aux_ids, self.precision = target, list(aux_ids), precision
        self.aux = [_Acc(precision) for _ in range(len(self.aux_ids))]
        self.teacher = _Acc(precision)
        self.have_teacher = True

    @torch.no_grad()
    def add(
        self,
        aux_a: torch.Tensor,
        aux_b: torch.Tensor,
        last_a: torch.Tensor | None = None,
        last_b: torch.Tensor | None = None,
    ) -> None:
        """aux_a, aux_b float [n, len(aux_ids), Ht] (a = the reference); last_a, last_b [n, Ht] post-norm
        teacher states, or None when a source has none (then the teacher is left out)."""
        t = self.target
        norm, head, dev = t.parts.final_norm, t.parts.lm_head, t.device
        for i in range(len(self.aux)):
            xa, xb = aux_a[:, i].to(dev), aux_b[:, i].to(dev)
            self.aux[i].add(xa, xb, head(norm(xa.to(t.dtype))), head(norm(xb.to(t.dtype))))
        if last_a is None or last_b is None:
            self.have_teacher = False
            return
        xa, xb = last_a.to(dev), last_b.to(dev)
        self.teacher.add(xa, xb, head(xa.to(t.dtype)), head(xb.to(t.dtype)))

    @property
    def tokens(self) -> int:
        return int(self.aux[0].n)

    def layers(self) -> dict:
        """``{"aux[i] (layer L)": {tokens, cosine, relative_error, top1_agreement, pass}, …}`` with
        ``"teacher (post-norm last)"`` when every chunk had both teachers."""
        out = {f"aux[{i}] (layer {self.aux_ids[i]})": self.aux[i].result() for i in range(len(self.aux))}
        if self.have_teacher:
            out["teacher (post-norm last)"] = self.teacher.result()
        return out


def verdict(layers: dict) -> str:
    """``"agree"`` when every layer of :meth:`StateAgreement.layers` passes, else ``"disagree"``."""
    return "agree" if all(v["pass"] for v in layers.values()) else "disagree"


def tolerances_for(precision: str) -> dict:
    """Every bound a layer is held to for states stored in ``precision`` (:data:`TOLERANCES`,
    :data:`LOGPROB_TOLERANCES`), as the reports show them."""
    most, least = LOGPROB_TOLERANCES[precision]
    return {**TOLERANCES, "precision": precision, "mean_abs_dlogprob_max": most, "top1_agreement_min": least}


def first_drift(layers: dict) -> str | None:
    """The first layer of :meth:`StateAgreement.layers` (aux layers ascending, then the teacher: the order
    the target computes them) that fails, or None: where the two sources start to differ."""
    return next((name for name, v in layers.items() if not v["pass"]), None)


def storage_precision(*dtypes: str | None) -> str:
    """The coarsest of the features' stored dtypes (``fp32``, ``bf16``, ``fp8``; unknown: bf16, extract's default)."""
    order = ("fp32", "bf16", "fp8")
    return max((d if d in order else "bf16" for d in dtypes), key=order.index)


class _Rows:
    """Per-sample access to a feature folder whatever its shard layout: ``take(first, count)`` gives
    aux float32 [n, 3, H] and last [n, H] (or None) of samples ``first … first+count-1``, in order,
    keeping one shard loaded at a time."""

    def __init__(self, folder: Path, shards: list[dict]):
        self.folder, self.shards = folder, sorted(shards, key=lambda s: s["first_sample"])
        self.samples = sum(s["samples"] for s in self.shards)
        self._file, self._t = None, None

    def _load(self, shard: dict):
        if self._file != shard["file"]:
            aux, last = _states(self.folder, shard)
            offsets = load_file(str(self.folder / shard["file"]))["offsets"]
            if int(offsets[-1]) != aux.shape[0] or len(offsets) != shard["samples"] + 1:
                raise ConfigError(
                    f"{self.folder / shard['file']} does not hold the {shard['samples']} samples its "
                    "index lists; rerun `eagle3kit extract` into that folder to re-extract it"
                )
            self._file, self._t = shard["file"], (aux, last, offsets)
        return self._t

    def take(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        auxs, lasts = [], []
        for sh in self.shards:
            lo, hi = max(first, sh["first_sample"]), min(first + count, sh["first_sample"] + sh["samples"])
            if lo >= hi:
                continue
            aux, last, off = self._load(sh)
            a, b = int(off[lo - sh["first_sample"]]), int(off[hi - sh["first_sample"]])
            auxs.append(aux[a:b])
            lasts.append(None if last is None else last[a:b])
        have_last = all(x is not None for x in lasts)
        return torch.cat(auxs), (torch.cat(lasts) if have_last else None)


def _comparable(target, a: Path, ia: dict, b: Path, ib: dict) -> list[str]:
    """Refuse two feature folders made from other token samples or hidden sizes, or a reference folder
    of another target than ``target``; return notes on what differs but can still be compared.

    Args: ``ia``/``ib``: the folders' ``inputs`` records. Raises: ConfigError, naming both folders."""
    for key in ("tokens", "hidden_size"):
        if ia.get(key) != ib.get(key):
            raise ConfigError(
                f"{a} and {b} were made from different {key} ({ia.get(key)!r} vs "
                f"{ib.get(key)!r}); extract both from the same run's token samples"
            )
    mine = target.source.get("weights_fingerprint") or target.source.get("model")
    if ia.get("target") not in (None, mine):
        raise ConfigError(
            f"{a} was made from another target (weights {str(ia.get('target'))[:16]}…) than the "
            f"one parity loaded ({str(mine)[:16]}…, {target.source.get('model')}); pass that run's "
            "target with --target, or its --run-dir"
        )
    notes = []
    if ib.get("target") not in (None, mine):
        notes.append(f"{b} was made from another target's weights than {a}; expect every layer to differ")
    if ia.get("aux_layer_ids") != ib.get("aux_layer_ids"):
        notes.append(f"the aux layer ids differ: {ia.get('aux_layer_ids')} vs {ib.get('aux_layer_ids')}")
    return notes


@torch.no_grad()
def compare_features(target, a: str | Path, b: str | Path, max_tokens: int | None = None) -> dict:
    """Compare feature folders ``a`` (the reference) and ``b`` sample by sample, whatever their
    shard layouts.

    Args:
        target: the loaded :class:`eagle3kit.model.target.Target` (its final norm and lm_head give the
            implied next-token distributions); max_tokens: stop after this many tokens (None: all).
    Returns: ``{"layers": {"aux[i] (layer L)": {...}, "teacher (post-norm last)": {...}},
        "tolerances", "first_drift", "verdict" ("agree" | "disagree"), "notes"}`` where each layer holds
        tokens, cosine, relative_error, top1_agreement, mean_abs_dlogprob and pass. The teacher is
        compared only when both folders store the post-norm state (``teacher: last``).
    Raises:
        ConfigError: a folder is not a feature folder; the two were made from other token samples
            or hidden sizes; folder ``a`` was made from another target than ``target``.
    """
    a, b = Path(a), Path(b)
    ia, sa = _shards(a)
    ib, sb = _shards(b)
    notes = _comparable(target, a, ia["inputs"], b, ib["inputs"])
    precision = storage_precision(ia["inputs"].get("dtype"), ib["inputs"].get("dtype"))
    agreement = StateAgreement(target, ia["inputs"].get("aux_layer_ids") or [0, 1, 2], precision)
    ra, rb = _Rows(a, sa), _Rows(b, sb)
    if ra.samples != rb.samples:
        notes.append(
            f"{a} holds {ra.samples} samples and {b} {rb.samples}; compared the first "
            f"{min(ra.samples, rb.samples)} (an unfinished extract?)"
        )
    done, first, common = 0, 0, min(ra.samples, rb.samples)
    while first < common and (max_tokens is None or done < max_tokens):
        count = min(64, common - first)
        ax, lx = ra.take(first, count)
        bx, lb = rb.take(first, count)
        if ax.shape != bx.shape:
            raise ConfigError(
                f"samples {first}…{first + count - 1} of {a} and {b} hold different shapes "
                f"{tuple(ax.shape)} and {tuple(bx.shape)}"
            )
        n = ax.shape[0] if max_tokens is None else min(ax.shape[0], max_tokens - done)
        agreement.add(ax[:n], bx[:n], None if lx is None else lx[:n], None if lb is None else lb[:n])
        done += n
        first += count
    if not done:
        raise ConfigError(
            f"{a} and {b} hold no common tokens to compare (an empty folder, or --max-tokens 0)"
        )
    layers = agreement.layers()
    if not agreement.have_teacher:
        notes.append(
            "teacher not compared: a folder stores a top-K teacher (extract.teacher topk:K), not the post-norm state"
        )
    return {
        "a": str(a),
        "b": str(b),
        "a_source": ia["inputs"].get("source", "transformers"),
        "b_source": ib["inputs"].get("source", "transformers"),
        "tolerances": tolerances_for(precision),
        "layers": layers,
        "first_drift": first_drift(layers),
        "tokens": done,
        "notes": notes,
        "verdict": verdict(layers),
    }

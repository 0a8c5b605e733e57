"""`extract` and `train --features` (issue 6): feature shards in bf16, fp8 and top-K; the bytes per
token of each; a kill mid-way resumes to the same shards; refusal when the disk is too small or
the folder was made from other inputs; and the shards hold what the online path computes, per aux
layer and teacher, to the storage's own rounding (a check each planted mistake fails)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from eagle3kit.core.config import ConfigError, load_config
from eagle3kit.core.rundir import RunDir, sha256_tensors
from eagle3kit.data.tokenize import save_shard
from eagle3kit.model.draft_vocab import DraftVocab, save_vocab
from eagle3kit.train.batches import Sample, make_batch
from eagle3kit.train.chain_step import build_drafter
from eagle3kit.train.extract import run_extract
from eagle3kit.train.features import bytes_per_token, dequantize_fp8, load_features, quantize_fp8
from eagle3kit.train.samples import compute_features
from eagle3kit.train.ttt import ttt_loss

V, VD = 49152, 256


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_target):
    """A run dir holding a token shard (12 samples of 9–30 tokens, prompt then completion) and a
    256-token draft vocabulary, for the tiny 8-layer Llama target."""
    d = tmp_path_factory.mktemp("extract")
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(12):
        n = 9 + (i * 7) % 22
        ids = torch.randint(3, 2000, (n,), generator=g).tolist()
        samples.append((ids, [0] * 4 + [1] * (n - 4)))
    save_shard(d / "tokens.safetensors", samples)
    online = [Sample(torch.tensor(i), torch.tensor(m, dtype=torch.bool)) for i, m in samples]
    compute_features(tiny_target, online, (2, 4, 5), 4096, torch.device("cpu"), torch.device("cpu"))
    top1 = sorted({int(t) for s in online for t in s.argmax[s.mask]})[
        : VD // 2
    ]  # half the draft vocab: the target's picks
    rest = [i for i in range(3, V, 97) if i not in top1][: VD - len(top1)]
    save_vocab(d / "vocab.safetensors", DraftVocab(ids=torch.tensor(sorted(top1 + rest)), vocab_size=V), {})
    return RunDir(d)


def draft_vocab(run):
    from eagle3kit.model.draft_vocab import load_vocab

    return load_vocab(run / "vocab.safetensors")[0]


def cfg_for(run, tiny_target_dir, **extract):
    (run / "c.yaml").write_text(
        f"run_dir: {run.path}\ntarget: {{model: {tiny_target_dir}, dtype: float32}}\n"
        f"vocab: {{draft_vocab_size: {VD}}}\n"
    )
    cfg = load_config(run / "c.yaml")
    for k, v in extract.items():
        setattr(cfg.extract, k, v)
    return cfg


def test_fp8_round_trip_is_within_e4m3_precision():
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    q, s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (50, 3)
    y = dequantize_fp8(q, s, torch.float32)
    assert (
        (y - x).abs() <= 0.0625 * x.abs().amax(-1, keepdim=True)
    ).all()  # 3 mantissa bits: ≤ 2^-4 of the row max


@pytest.mark.parametrize(
    "dtype,teacher", [("bf16", "last"), ("fp8", "last"), ("bf16", "topk:8"), ("fp8", "topk:8")]
)
def test_bytes_per_token_of_each_option(run, tiny_target, tiny_target_dir, tmp_path, dtype, teacher):
    cfg = cfg_for(run, tiny_target_dir, dtype=dtype, teacher=teacher)
    res = run_extract(cfg, run, tiny_target, out_dir=str(tmp_path / "f"))
    H = 64
    want = {
        ("bf16", "last"): 8 * H,
        ("fp8", "last"): 4 * H + 16,
        ("bf16", "topk:8"): 6 * H + 8 * 4 + 1,
        ("fp8", "topk:8"): 3 * H + 12 + 8 * 4 + 1,
    }[(dtype, teacher)]
    assert res["bytes_per_token"] == want == bytes_per_token(H, dtype, 8 if "topk" in teacher else None, VD)
    t = load_file(str(tmp_path / "f" / "shard-00000.safetensors"))
    stored = sum(v.numel() * v.element_size() for k, v in t.items() if k != "offsets")
    assert stored == want * res["tokens"]  # what the file really holds


def test_a_killed_extract_resumes_to_the_same_shards(run, tiny_target, tiny_target_dir, tmp_path):
    cfg = cfg_for(run, tiny_target_dir, shard_tokens=60)
    whole = run_extract(cfg, run, tiny_target, out_dir=str(tmp_path / "whole"))
    assert whole["shards"] > 3 and whole["samples"] == 12
    part = run_extract(cfg, run, tiny_target, out_dir=str(tmp_path / "part"), stop_after_shards=2)  # "killed"
    assert part["shards"] == 2
    (tmp_path / "part" / "shard-00002.safetensors.tmp").write_bytes(b"torn")  # a half-written shard
    done = run_extract(cfg, run, tiny_target, out_dir=str(tmp_path / "part"))
    assert done["shards"] == whole["shards"] and done["tokens"] == whole["tokens"]
    for i in range(whole["shards"]):
        name = f"shard-{i:05d}.safetensors"
        assert sha256_tensors(tmp_path / "part" / name) == sha256_tensors(tmp_path / "whole" / name)


def test_refusals_other_inputs_and_too_little_disk(run, tiny_target, tiny_target_dir, tmp_path, monkeypatch):
    cfg = cfg_for(run, tiny_target_dir)
    run_extract(cfg, run, tiny_target, out_dir=str(tmp_path / "f"))
    with pytest.raises(ConfigError, match="other inputs.*changed: dtype"):
        run_extract(cfg_for(run, tiny_target_dir, dtype="fp8"), run, tiny_target, out_dir=str(tmp_path / "f"))
    import collections

    monkeypatch.setattr(
        shutil, "disk_usage", lambda p: collections.namedtuple("U", "total used free")(10, 10, 1000)
    )
    with pytest.raises(ConfigError, match=r"needs about [\d,]+ bytes but .* has 1,000 free"):
        run_extract(cfg, run, tiny_target, out_dir=str(tmp_path / "g"))
    assert not list((tmp_path / "g").glob("shard-*"))


def _round(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """``x`` [..., D] rounded as the storage format does, per row of D: bf16, or float8 e4m3 with one
    scale per row (the format features.py documents), back in float32."""
    if dtype == "fp8":
        q, scale = quantize_fp8(x)
        return dequantize_fp8(q, scale, torch.float32)
    return x.to(torch.bfloat16).float()


def _stored_form(samples: list, dtype: str, teacher: str, target, vocab) -> list:
    """What the shards must hold when extract computed what the online path computes, built here from
    the format's definition and not from extract's own packing: each aux block (one target layer, Ht
    wide) and the post-norm teacher state rounded per token row; for ``topk:K``, the K largest
    draft-vocabulary logits of the teacher in bf16 and their draft ids."""
    from eagle3kit.model.target import teacher_argmax, teacher_logits

    K = int(teacher.split(":")[1]) if teacher != "last" else None
    out = []
    for s in samples:
        T = s.ids.numel()
        n = Sample(s.ids, s.mask, aux=_round(s.aux.float().reshape(T, 3, -1), dtype).reshape(T, -1))
        if K:
            vals, idx = teacher_logits(target, s.last, vocab.ids).float().topk(K, dim=-1)
            n.topk_values, n.topk_ids = vals.to(torch.bfloat16).float(), idx
            n.top1_in_draft = vocab.t2d[
                teacher_argmax(target, s.last)
            ]  # the target's top-1 in the draft vocab
        else:
            n.last = _round(s.last.float(), dtype)
            n.argmax = teacher_argmax(target, n.last, where=s.mask.bool())
        out.append(n)
    return out


def _gap(a: list, b: list) -> dict:
    """Relative error ‖b − a‖ / ‖a‖ over every token, per aux block (one target layer each) and for the
    teacher (its state, or its top-K logits)."""

    def rel(get) -> float:
        num = sum(float(((get(y).double() - get(x).double()) ** 2).sum()) for x, y in zip(a, b))
        return (num / sum(float((get(x).double() ** 2).sum()) for x in a)) ** 0.5

    H = a[0].aux.shape[-1] // 3
    out = {f"aux[{j}]": rel(lambda s, j=j: s.aux[:, j * H : (j + 1) * H]) for j in range(3)}
    out["teacher"] = rel(lambda s: s.last if s.last is not None else s.topk_values)
    return out


def _loss(samples, target, vocab) -> float:
    d = build_drafter(target, vocab, (2, 4, 5), seed=0).double()
    with torch.no_grad():
        d.lm_head.weight.mul_(30)  # a peaked drafter: its loss depends on the teacher, not only on log Vd
        loss, _ = ttt_loss(
            d, target, make_batch(samples, list(range(12)), 3, torch.device("cpu")), vocab.ids, 3, 0.8
        )
    return float(loss)


def _online(run, target, aux_ids=(2, 4, 5)) -> list:
    samples = _online_ids_only(run)
    compute_features(target, samples, aux_ids, 4096, torch.device("cpu"), torch.device("cpu"))
    return samples


def shard_check(online: list, stored: list, dtype: str, teacher: str, target, vocab) -> list[str]:
    """What is wrong with ``stored`` (features read from shards) against the ``online`` features of the
    same samples, at the storage's own noise: ``stored`` must equal the online features put through
    extract's rounding to 5% of what that rounding itself moves (bf16 0.17%, fp8 2.5% relative error on
    the tiny target; one layer off moves an aux block by 47–82%), per aux block and teacher, and give
    the training loss of that rounded form to 5% of the rounding's own effect on it. Returns the failures."""
    from eagle3kit.model.target import teacher_logits

    expected = _stored_form(online, dtype, teacher, target, vocab)
    reference = online
    if teacher != "last":  # the exact top-K logits of the online teacher, at the ids kept
        reference = [
            Sample(
                s.ids,
                s.mask,
                aux=s.aux,
                topk_values=teacher_logits(target, s.last, vocab.ids).gather(-1, e.topk_ids),
            )
            for s, e in zip(online, expected)
        ]
        ids = [int((e.topk_ids != t.topk_ids).sum()) for e, t in zip(expected, stored)]
        if sum(ids):
            return [f"teacher: top-K ids differ at {sum(ids)} places"]
    noise, gap = _gap(reference, expected), _gap(expected, stored)
    most = {"bf16": 0.004, "fp8": 0.04}[dtype]  # the format's own rounding: bf16 0.17%, fp8 2.5% measured
    assert all(0 < v <= most for v in noise.values()), noise  # the expectation is the rounded online state
    bad = [f"{k}: {gap[k]:.4g} (noise {noise[k]:.4g})" for k in gap if gap[k] > 0.05 * noise[k]]
    l_on, l_exp, l_st = (_loss(x, target, vocab) for x in (online, expected, stored))
    if teacher == "last":  # rounding moves the loss by well under 1% (a top-K teacher is another loss)
        assert abs(l_exp - l_on) <= 0.005 * l_on, (l_exp, l_on)
    if abs(l_st - l_exp) > 0.05 * abs(l_exp - l_on):
        bad.append(f"loss {l_st:.6g} against {l_exp:.6g} (the rounding's own effect {abs(l_exp - l_on):.3g})")
    return bad


@pytest.mark.parametrize("dtype,teacher", [("bf16", "last"), ("fp8", "last"), ("bf16", "topk:16")])
def test_training_from_shards_reads_what_the_online_path_computes(
    run, tiny_target, tiny_target_dir, tmp_path, dtype, teacher
):
    """The shards hold the online features to the storage's rounding, per aux layer and teacher, and the
    training loss on them is the online loss rounded the same way (``shard_check``; each mistake it must
    see is planted in the test below)."""
    cfg = cfg_for(run, tiny_target_dir, dtype=dtype, teacher=teacher)
    run_extract(cfg, run, tiny_target, out_dir=str(tmp_path / "f"))
    online, stored = _online(run, tiny_target), _online_ids_only(run)
    load_features(
        tmp_path / "f",
        stored,
        {"tokens": sha256_tensors(run / "tokens.safetensors"), "aux_layer_ids": [2, 4, 5]},
        tiny_target,
        torch.device("cpu"),
    )
    assert shard_check(online, stored, dtype, teacher, tiny_target, draft_vocab(run)) == []


def _online_ids_only(run) -> list:
    from eagle3kit.data.tokenize import load_shard

    return [Sample(i, m) for i, m in load_shard(run / "tokens.safetensors")]


def _pre_norm_teacher(samples, target) -> None:
    """Replace each sample's teacher state by the last layer's output before the final norm."""
    for s in samples:
        got = []
        hook = target.parts.layers[-1].register_forward_hook(
            lambda m, i, o: got.append(o[0] if isinstance(o, tuple) else o)
        )
        try:
            with torch.no_grad():
                target.parts.decoder(input_ids=s.ids[None].to(target.device), use_cache=False)
        finally:
            hook.remove()
        s.last = got[0].reshape(s.ids.numel(), -1).float()
        s.argmax = None


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize(
    "mistake", ["aux_layers_1_3_4", "aux_layers_3_5_6", "aux_blocks_swapped", "teacher_before_final_norm"]
)
def test_the_shard_check_fails_on_a_planted_mistake(run, tiny_target, mistake, dtype):
    """Shards holding a mistake that moved the old loss-only check by 1.3–4.4% (inside its fp8 bound of
    10%): aux layers (1, 3, 4) or (3, 5, 6) for (2, 4, 5), the first two aux blocks swapped, the teacher
    taken before the final norm. ``shard_check`` names the block the mistake is in, and the loss."""
    vocab = draft_vocab(run)
    online = _online(run, tiny_target)
    wrong = _online(
        run,
        tiny_target,
        {"aux_layers_1_3_4": (1, 3, 4), "aux_layers_3_5_6": (3, 5, 6)}.get(mistake, (2, 4, 5)),
    )
    if mistake == "aux_blocks_swapped":
        for s in wrong:
            H = s.aux.shape[-1] // 3
            s.aux = torch.cat([s.aux[:, H : 2 * H], s.aux[:, :H], s.aux[:, 2 * H :]], -1)
    if mistake == "teacher_before_final_norm":
        _pre_norm_teacher(wrong, tiny_target)
    stored = _stored_form(wrong, dtype, "last", tiny_target, vocab)
    bad = shard_check(online, stored, dtype, "last", tiny_target, vocab)
    every = ["aux[0]", "aux[1]", "aux[2]"]
    blocks = {"aux_blocks_swapped": every[:2], "teacher_before_final_norm": ["teacher"]}.get(mistake, every)
    assert [b.split(":")[0] for b in bad if not b.startswith("loss")] == blocks, bad
    assert any(b.startswith("loss") for b in bad), bad


def test_features_from_other_inputs_are_refused(run, tiny_target, tiny_target_dir, tmp_path):
    from eagle3kit.data.tokenize import load_shard

    cfg = cfg_for(run, tiny_target_dir)
    run_extract(cfg, run, tiny_target, out_dir=str(tmp_path / "f"))
    samples = [Sample(i, m) for i, m in load_shard(run / "tokens.safetensors")]
    with pytest.raises(ConfigError, match=r"aux_layer_ids: features \[2, 4, 5\], this run \[1, 4, 5\]"):
        load_features(tmp_path / "f", samples, {"aux_layer_ids": [1, 4, 5]}, tiny_target, torch.device("cpu"))
    with pytest.raises(ConfigError, match="holds 12 samples of 11"):
        load_features(tmp_path / "f", samples[:11], {}, tiny_target, torch.device("cpu"))


# ---- bad inputs (an attacker's findings): every one stops with a message naming the file and the fix
def _samples(run):
    from eagle3kit.data.tokenize import load_shard

    return [Sample(i, m) for i, m in load_shard(run / "tokens.safetensors")]


def _load(folder, run, tiny_target):
    return load_features(folder, _samples(run), {}, tiny_target, torch.device("cpu"))


def test_a_damaged_or_missing_shard_is_named_and_a_rerun_re_extracts_it(
    run, tiny_target, tiny_target_dir, tmp_path
):
    from eagle3kit.core.rundir import DataError

    cfg = cfg_for(run, tiny_target_dir, shard_tokens=60)
    f = tmp_path / "f"
    run_extract(cfg, run, tiny_target, out_dir=str(f))
    want = sha256_tensors(f / "shard-00002.safetensors")
    data = (f / "shard-00002.safetensors").read_bytes()
    (f / "shard-00002.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(
        DataError, match=r"shard-00002.safetensors is damaged .*rerun `eagle3kit extract --out"
    ):
        _load(f, run, tiny_target)
    (f / ".tmpWtbFAY").write_bytes(b"x" * 100)  # safetensors' own partial write
    again = run_extract(cfg, run, tiny_target, out_dir=str(f))
    assert again["samples"] == 12 and sha256_tensors(f / "shard-00002.safetensors") == want
    assert not (f / ".tmpWtbFAY").exists()
    (f / "shard-00003.safetensors").unlink()
    with pytest.raises(DataError, match="shard-00003.safetensors is missing"):
        _load(f, run, tiny_target)
    run_extract(cfg, run, tiny_target, out_dir=str(f))
    _load(f, run, tiny_target)  # whole again
    assert oct((f / "shard-00003.safetensors").stat().st_mode & 0o777) == "0o644"


def test_a_shard_from_another_run_or_an_edited_index_is_refused(run, tiny_target, tiny_target_dir, tmp_path):
    import json

    from eagle3kit.core.rundir import DataError

    cfg = cfg_for(run, tiny_target_dir, shard_tokens=60)
    f = tmp_path / "f"
    run_extract(cfg, run, tiny_target, out_dir=str(f))
    other = RunDir(tmp_path / "other")  # the same lengths, other tokens
    from eagle3kit.data.tokenize import load_shard

    save_shard(
        other / "tokens.safetensors",
        [((ids + 1).tolist(), m.int().tolist()) for ids, m in load_shard(run / "tokens.safetensors")],
    )
    shutil.copy(run / "vocab.safetensors", other / "vocab.safetensors")
    g = tmp_path / "g"
    run_extract(cfg_for(other, tiny_target_dir, shard_tokens=60), other, tiny_target, out_dir=str(g))
    shutil.copy(g / "shard-00001.safetensors", f / "shard-00001.safetensors")
    with pytest.raises(DataError, match="shard-00001.safetensors was made from other inputs"):
        _load(f, run, tiny_target)
    index = json.loads((f / "index.json").read_text())
    for bad, msg in (
        ({}, "not an eagle3kit feature index"),
        ([], "not an eagle3kit feature index"),
        (
            {
                **index,
                "shards": [{**index["shards"][0], "file": "../../evil.safetensors"}] + index["shards"][1:],
            },
            "not a shard-NNNNN.safetensors file",
        ),
        (
            {**index, "shards": index["shards"][:1] + index["shards"]},
            "starts at sample 0, the entries before it end at",
        ),
    ):
        (f / "index.json").write_text(json.dumps(bad))
        with pytest.raises(DataError, match=msg):
            _load(f, run, tiny_target)
        with pytest.raises(DataError, match=msg):
            run_extract(cfg, run, tiny_target, out_dir=str(f))


def test_nan_in_stored_features_or_in_the_target_stops_with_the_place(
    run, tiny_target, tiny_target_dir, tmp_path
):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eagle3kit.core.rundir import DataError

    cfg = cfg_for(run, tiny_target_dir, shard_tokens=60)
    f = tmp_path / "f"
    run_extract(cfg, run, tiny_target, out_dir=str(f))
    p = f / "shard-00001.safetensors"
    with safe_open(str(p), "pt") as h:
        meta = h.metadata()
    t = load_file(str(p))
    t["aux"][3, 1, 7] = float("nan")
    save_file(t, str(p), metadata=meta)
    with pytest.raises(DataError, match="shard-00001.safetensors holds NaN or inf"):
        _load(f, run, tiny_target)
    layer = tiny_target.parts.layers[3].mlp.down_proj.weight
    keep = layer.detach().clone()
    try:
        with torch.no_grad():
            layer[0, 0] = float("inf")
        with pytest.raises(DataError, match=r"not finite \(NaN or inf\) in samples 0…"):
            run_extract(cfg, run, tiny_target, out_dir=str(tmp_path / "g"))
    finally:
        with torch.no_grad():
            layer.copy_(keep)


def test_option_and_folder_refusals(run, tiny_target, tiny_target_dir, tmp_path):
    from eagle3kit.core.rundir import DataError, folder_lock

    with pytest.raises(
        ConfigError, match=rf"topk:1000 asks for more logits than the draft vocabulary holds \({VD}\)"
    ):
        run_extract(
            cfg_for(run, tiny_target_dir, teacher="topk:1000"), run, tiny_target, out_dir=str(tmp_path / "k")
        )
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="afile is a file; give a folder"):
        run_extract(cfg_for(run, tiny_target_dir), run, tiny_target, out_dir=str(tmp_path / "afile"))
    (tmp_path / "busy").mkdir()
    with folder_lock(tmp_path / "busy", "extract", "give another --out"):
        with pytest.raises(DataError, match=r"another `eagle3kit extract` \(pid \d+\) is writing"):
            run_extract(cfg_for(run, tiny_target_dir), run, tiny_target, out_dir=str(tmp_path / "busy"))
    with pytest.raises(ConfigError, match="is not a folder"):
        load_features(tmp_path / "nope", _samples(run), {}, tiny_target, torch.device("cpu"))
    empty = RunDir(tmp_path / "empty")
    save_shard(empty / "tokens.safetensors", [])
    with pytest.raises(DataError, match="holds no samples"):
        run_extract(cfg_for(empty, tiny_target_dir), empty, tiny_target, out_dir=str(tmp_path / "e"))


def test_a_target_with_only_pickled_weights_is_refused(tmp_path):
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target_files import locate_target

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(
        ConfigError,
        match=r"only pickled weights \(\*.bin\); eagle3kit loads weights from safetensors or GGUF",
    ):
        locate_target(TargetConfig(model=str(tmp_path)))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_stored_states_no_target_computes_are_refused_naming_shard_sample_and_layer(
    run, tiny_target, tiny_target_dir, tmp_path, dtype
):
    """A shard whose aux layer is all zero, or whose teacher state is one vector at every token, in one
    sample: train's reader stops there, naming the shard, the sample and the layer, before any step."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eagle3kit.core.rundir import DataError

    cfg = cfg_for(run, tiny_target_dir, shard_tokens=60, dtype=dtype)
    f = tmp_path / "f"
    run_extract(cfg, run, tiny_target, out_dir=str(f))
    _load(f, run, tiny_target)  # as extracted: read
    p = f / "shard-00001.safetensors"
    with safe_open(str(p), "pt") as h:
        meta = h.metadata()
    t = load_file(str(p))
    a, b = int(t["offsets"][1]), int(t["offsets"][2])  # the shard's second sample
    first = json.loads((f / "index.json").read_text())["shards"][1]["first_sample"]
    zeroed = {**t, "aux": t["aux"].clone()}
    zeroed["aux"][a:b, 1] = 0
    save_file(zeroed, str(p), metadata=meta)
    with pytest.raises(
        DataError, match=rf"shard-00001.safetensors: sample {first + 1}: aux layer 4 is all zero"
    ):
        _load(f, run, tiny_target)
    repeated = {**t, "last": t["last"].clone()}
    repeated["last"][a:b] = t["last"][a]
    if dtype == "fp8":
        repeated["last_scale"] = t["last_scale"].clone()
        repeated["last_scale"][a:b] = t["last_scale"][a]
    save_file(repeated, str(p), metadata=meta)
    with pytest.raises(DataError, match="the last layer \\(teacher\\) is one vector repeated"):
        _load(f, run, tiny_target)

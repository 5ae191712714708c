"""Real model families' chat templates (tests/fixtures/chat_templates) on a small real tokenizer.

Each family's template is set on the bundled tiny-math-lm byte-level BPE tokenizer, with that family's control
tokens added as special tokens (and its tag words, e.g. Qwen's <tool_call>, as plain added tokens, as the real
vocabularies have them), so renders tokenize as the real tokenizer would split them at every special token.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from grpo.model.loading import bundled_model_path

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# family: (template file, bos, eos, other special tokens, plain added tokens)
FAMILIES = {
    "qwen2.5": (
        "qwen2.5-instruct.jinja",
        None,
        "<|im_end|>",
        ["<|im_start|>", "<|endoftext|>"],
        ["<tool_call>", "</tool_call>"],
    ),
    "qwen3": (
        "qwen3.jinja",
        None,
        "<|im_end|>",
        ["<|im_start|>", "<|endoftext|>"],
        ["<tool_call>", "</tool_call>", "<think>", "</think>"],
    ),
    "llama3.2": (
        "llama3.2-instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
        [],
    ),
    "llama3.3": (
        "llama3.3-instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
        [],
    ),
    "mistral-nemo": (
        "mistral-nemo-instruct-2407.jinja",
        "<s>",
        "</s>",
        [
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        [],
    ),
    "mistral-small-3.2": (
        "mistral-small-3.2-24b-instruct-2506.jinja",
        "<s>",
        "</s>",
        [
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[CALL_ID]",
            "[ARGS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[TOOL_CONTENT]",
            "[/TOOL_RESULTS]",
            "[IMG]",
        ],
        [],
    ),
}


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    template, bos, eos, specials, plain = FAMILIES[family]
    backend = Tokenizer.from_file(str(Path(bundled_model_path()) / "tokenizer.json"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        additional_special_tokens=specials,
        chat_template=(TEMPLATES / template).read_text(),
    )
    tokenizer.add_tokens(plain)
    return tokenizer


def bundled_tokenizer():
    return AutoTokenizer.from_pretrained(bundled_model_path())

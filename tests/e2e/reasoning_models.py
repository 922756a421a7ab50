"""Small random-weight models that write the reasoning formats' markers as tokens, for the e2e
tests: the tiny-gpt-oss preset with harmony's special tokens and a harmony chat template, and
tiny-qwen3 with `<think>` / `</think>` added tokens and a template that opens `<think>` unless
`enable_thinking` is false (DeepSeek-R1's way; Qwen3's switch)."""

from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import AddedToken

from tandem.loaders.tokenizer_build import build_byte_bpe, word_token_ids
from tandem.loaders.writer import write_model_dir
from tandem.models.presets import get_preset, hot_rows, random_weights
from tandem.server import harmony

BPE_TOKENS = 512  # the presets' own byte-level BPE; the markers get the ids after it
VOCAB = 528

HARMONY_TEMPLATE = (
    "{%- if reasoning_effort is defined -%}"
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>"
    "{%- endif -%}"
    "{%- if tools -%}<|start|>developer<|message|># Tools {{ tools | tojson }}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
THINK_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}<think>\n\n</think>\n\n"
    "{%- else -%}<think>\n{%- endif -%}{%- endif -%}"
)


def write_model(
    out: Path,
    preset: str,
    special: list[str],
    added: list[str],
    template: str,
    eos: list[str],
    context: int | None = None,
):
    tok = build_byte_bpe(BPE_TOKENS)
    hot = word_token_ids(tok)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    config = replace(
        get_preset(preset).config,
        vocab_size=VOCAB,
        eos_token_ids=tuple(tok.token_to_id(t) for t in eos),
        torch_dtype="float32",
    )
    if context is not None:  # room for a long template's prompt (the presets hold 512)
        config = replace(config, max_position_embeddings=context)
    tensors = random_weights(config, 0, torch.float32, hot_rows(config, hot))
    tokenizer_config = {"eos_token": eos[0], "bos_token": None, "chat_template": template}
    write_model_dir(
        out, config, tensors, tokenizer_json=tok.to_str(), tokenizer_config=tokenizer_config
    )
    return out


def harmony_model(out: Path) -> Path:
    """gpt-oss's layout writing harmony: `<|return|>` and `<|call|>` end a generation."""
    return write_model(
        out, "tiny-gpt-oss", list(harmony.MARKERS), [], HARMONY_TEMPLATE, ["<|return|>", "<|call|>"]
    )


def think_model(out: Path) -> Path:
    """Qwen3's layout with `<think>` tokens, ending on `<|im_end|>`."""
    return write_model(
        out,
        "tiny-qwen3",
        [],
        ["<think>", "</think>"],
        THINK_TEMPLATE,
        ["<|im_end|>", "<|endoftext|>"],
    )

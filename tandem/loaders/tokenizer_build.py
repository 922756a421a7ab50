"""A small byte-level BPE tokenizer with a ChatML chat template, built offline and deterministically
(trained on a fixed text below), for the random-weight presets."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the model runs on every machine we own.
One language model spread across a laptop, a desktop with a graphics card and a small server,
talking over ordinary Ethernet: the head tokenizes the prompt, the workers compute their share of
every layer, and the ring adds the partial sums in the same order on every rank.
Hello, world! How are you today? I am fine, thank you, and you?
Once upon a time there was a little robot who wanted to learn how to write stories about the sea,
the mountains, the forest and the city. Every morning it read a book, and every evening it wrote
a page. The sun rose over the hills and the river ran down to the sea.
def generate(model, prompt, max_tokens=16): return model.sample(prompt, max_tokens)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828; symbols: + - * / = < > ( ) [ ] { } # @ !
"""


def build_byte_bpe(vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of at most `vocab_size` tokens (fewer if the text runs out of merges)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    return tok


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 32768,
    }


def word_token_ids(tok: HFTokenizer) -> list[int]:
    """Ids of tokens that decode to a word piece of >= 2 letters (optionally space-led), by id: the
    rows a preset makes likely, so random models print readable word soup."""
    out = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i])
        if len(text.strip()) >= 2 and text.strip().isalpha():
            out.append(i)
    return out

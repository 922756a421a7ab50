"""The text weights of a multimodal checkpoint (`Gemma3ForConditionalGeneration`,
`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`), under the text
model's names; the vision tower's (and Qwen3.5's multi-token-prediction `mtp.*`) tensors are left
unread. A family declares `checkpoint_renames=text_weight_names` (`base.Family`)."""

from __future__ import annotations

from collections.abc import Collection

# a multimodal checkpoint's text weights -> the text model's names (transformers >= 4.52 writes
# `model.language_model.`, Gemma 3's released files `language_model.model.`)
TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "lm_head.": "lm_head.",
}


def text_weight_names(names: Collection[str]) -> dict[str, str]:
    """The text model's name -> the checkpoint's, for a multimodal checkpoint's text weights
    (`TEXT_PREFIXES`); empty for a text-only checkpoint (its names are the model's)."""
    if not any(n.startswith(("model.language_model.", "language_model.")) for n in names):
        return {}
    out = {}
    for n in names:
        for prefix, ours in TEXT_PREFIXES.items():
            if n.startswith(prefix):
                out[ours + n[len(prefix) :]] = n
                break
    return out

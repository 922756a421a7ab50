"""The typed errors every model source raises (safetensors folders, GGUF files), torch-free so
that the GGUF reader and the torch-free single-node path can raise them too."""

from __future__ import annotations


class ModelFileError(ValueError):
    """Base of every error about a model directory's files; the message names file and tensor."""


class MissingFileError(ModelFileError):
    """A file the directory needs is absent or unreadable."""


class CorruptFileError(ModelFileError):
    """A file whose bytes are not what its format says: bad header, truncated data, bad offsets."""


class MissingTensorError(ModelFileError):
    """The model needs a tensor that no file in the directory holds."""


class TensorShapeError(ModelFileError):
    """A tensor's stored shape differs from the one the config implies."""


class TensorDtypeError(ModelFileError):
    """A tensor stored in a dtype the model cannot take (weights must be F32, F16 or BF16)."""


class ChatTemplateError(ModelFileError):
    """The model has no chat template, or the template failed to render."""


class ChatTemplateRefused(ChatTemplateError):
    """The template itself refused the messages (its `raise_exception(...)`)."""


class TemplateLimitError(ChatTemplateError):
    """Rendering the template went past one of its bounds; `limit` names which: "time",
    "output" (characters of the rendered prompt) or "memory"."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class ModelFileChangedError(ModelFileError):
    """A model file changed (truncated, replaced, rewritten) since this process opened it: its
    mapped bytes are not the model's any more, and reading one past the new end is a SIGBUS."""

"""`tandem --help` names every architecture the loaders run (HF and GGUF), Phi-3 among them."""

from tandem.cli.main import MODELS_EPILOG, build_parser
from tandem.config import SUPPORTED_ARCHITECTURES
from tandem.loaders.gguf.config import ARCHITECTURES


def test_help_names_every_supported_hf_and_gguf_architecture():
    text = build_parser().format_help()
    assert "Phi-3" in text and MODELS_EPILOG.split(";")[0][:40] in text
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in MODELS_EPILOG
    gguf_part = MODELS_EPILOG.split("GGUF files of architecture")[1]
    assert {a.strip() for a in gguf_part.split(",")} == set(ARCHITECTURES)

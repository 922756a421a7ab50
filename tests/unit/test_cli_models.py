"""`tandem --help` names every architecture the loaders run (HF and GGUF): each family's."""

from tandem.cli.main import build_parser, models_supported
from tandem.models import families


def test_help_names_every_supported_hf_and_gguf_architecture():
    text = " ".join(build_parser().format_help().split())
    epilog = models_supported()
    assert " ".join(epilog.split()) in text
    for name in ("Phi-3", "Gemma 3", *families.supported_architectures()):
        assert name in epilog
    gguf_part = epilog.split("GGUF files of architecture")[1]
    assert {a.strip() for a in gguf_part.split(",")} == set(families.GGUF_ARCHITECTURES)

"""The head (generation loop, scheduler, sampling, step types), the CLI up to the layout, the
server and the model loaders import without torch, so a torch-free executor's process never
pays for it."""

import subprocess
import sys

TORCH_FREE = (
    "tandem.engine.executor",
    "tandem.engine.sampling_params",
    "tandem.engine.logits_process",
    "tandem.engine.grammar",
    "tandem.engine.scheduler",
    "tandem.engine.sequences",
    "tandem.engine.generate",
    "tandem.engine.serving",
    "tandem.engine.recovery",
    "tandem.engine.build",
    "tandem.cli.main",
    "tandem.cli.generate",
    "tandem.cli.serve",
    "tandem.cli.engine_factory",
    "tandem.cli.layout_args",
    "tandem.cli.tp_args",
    "tandem.devices",
    "tandem.loaders.source",
    "tandem.loaders.tokenizer",
    "tandem.loaders.safetensors_dir",
    "tandem.loaders.gguf.model_file",
    "tandem.loaders.gguf.quantized_dir",
    "tandem.models.slots",
    "tandem.server.app",
    "tandem.server.cluster_view",
    "tandem.server.forming",
    "tandem.server.http_limits",
    "tandem.server.metrics",
    "tandem.server.ollama",
    "tandem.server.ollama_protocol",
    "tandem.server.generation",
    "tandem.server.structured",
    "tandem.server.tools",
    "tandem.server.logprobs",
    "tandem.server.page",
    "tandem.server.protocol",
)


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_head_imports_without_torch() -> None:
    _run(
        f"import sys; import {', '.join(TORCH_FREE)}; "
        "assert 'torch' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith('torch'))[:5]"
    )


def test_the_launch_supervisor_imports_neither_numpy_nor_torch() -> None:
    """`tandem launch` only starts, watches and stops processes: it pays for no array library."""
    _run(
        "import sys\n"
        "from tandem.cli.main import build_parser, command_named\n"
        "argv = ['launch', '--tp', '2']\n"
        "args = build_parser(command_named(argv)).parse_args(argv)\n"
        "import tandem.cli.launch, tandem.engine.group_state\n"
        "assert args.tp == 2\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch'))\n"
        "assert not heavy, heavy[:5]"
    )


def test_sampling_and_a_numpy_step_run_without_torch() -> None:
    _run(
        "import sys; import numpy as np\n"
        "from tandem.devices import cpu_flags, host_has_accelerator\n"
        "from tandem.engine.executor import StepResult\n"
        "from tandem.engine.sampling_params import SamplingParams, make_generator\n"
        "from tandem.engine.sequences import SequenceCache\n"
        "r = StepResult(logits=np.array([[0.0, 2.0, 1.0]], dtype=np.float32))\n"
        "assert r.pick(0, SamplingParams(temperature=0.7, seed=3), make_generator(3)) in (0, 1, 2)\n"
        "assert r.ids().tolist() == [1]\n"
        "assert isinstance(host_has_accelerator(), bool) and isinstance(cpu_flags(), frozenset)\n"
        "assert SequenceCache(2, 16).check_rows([7], [0], [3]) == [0]\n"
        "assert 'torch' not in sys.modules"
    )


def test_the_cli_parses_a_generate_line_without_torch() -> None:
    _run(
        "import sys\n"
        "from tandem.cli.main import build_parser, command_named\n"
        "argv = ['generate', '--prompt-ids', '1,2', '--temperature', '0.5']\n"
        "args = build_parser(command_named(argv)).parse_args(argv)\n"
        "assert args.command == 'generate' and args.temperature == 0.5\n"
        "assert 'torch' not in sys.modules"
    )


def test_opening_a_model_and_its_tokenizer_needs_no_torch(tmp_path) -> None:
    from tandem.builtin import default_model_dir
    from tandem.loaders.gguf.writer import write_preset_gguf

    _, (gguf,) = write_preset_gguf(tmp_path / "tiny.gguf", "tiny-llama", "Q8_0", seed=3)
    for path, quantize in (
        (default_model_dir(), None),
        (default_model_dir(), "q8_0"),
        (gguf, None),
    ):
        _run(
            "import sys\n"
            "from tandem.loaders.source import open_model\n"
            f"src = open_model({str(path)!r}, {quantize!r})\n"
            "tok = src.tokenizer()\n"
            "assert src.config.vocab_size > 0 and src.fingerprint()\n"
            "assert tok is None or tok.encode_prompt('a b')\n"
            "assert 'torch' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('torch'))[:5]"
        )


def test_a_grammar_mask_is_built_and_applied_without_torch() -> None:
    _run(
        "import sys\n"
        "from tandem.engine.grammar import GrammarSpec, GrammarVocab\n"
        "tokens = [b'<eos>'] + [bytes([i]) for i in range(1, 128)]\n"
        "vocab = GrammarVocab(tokens, [0], lambda s: [ord(c) for c in s], [0])\n"
        "mask = vocab.mask(GrammarSpec('json'))\n"
        "assert mask.allowed().nonzero()[0].tolist() == [ord('{')]\n"
        "assert 'torch' not in sys.modules and 'llguidance' in sys.modules"
    )

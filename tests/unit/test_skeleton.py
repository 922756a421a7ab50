import subprocess
import sys

import torch
from tp_support import tiny_config

from tandem.models.llama import Transformer
from tandem.models.skeleton import skeleton


def test_a_skeleton_is_on_meta_and_builds_without_importing_dynamo():
    code = (
        "import sys, torch\n"
        "from tandem.models.skeleton import skeleton\n"
        "from tandem.models.llama import Transformer\n"
        "from tandem.models.presets import get_preset\n"
        "with skeleton():\n"
        "    m = Transformer(get_preset('tiny-qwen3').config)\n"
        "assert all(p.is_meta for p in m.parameters())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_initializers_outside_a_skeleton_still_run():
    with skeleton():
        Transformer(tiny_config())
    torch.manual_seed(0)
    w = torch.nn.Embedding(8, 4).weight
    assert float(w.abs().sum()) > 0

"""GGUF files that llama.cpp's own converter made from transformers' Qwen3.5 hybrids (dense and
MoE, F32: `scripts/bench/qwen35_llamacpp.py --record`) against llama.cpp's greedy ids on them,
recorded beside each file when it was made (`tests/llamacpp_recorded.py`; CI has no llama.cpp):
tandem reads the converter's layout (v heads tiled, A stored as -exp(A_log), the norms, the gated
query rows, the experts and the shared expert's gate) as llama.cpp runs it, and decodes its ids.
(tests/distributed/test_qwen35_processes.py does the same at TP=2 and over a pipeline.)

Shapes (the script's `tiny-qwen35` / `tiny-qwen35moe`): 4 layers, Gated DeltaNet on 0-2 (2 q/k
heads of 32 serving 4 v heads of 32: llama.cpp reads only k and v heads of one width), gated
attention on 3 (2 q / 1 kv heads of 64, 16 of them rotary); the MoE 4 experts of 64, top 2, and a
shared expert. In F32 both engines multiply the stored floats: only summation order differs,
far below the spread weights' top-2 gaps.
"""

from __future__ import annotations

import pytest
import torch
from llamacpp_recorded import CONVERTER_FILES, recorded
from tp_support import greedy

from tandem.engine.local import LocalExecutor


@pytest.mark.parametrize("name", CONVERTER_FILES)
def test_tandem_decodes_llama_cpps_greedy_ids_on_the_converters_file(name):
    """Both recorded prompts decoding together on the torch path (`tandem generate --device cpu`
    on an F32 file): llama.cpp's 32 ids after each."""
    f, prompts, want = recorded(name)
    ex = LocalExecutor.from_dir(f, dtype=torch.float32, max_batch=len(prompts), max_seq_len=64)
    assert greedy(ex, prompts, len(want[0]), on_ranks=True)[0] == want

"""`tandem serve --max-seq-len 16777216` on one node: a one-line refusal naming the KV cache's
bytes and what to lower, with the memory flat, instead of numpy's "22.5 TiB" traceback."""

import threading
from dataclasses import replace

import psutil
from serve_support import TANDEM, output, spawn

from tandem.cluster.launcher import free_ports
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import get_preset

HUGE = 1 << 24


def test_serve_refuses_a_context_past_free_memory_in_one_line(tmp_path):
    config = replace(get_preset("tiny-qwen3").config, max_position_embeddings=HUGE)
    _, (f,) = write_preset_gguf(tmp_path / "long.gguf", "tiny-qwen3", "Q8_0", config=config)
    (port,) = free_ports(1)
    proc = spawn(
        [*TANDEM, "serve", "--model", str(f), "--max-seq-len", str(HUGE), "--port", str(port)]
    )
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            try:
                peak[0] = max(peak[0], psutil.Process(proc.pid).memory_info().rss)
            except psutil.Error:
                return

    threading.Thread(target=sample, daemon=True).start()
    try:
        code = proc.wait(60)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
    text = output(proc)
    assert code == 2, text[-2000:]
    assert "tandem serve: error: the model does not fit this node" in text
    assert "of KV cache for 8 sequences of 16777216 positions" in text and "--max-seq-len" in text
    assert "Traceback" not in text
    assert peak[0] < 400 << 20, peak[0]

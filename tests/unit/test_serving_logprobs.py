"""`ServingEngine.generate` with logprobs over byte tokens: a character split over two tokens is
shown once whole and both tokens come with it at its offset, with their exact bytes; a stop string
drops the tokens whose text starts past the cut; the tokens' bytes always join to the text."""

import threading

import numpy as np
from _serving_doubles import HistoryExecutor

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.logprobs import chat_logprobs, completion_logprobs


class ByteTokenizer:
    """One token per byte; text is the bytes as UTF-8 (a split character decodes to U+FFFD)."""

    def encode(self, text):
        return list(text.encode())

    def encode_prompt(self, text):
        return self.encode(text)

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id):
        return bytes([token_id])


class Script:
    """A token mask that allows one scripted token per step."""

    def __init__(self, text):
        self.ids = list(text.encode())
        self.at = 0

    def allowed(self):
        keep = np.zeros(256, dtype=bool)
        keep[self.ids[self.at]] = True
        return keep

    def advance(self, token):
        self.at += 1


def _run(text, stop=(), **params):
    sched = Scheduler(HistoryExecutor(vocab=256, max_seq_len=64))
    engine = ServingEngine(sched, ByteTokenizer(), "m")
    deltas, result, done = [], {}, threading.Event()

    def on_done(c, e):
        result.update(c=c, e=e)
        done.set()

    p = SamplingParams(max_tokens=len(text.encode()), temperature=0, logprobs=1, **params)
    engine.generate([1, 2], p, stop, deltas.append, on_done, mask=Script(text))
    while sched.step():
        pass
    assert done.wait(5) and result["e"] is None
    return engine, deltas, result["c"]


def test_a_split_character_is_shown_once_whole_with_both_tokens_at_its_offset():
    engine, deltas, c = _run("aé€b")
    assert [d.text for d in deltas] == ["a", "é", "€", "b"]
    assert [[t.offset for t in d.tokens] for d in deltas] == [[0], [1, 1], [2, 2, 2], [3]]
    assert c.text == "aé€b" and len(c.tokens) == len("aé€b".encode())
    entries = chat_logprobs(engine.token_bytes, c.tokens)["content"]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == c.text
    assert entries[1]["token"] == "bytes:\\xc3" and entries[1]["bytes"] == [0xC3]
    assert all(e["logprob"] == 0.0 for e in entries)  # the mask left one token each step
    legacy = completion_logprobs(engine.token_bytes, c.tokens)
    assert legacy["text_offset"] == [0, 1, 1, 2, 2, 2, 3]


def test_a_stop_string_drops_the_tokens_that_start_past_the_cut():
    _, deltas, c = _run("abcXYZdef", stop=("YZ",))
    assert c.text == "abcX" and c.finish_reason == "stop"
    assert [t.logprobs.token for t in c.tokens] == list(b"abcX")
    assert [t for d in deltas for t in d.tokens] == c.tokens
    _, _, held = _run("abcXYZdef", stop=("XYQ",))  # a partial match held back, then let go
    assert held.text == "abcXYZdef" and [t.logprobs.token for t in held.tokens] == list(
        b"abcXYZdef"
    )

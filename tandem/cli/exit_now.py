"""How a long-lived command's process ends: its own cleanup done, then `os._exit(code)`.

A `tandem worker` told STOP spent 0.35-0.5 s of CPU (a `serve --tp 2` head ~0.9 s) after its last
useful act in the interpreter's teardown (modules, torch's objects and thread pools freed one by
one, no syscall among them), and so did every stage, rank and head at every shutdown. By the
time a command's `run` returns, it has done the cleanup that matters (its sockets closed, its
workers stopped, its context managers exited, shared memory released). What is left is flushed here (every log handler, stdout
and stderr), and then the process ends at once: the kernel frees its memory, mappings and file
descriptors; a chat-template sandbox it started reads end-of-file on its stdin and exits.

Only the command line does this (`tandem.cli.main.main` when it reads `sys.argv`); `main(argv)`
called from Python (tests, scripts) returns as before. No code of tandem registers `atexit`
handlers; the `weakref.finalize` callbacks it has (a KV page map's munmap, a sandbox's stdin
close) only release what process exit releases anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flushes the logs and the standard streams, then ends the process with `code` without the
    interpreter's teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing left to flush
            if stream is not None:
                stream.flush()
    os._exit(code)

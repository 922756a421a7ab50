"""The epoch a joined cluster's head is forming, carried to the workers on the status board.

A joined head (`cluster join` rank 0, serving with `--reform-timeout`) that loses a worker
re-forms its ring under epoch e+1 (`tandem.engine.recovery`): its handshake claims the token's
cluster id with the epoch in it (`ring_config.epoch_cluster_id`), so the returning worker must
claim the same one. While it re-forms, the head's `/health` says "re-forming (epoch e+1): why".
The `cluster join` process of rank 0, which runs the board, reads `/health` every POLL_S and
writes the highest epoch it has seen formed onto rank 0's row, next to the head's random `head`
id. A group can only reach epoch e+1 through a re-form that waits for the returning worker,
which reads the epoch from the board first, so the board always shows it in time. A worker's
`cluster join` reads both over the board's authenticated channel:

    first worker process         the row's epoch (0 before any re-form: a new head)
    after its worker exited      wait until the row shows another head (a new head: its epoch)
                                 or the same head forming an epoch above the one last served
    while its worker runs        the same head forming a higher epoch has given this worker up
                                 (it hung, or its links died unseen): end it and join that epoch
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from tandem.cluster.status import StatusBoard, StatusError, query
from tandem.cluster.token import ClusterTopology

POLL_S = 0.5
_FORMING = re.compile(r"^re-forming \(epoch (\d+)\)")  # `engine.recovery`'s health detail


def forming_epoch(detail: str) -> int | None:
    """The epoch a head is forming, from its `/health` detail; None unless it is re-forming."""
    m = _FORMING.match(detail)
    return int(m.group(1)) if m else None


def health_detail(url: str, timeout_s: float = 2.0) -> str:
    """The detail of the head's `/health` at `url` (200 or 503), or "" when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            body = r.read(1 << 16)
    except urllib.error.HTTPError as e:
        body = e.read(1 << 16)
    except (OSError, ValueError):
        return ""
    try:
        detail = json.loads(body or b"{}").get("detail", "")
    except (ValueError, AttributeError):
        return ""
    return detail if isinstance(detail, str) else ""


def publish_epochs(board: StatusBoard, url: str, stop: threading.Event) -> threading.Thread:
    """A daemon thread: every POLL_S until `stop`, the highest epoch the head at `url` (its
    `/health`) has been seen forming onto rank 0's row of `board`."""

    def run() -> None:
        seen = 0
        while not stop.wait(POLL_S):
            epoch = forming_epoch(health_detail(url))
            if epoch is not None and epoch > seen:
                seen = epoch
                board.update(0, epoch=epoch)

    t = threading.Thread(target=run, name="tandem-epoch-publish", daemon=True)
    t.start()
    return t


def health_url(host: str, port: int) -> str:
    """The head's `/health` as this machine reaches it (a wildcard bind: over loopback)."""
    near = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"http://{near}:{port}/health"


def head_epoch(topo: ClusterTopology) -> tuple[str, int]:
    """(the head's id, the epoch to join) from rank 0's row of the board; StatusError when the
    board does not answer."""
    snap = query(topo.hosts[0], topo.status_port, topo.secret)
    row = next((r for r in snap.get("ranks", []) if r.get("rank") == 0), {})
    epoch = row.get("epoch")
    return str(row.get("head", "")), epoch if type(epoch) is int and epoch >= 0 else 0


def next_epoch(
    topo: ClusterTopology,
    served: tuple[str, int] | None,
    stop: threading.Event | None = None,
    poll_s: float = 0.25,
) -> tuple[str, int]:
    """(head id, epoch) to join: at once the first time (`served` None), else once the board
    shows another head or the same head forming an epoch above the one served (see the module
    docstring). Waits while the board does not answer (the head may be down)."""
    while stop is None or not stop.is_set():
        try:
            head, epoch = head_epoch(topo)
        except StatusError:
            head, epoch = "", -1
        if epoch >= 0 and (served is None or head != served[0] or epoch > served[1]):
            return head, epoch
        time.sleep(poll_s)
    raise KeyboardInterrupt


def superseded(
    topo: ClusterTopology, served: tuple[str, int], every_s: float = 1.0
) -> Callable[[], bool]:
    """A check, cheap to call often (it asks the board at most every `every_s`): has the head
    that `served` names moved on to a higher epoch, without the worker of `served`?"""
    last = [-math.inf]

    def check() -> bool:
        now = time.monotonic()
        if now - last[0] < every_s:
            return False
        last[0] = now
        try:
            head, epoch = head_epoch(topo)
        except StatusError:
            return False  # the head may be down: its worker leaves by itself
        return head == served[0] and epoch > served[1]

    return check

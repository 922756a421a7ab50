"""Each rank's join-time probe on the cluster's status board, and its cells in `cluster status`.

The probe is measured inside the head's serving process as the TP group forms (`engine.tp.probe`)
and shown by its `GET /v1/cluster`. The `cluster join` process of rank 0, which runs the board and
started that server, reads the view once it answers and copies each rank's probe onto the board's
row for that rank, so `tandem cluster status` (and `tandem plan --from-cluster`) see it over the
board's authenticated channel.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from typing import Any

from tandem.cluster.status import StatusBoard

POLL_S = 1.0
PROBE_COLUMNS = ("GEMV GB/s", "free GB", "all-reduce", "goodput")


def probes_from_view(view: dict[str, Any]) -> dict[int, dict[str, float]]:
    """rank -> probe of every rank in a `/v1/cluster` document that has one."""
    out = {}
    for row in view.get("ranks") or []:
        if isinstance(row, dict) and isinstance(row.get("probe"), dict):
            out[int(row["rank"])] = row["probe"]
    return out


def _view(url: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    req = urllib.request.Request(url)
    key = os.environ.get("TANDEM_API_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read(1 << 20))
    except (OSError, ValueError, urllib.error.URLError):
        return None


def publish_probes(board: StatusBoard, url: str, stop: threading.Event) -> threading.Thread:
    """A daemon thread: polls the head's cluster view at `url` every POLL_S until it shows the
    probes (or `stop` is set), then puts each rank's probe on its board row."""

    def run() -> None:
        while not stop.wait(POLL_S):
            probes = probes_from_view(_view(url) or {})
            if probes:
                for rank, probe in probes.items():
                    board.update(rank, probe=probe)
                return

    t = threading.Thread(target=run, name="tandem-probe-publish", daemon=True)
    t.start()
    return t


def view_url(host: str, port: int) -> str:
    """The head's cluster view as this machine reaches it (a wildcard bind: over loopback)."""
    near = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"http://{near}:{port}/v1/cluster"


def probe_cells(info: dict[str, Any]) -> tuple[str, str, str, str]:
    """A status row's probe cells (PROBE_COLUMNS); dashes until the group has formed."""
    p = info.get("probe")
    if not isinstance(p, dict):
        return ("-", "-", "-", "-")
    return (
        f"{p.get('gemv_gb_s', 0):.2f}",
        f"{p.get('free_gb', 0):.2f}",
        f"{p.get('allreduce_ms', 0):.3f} ms",
        f"{p.get('goodput_mbit_s', 0):.0f} Mbit/s",
    )

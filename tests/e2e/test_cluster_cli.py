"""`tandem cluster init / join / status` across real processes on loopback."""

import json
import socket
import subprocess
import sys
import time

import pytest

from tandem.cluster.launcher import free_port_block
from tandem.cluster.status import StatusAuthError, StatusBoard, announce, query
from tandem.cluster.token import decode_token, encode_token, new_topology

TANDEM = [sys.executable, "-m", "tandem"]


def _cli(*args, timeout=60):
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=timeout)


def test_cluster_init_prints_a_token_that_join_and_status_accept(tmp_path):
    base = free_port_block(4)
    out = _cli(
        "cluster",
        "init",
        "--hosts",
        "127.0.0.1,127.0.0.1",
        "--base-port",
        str(base),
        "--write-configs",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip().splitlines()[-1]
    topo = decode_token(token)
    assert topo.world_size == 2 and topo.base_port == base
    assert "█" in out.stdout  # the QR code
    ring1 = json.loads((tmp_path / "ring1.json").read_text())
    assert ring1["rank"] == 1 and ring1["right_port"] == base and ring1["secret"] == topo.secret
    assert (tmp_path / "ring0.json").stat().st_mode & 0o077 == 0  # the secret is not world-readable

    procs = []
    try:
        for rank, device, dtype in ((0, "cpu", "float32"), (1, "cpu", "bfloat16")):
            procs.append(
                subprocess.Popen(
                    [
                        *TANDEM,
                        "cluster",
                        "join",
                        token,
                        "--rank",
                        str(rank),
                        "--device",
                        device,
                        "--dtype",
                        dtype,
                        "--config-dir",
                        str(tmp_path / f"n{rank}"),
                        "--timeout",
                        "60",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.time() + 60
        snap = None
        while time.time() < deadline:
            r = _cli("cluster", "status", token, "--json")
            if r.returncode == 0:
                snap = json.loads(r.stdout)
                if len(snap["ranks"]) == 2:
                    break
            time.sleep(0.5)
        assert snap is not None and len(snap["ranks"]) == 2, snap
        by_rank = {r["rank"]: r for r in snap["ranks"]}
        assert by_rank[1]["dtype"] == "bfloat16" and by_rank[0]["dtype"] == "float32"
        assert by_rank[1]["role"] == "tp shard 1/2" and by_rank[1]["rtt_ms"] > 0
        table = _cli("cluster", "status", token)
        assert table.returncode == 0 and "joined" in table.stdout and "bfloat16" in table.stdout
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_cluster_join_refuses_a_mistyped_token_in_one_line():
    token = encode_token(new_topology(["127.0.0.1"], 1, 1))
    bad = token[:20] + ("2" if token[20] != "2" else "3") + token[21:]
    out = _cli("cluster", "join", bad, "--rank", "0")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "join token" in out.stderr


def test_status_board_refuses_a_peer_with_another_clusters_secret():
    topo = new_topology(["127.0.0.1"], 1, 1)
    board = StatusBoard(topo.secret, port=0, world_size=1).start()
    try:
        with pytest.raises(StatusAuthError):
            query("127.0.0.1", board.port, new_topology(["127.0.0.1"], 1, 1).secret)
        announce("127.0.0.1", board.port, topo.secret, 0, device="cpu")
        assert query("127.0.0.1", board.port, topo.secret)["ranks"][0]["device"] == "cpu"
        with socket.create_connection(("127.0.0.1", board.port), timeout=5) as s:  # hostile length
            s.recv(16)
            s.sendall(b"\xff\xff\xff\xff" + b"\0" * 40)
        assert query("127.0.0.1", board.port, topo.secret)["world_size"] == 1  # still serving
    finally:
        board.close()


def test_two_nodes_join_with_a_model_and_serve_the_openai_api(tmp_path):
    import openai
    from serve_support import get_json, kill_tree, make_model, wait_healthy

    from tandem.cluster.launcher import free_ports

    model = make_model(tmp_path / "model")
    base = free_port_block(4)
    token = _cli(
        "cluster", "init", "--hosts", "127.0.0.1,127.0.0.1", "--base-port", str(base), "--no-qr"
    ).stdout.split()[-1]
    (http_port,) = free_ports(1)
    procs = []
    try:
        for rank in (1, 0):
            argv = [*TANDEM, "cluster", "join", token, "--rank", str(rank), "--model", str(model)]
            argv += ["--config-dir", str(tmp_path / f"n{rank}"), "--port", str(http_port)]
            procs.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        wait_healthy(procs[1], f"http://127.0.0.1:{http_port}")
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0
        )
        r = client.chat.completions.create(
            model="model",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=5,
            temperature=0,
        )
        assert r.usage.completion_tokens >= 1
        snap = json.loads(_cli("cluster", "status", token, "--json").stdout)
        assert sorted(x["rank"] for x in snap["ranks"]) == [0, 1]
        view = get_json(f"http://127.0.0.1:{http_port}/v1/cluster")
        assert view["state"] == "whole" and view["layout"]["kind"] == "tp"
        assert [(r["rank"], r["shard"]["tp_rank"]) for r in view["ranks"]] == [(0, 0), (1, 1)]
        (link,) = view["links"]  # its RTT is the one rank 1 measured when it joined
        joined = next(x for x in snap["ranks"] if x["rank"] == 1)
        assert link["rtt_ms"] == pytest.approx(joined["rtt_ms"]) and link["rtt_ms"] > 0
        deadline = time.time() + 30  # the head's join process copies the probes onto the board
        while time.time() < deadline and not all("probe" in x for x in snap["ranks"]):
            time.sleep(0.5)
            snap = json.loads(_cli("cluster", "status", token, "--json").stdout)
        probes = {x["rank"]: x["probe"] for x in snap["ranks"]}
        assert probes == {r["rank"]: r["probe"] for r in view["ranks"]}
        assert all(p["gemv_gb_s"] > 0 and p["free_gb"] > 0 for p in probes.values())
        assert "GEMV GB/s" in _cli("cluster", "status", token).stdout
        plan = _cli("plan", "--model", str(model), "--from-cluster", token)
        assert plan.returncode == 0 and "rank 1 (cpu float32): GEMV" in plan.stdout, plan.stderr
        assert "pick: " in plan.stdout
    finally:
        for p in procs:
            kill_tree(p)


def test_a_joined_head_serves_with_the_reasoning_parser_it_was_given(tmp_path):
    """`cluster join --reasoning-parser none` on rank 0, over a model whose tokenizer has `<think>`
    marker tokens (which `auto`, the default, reads as a think model: test_serve_reasoning.py):
    the joined head's server answers with the text as the model wrote it, markers included, no
    reasoning apart, and refuses Ollama's `think` as for a model without a reasoning format."""
    import ollama
    import openai
    from reasoning_models import think_model
    from serve_support import kill_tree, wait_healthy

    from tandem.cluster.launcher import free_ports

    model = think_model(tmp_path / "qwen3-think")
    base = free_port_block(4)
    token = _cli(
        "cluster", "init", "--hosts", "127.0.0.1,127.0.0.1", "--base-port", str(base), "--no-qr"
    ).stdout.split()[-1]
    (http_port,) = free_ports(1)
    url = f"http://127.0.0.1:{http_port}"
    procs = []
    try:
        for rank in (1, 0):
            argv = [*TANDEM, "cluster", "join", token, "--rank", str(rank), "--model", str(model)]
            argv += ["--config-dir", str(tmp_path / f"n{rank}"), "--port", str(http_port)]
            argv += ["--reasoning-parser", "none"]
            procs.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        wait_healthy(procs[1], url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        ask = [{"role": "user", "content": "Pick a number."}]
        choice = client.chat.completions.create(
            model=name, messages=ask, max_tokens=12, temperature=0, logprobs=True
        ).choices[0]
        assert choice.message.content == "".join(t.token for t in choice.logprobs.content)
        assert getattr(choice.message, "reasoning_content", None) is None
        with pytest.raises(ollama.ResponseError, match="does not support thinking"):
            ollama.Client(host=url, timeout=120).chat(model=name, messages=ask, think=True)
    finally:
        for p in procs:
            kill_tree(p)


def test_nodes_holding_different_models_are_refused_in_one_line_at_the_head(tmp_path):
    from serve_support import kill_tree, make_model

    from tandem.cluster.launcher import free_ports

    head_model = make_model(tmp_path / "a", preset="tiny-qwen3")
    other_model = make_model(tmp_path / "b", preset="tiny-llama")
    base = free_port_block(4)
    token = _cli(
        "cluster", "init", "--hosts", "127.0.0.1,127.0.0.1", "--base-port", str(base), "--no-qr"
    ).stdout.split()[-1]
    (http_port,) = free_ports(1)
    worker = subprocess.Popen(
        [
            *TANDEM,
            "cluster",
            "join",
            token,
            "--rank",
            "1",
            "--model",
            str(other_model),
            "--config-dir",
            str(tmp_path / "n1"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        head = _cli(
            "cluster",
            "join",
            token,
            "--rank",
            "0",
            "--model",
            str(head_model),
            "--config-dir",
            str(tmp_path / "n0"),
            "--port",
            str(http_port),
            timeout=240,
        )
        assert head.returncode != 0
        errors = [line for line in head.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and "disagree with the head on the model" in errors[0], head.stderr
        assert "Traceback" not in head.stderr
    finally:
        kill_tree(worker)


def test_an_unreachable_head_is_a_one_line_error_within_the_timeout():
    base = free_port_block(4)
    token = encode_token(new_topology(["127.0.0.1", "127.0.0.1"], 2, 1, base_port=base))
    t0 = time.time()
    out = _cli("cluster", "join", token, "--rank", "1", "--timeout", "2")
    assert out.returncode == 2 and time.time() - t0 < 30
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "cannot reach the head" in errors[0] and str(base + 3) in errors[0]


def test_a_head_whose_workers_never_come_is_a_one_line_error_naming_the_missing_rank(tmp_path):
    from serve_support import make_model

    from tandem.cluster.launcher import free_ports

    model = make_model(tmp_path / "model")
    base = free_port_block(4)
    _cli(
        "cluster",
        "init",
        "--hosts",
        "127.0.0.1,127.0.0.1",
        "--base-port",
        str(base),
        "--no-qr",
        "--write-configs",
        str(tmp_path),
    )
    ring0 = tmp_path / "ring0.json"
    cfg = json.loads(ring0.read_text())
    ring0.write_text(json.dumps({**cfg, "handshake_timeout": 3.0}))
    (http_port,) = free_ports(1)
    out = _cli(
        "serve",
        "--model",
        str(model),
        "--ring-config",
        str(ring0),
        "--port",
        str(http_port),
        timeout=120,
    )
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "rank" in errors[0] and "[1]" in errors[0], out.stderr
    assert "Traceback" not in out.stderr

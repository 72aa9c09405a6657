"""``dllm serve --replicas``: two replicas of the shipped diffusion model behind Ray Serve on the loopback address,
reached with the openai client; every Ray listener stays on 127.0.0.1; the real command ends at SIGINT and SIGTERM,
while serving or while Ray starts, with exit 0 and no process of Ray's left."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dllm
from dllm.data.synthetic import format_example

from serve_support import require_serve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Serve's own pydantic v1 idioms


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listeners() -> set[str]:
    """Local addresses of every listening TCP socket (``ss``)."""
    out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3] for line in out.splitlines() if line.strip()}


def _require_ray() -> None:
    require_serve()
    ray = importlib.util.find_spec("ray")  # (find_spec of ray.serve would import ray itself)
    if ray is None or not (Path(ray.origin).parent / "serve").is_dir():
        pytest.skip("dllm serve --replicas runs on Ray Serve: pip install 'ray[serve]'")  # (not imported here:
        # Ray reads its settings from the environment when imported, which dllm.serve.replicas sets first)


@pytest.fixture(scope="module")
def replicas():
    _require_ray()
    from dllm.serve import replicas as ray_replicas

    before = _listeners()
    port = _free_port()
    ray_replicas.start(["--model", "diffusion", "--max-batch-size", "8"], replicas=2, port=port, replica_cpus=0.5)
    try:
        yield f"http://127.0.0.1:{port}", before
    finally:
        ray_replicas.stop()


def test_two_replicas_answer_as_one_server_does(replicas):
    import httpx
    from openai import OpenAI

    url, before = replicas
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompts = [format_example(f"Tom has {a} bags with 4 apples each. How many apples does Tom have?")
               for a in range(2, 10)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: client.completions.create(model="diffusion", prompt=p, max_tokens=24,
                                                                  temperature=0).choices[0].text, prompts))
    model = dllm.load("diffusion")
    for prompt, text in zip(prompts, texts, strict=True):
        ids = torch.tensor([model.tokenizer(prompt)["input_ids"]])
        out = dllm.generate(model, ids, sampler="fef", max_new_tokens=24, temperature=0)
        answer = out.sequences[0, ids.shape[1]:][: out.stats.new_tokens].tolist()
        assert text == model.tokenizer.decode([t for t in answer if t != 1], skip_special_tokens=True)
    stream = client.completions.create(model="diffusion", prompt=prompts[0], max_tokens=24, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == texts[0]  # streams pass through the proxy
    pids = {httpx.get(url + "/health").json()["pid"] for _ in range(40)}
    assert len(pids) == 2  # both replicas answered
    new = _listeners() - before
    assert new and all(address.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for address in new), new


# ------------------------------------------------------------------------------------------------ the command

GRACE_S = 10  # the command's --grace
BOUND_S = 30  # beyond it: Ray Serve's and Ray's teardown (dllm.serve.replicas.STOP_BOUND_S)
START_S = 240  # Ray and two replicas starting on a busy 2-core CPU (about 20 s alone)


def _session(sid: int) -> list[str]:
    """The processes of session ``sid`` (pid and name), read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    found.append(f"{entry} {Path(f'/proc/{entry}/comm').read_text().strip()}")
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                pass
    return found


def _command(port: int, errors: Path) -> subprocess.Popen:
    """``dllm serve --replicas 2`` in a session of its own (its process group is the session's); stderr to
    ``errors`` (a file: Ray's warnings would fill a pipe nobody reads)."""
    with errors.open("w") as sink:
        return subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--replicas", "2", "--replica-cpus",
                                 "0.5", "--port", str(port), "--grace", str(GRACE_S)], stdout=subprocess.PIPE,
                                stderr=sink, text=True, start_new_session=True)


def _ready(process: subprocess.Popen, errors: Path) -> None:
    """Wait (at most START_S) for the line the command prints once the replicas answer."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        assert selector.select(timeout=START_S), f"not ready after {START_S} s: {errors.read_text()[-2000:]}"
    assert "replicas behind Ray Serve" in process.stdout.readline(), errors.read_text()[-2000:]


def _ended_cleanly(process: subprocess.Popen, name: str, sent: float, errors: Path) -> None:
    """Exit 0 within the grace and its bound, stopped by ``name``, and nothing of the session left."""
    try:
        assert process.wait(timeout=GRACE_S + BOUND_S) == 0, errors.read_text()[-2000:]
        assert time.monotonic() - sent < GRACE_S + BOUND_S
        assert errors.read_text().strip().endswith(f"stopped by {name}")
        deadline = time.monotonic() + 5  # the last of them may still be exiting
        while _session(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session(process.pid) == []
    finally:
        if process.poll() is None or _session(process.pid):
            os.killpg(process.pid, signal.SIGKILL)  # (the group is the session: everything the test started)
            process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("name, to_group", [("SIGINT", True), ("SIGTERM", False)],
                         ids=["SIGINT-to-the-group", "SIGTERM-to-the-process"])
def test_the_command_ends_at_the_signal_after_the_stream_in_flight(name, to_group, tmp_path):
    """SIGINT to the process group (a terminal's Ctrl-C) or SIGTERM to the process (kill, systemd, Kubernetes)
    while a stream is in flight: the stream is answered to its end, then the command exits 0 within the grace and
    no process of Ray's is left."""
    _require_ray()
    import httpx

    port, errors, sent = _free_port(), tmp_path / "stderr.txt", None
    process = _command(port, errors)
    try:
        _ready(process, errors)
        # 8 choices of up to 200 tokens at T=1 from a prompt the model does not end soon: seconds of decoding
        body = {"prompt": "apples apples apples", "max_tokens": 200, "temperature": 1.0, "seed": 0, "n": 8,
                "sampler": "sequential", "stream": True}
        lines = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if sent is None and line.startswith("data: {"):
                    os.killpg(process.pid, signal.SIGINT) if to_group else process.send_signal(signal.SIGTERM)
                    sent = time.monotonic()
                lines.append(line)
        assert [line for line in lines if line][-1] == "data: [DONE]"
        assert sum('"finish_reason": "' in line for line in lines) == 8  # every choice to its end
    finally:
        if sent is None:
            process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
        _ended_cleanly(process, name, sent, errors)


@pytest.mark.slow
def test_the_command_ends_at_sigterm_while_ray_starts(tmp_path):
    """SIGTERM while Ray is starting (its raylet up, the replicas not yet): exit 0, no process of Ray's left."""
    _require_ray()
    errors = tmp_path / "stderr.txt"
    process = _command(_free_port(), errors)
    deadline = time.monotonic() + START_S
    try:
        while not any(entry.endswith(" raylet") for entry in _session(process.pid)):
            assert process.poll() is None and time.monotonic() < deadline, errors.read_text()[-2000:]
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGTERM)
    _ended_cleanly(process, "SIGTERM", time.monotonic(), errors)

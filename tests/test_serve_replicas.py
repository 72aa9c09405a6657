"""``dllm serve --replicas``: two replicas of the shipped diffusion model behind Ray Serve on the loopback address,
reached with the openai client; every Ray listener stays on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import socket
import subprocess
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


@pytest.fixture(scope="module")
def replicas():
    require_serve()
    ray = importlib.util.find_spec("ray")  # (find_spec of ray.serve would import ray itself)
    if ray is None or not (Path(ray.origin).parent / "serve").is_dir():
        pytest.skip("dllm serve --replicas runs on Ray Serve: pip install 'ray[serve]'")  # (not imported here:
        # Ray reads its settings from the environment when imported, which dllm.serve.replicas sets first)
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

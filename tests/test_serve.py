"""``dllm serve`` through the real ``openai`` client on the loopback address, with the shipped models: what it
answers equals offline ``dllm.generate``; seeded samples do not depend on the batch and follow the sampler's law;
streams, concurrency, cancellation, the queue bound, bad requests, models not served, defaults, chat templates,
failures and signals behave as documented."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import dllm
from dllm.data.synthetic import format_example

from serve_support import LiveServer, require_serve, serve_args
from stat_tools import ALPHA, chi_square_pvalue

QUESTIONS = [f"Tom has {a} bags with {b} apples each. How many apples does Tom have?"
             for a in range(2, 6) for b in range(3, 7)]  # 16 prompts
WEIGHTS = Path(dllm.__file__).resolve().parent / "weights"
SHIPPED_MODELS = sorted(p.name for p in WEIGHTS.iterdir() if (p / "tokenizer.json").is_file())


@pytest.fixture(scope="module")
def diffusion_server():
    require_serve()
    from dllm.serve.cli import build

    with LiveServer(build(serve_args("--model", "diffusion", "--max-batch-size", "16"))) as server:
        yield server


@pytest.fixture(scope="module")
def ar_server():
    require_serve()
    from dllm.serve.cli import build

    with LiveServer(build(serve_args("--model", "ar"))) as server:
        yield server


def _offline(model, prompt: str, seed: int, **kwargs) -> list[int]:
    """The completion's token ids offline: generate at batch 1 with the request's seed, cut at its stop."""
    ids = torch.tensor([model.tokenizer(prompt)["input_ids"]])
    out = dllm.generate(model, ids, generator=torch.Generator().manual_seed(seed), **kwargs)
    answer = out.sequences[0, ids.shape[1]:].tolist()
    return answer[: answer.index(1)] if 1 in answer else answer  # the shipped models' stop id


def _many(function, items, workers: int = 16) -> list:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(function, items))


def _tokens(response) -> list[int]:
    return response.model_extra["dllm"]["choices"][0]["token_ids"]


# ------------------------------------------------------------------------------------------------ equality


def test_greedy_completions_equal_offline_generate_sent_16_at_a_time(diffusion_server):
    model = diffusion_server.app.state.settings.model
    client = diffusion_server.client()
    prompts = [format_example(q) for q in QUESTIONS]

    def ask(prompt):
        return client.completions.create(model="diffusion", prompt=prompt, max_tokens=32, temperature=0, seed=0)

    responses = _many(ask, prompts)
    batches = diffusion_server.engine.counts.batches
    for prompt, response in zip(prompts, responses, strict=True):
        offline = _offline(model, prompt, 0, sampler="fef", max_new_tokens=32, temperature=0)
        assert _tokens(response) == offline
        assert response.choices[0].text == model.tokenizer.decode(offline, skip_special_tokens=True)
        assert response.model_extra["dllm"]["exact"] is True
        assert response.usage.prompt_tokens == len(model.tokenizer(prompt)["input_ids"])
    assert batches < sum(r.model_extra["dllm"]["choices"][0]["model_calls"] for r in responses), \
        "the engine batched no call of one lane with another's"


def test_a_seeded_sample_is_the_same_alone_and_among_15_others(diffusion_server):
    client = diffusion_server.client()
    prompt = format_example(QUESTIONS[5])

    def ask(seed):
        return _tokens(client.completions.create(model="diffusion", prompt=prompt, max_tokens=24, temperature=1.0,
                                                 seed=seed))

    alone = [ask(seed) for seed in range(4)]
    crowd = _many(ask, list(range(4)) + list(range(100, 112)))  # the 4 seeds among 12 others, all at once
    assert crowd[:4] == alone
    model = diffusion_server.app.state.settings.model
    assert alone[0] == _offline(model, prompt, 0, sampler="fef", max_new_tokens=24, temperature=1.0)
    assert len({tuple(tokens) for tokens in crowd}) > 4  # the samples do differ between seeds


def test_samples_through_the_server_follow_the_chain_law(diffusion_server):
    """640 seeded T=1 samples (n=16 per request, 4 requests at a time: 64 lanes, within the queue) of the first
    answer token against the chain's law there (the model at the masked canvas); the same samples reject the law
    at another temperature."""
    model = diffusion_server.app.state.settings.model
    client = diffusion_server.client()
    prompt = format_example("Sam has 3 boxes with 7 pens each. How many pens does Sam have?")
    ids = model.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids + [model.mask_token_id] * 8]))[0, len(ids)].double()

    def ask(seed):
        response = client.completions.create(model="diffusion", prompt=prompt, max_tokens=8, temperature=1.0,
                                             seed=seed * 16, n=16)
        return [choice["token_ids"][0] for choice in response.model_extra["dllm"]["choices"]]

    firsts = torch.tensor([token for batch in _many(ask, range(40), workers=4) for token in batch])[:, None]
    for temperature, passes in ((1.0, True), (1.5, False)):
        law = torch.softmax(logits / temperature, dim=-1)
        p = chi_square_pvalue(firsts, {(t,): float(law[t]) for t in range(len(law))})
        assert (p > ALPHA) == passes, (temperature, p)


def test_ar_completions_equal_offline_ar(ar_server):
    model = ar_server.app.state.settings.model
    client = ar_server.client()
    prompts = [format_example(q) for q in QUESTIONS[:8]]
    responses = _many(lambda p: client.completions.create(model="ar", prompt=p, max_tokens=24, temperature=0),
                      prompts)
    for prompt, response in zip(prompts, responses, strict=True):
        assert _tokens(response) == _offline(model, prompt, 0, sampler="ar", max_new_tokens=24, temperature=0)


# ------------------------------------------------------------------------------------------------ the API


def test_chat_stream_and_routes(diffusion_server):
    import httpx

    client = diffusion_server.client()
    question = QUESTIONS[0]
    chat = client.chat.completions.create(model="diffusion", messages=[{"role": "user", "content": question}],
                                          max_tokens=32, temperature=0)
    plain = client.completions.create(model="diffusion", prompt=format_example(question), max_tokens=32,
                                      temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text  # the shipped models' template: their format
    assert chat.choices[0].finish_reason == "stop" and chat.object == "chat.completion"

    stream = client.completions.create(model="diffusion", prompt=format_example(question), max_tokens=32,
                                       temperature=1.0, seed=7, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    whole = client.completions.create(model="diffusion", prompt=format_example(question), max_tokens=32,
                                      temperature=1.0, seed=7)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert sum(bool(c.choices and c.choices[0].text) for c in chunks) >= 2  # sent in pieces as they became final
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    chat_stream = client.chat.completions.create(model="diffusion", stream=True, max_tokens=32, temperature=0,
                                                 messages=[{"role": "user", "content": question}])
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices) == \
        chat.choices[0].message.content

    with httpx.Client(base_url=diffusion_server.url) as http:
        assert http.get("/health").json()["status"] == "ok"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["diffusion"]
        metrics = http.get("/metrics").text
        for name in ("dllm_requests_total", "dllm_queue_depth", "dllm_running_rows", "dllm_generated_tokens_total",
                     "dllm_tokens_per_call_bucket", "dllm_acceptance_rate_bucket",
                     "dllm_request_latency_seconds_bucket", "dllm_time_to_first_token_seconds_bucket"):
            assert name in metrics
        canvas = http.post("/v1/completions", json={"prompt": format_example(question), "max_tokens": 16,
                                                    "stream": True, "stream_canvas": True, "temperature": 0})
        frames = [json.loads(line[6:]) for line in canvas.text.splitlines()
                  if line.startswith("data: {") and '"dllm.canvas"' in line]
        assert frames and "\u2591" in frames[0]["choices"][0]["canvas"]  # masked positions shown


# ------------------------------------------------------------------------------------------------ names, defaults


def test_a_model_not_served_gets_404_model_not_found_and_no_model_gets_the_served_one(diffusion_server):
    import httpx
    from openai import NotFoundError

    before = diffusion_server.engine.counts.lanes_done
    with pytest.raises(NotFoundError, match="gpt-4") as raised:
        diffusion_server.client().completions.create(model="gpt-4", prompt=format_example(QUESTIONS[0]),
                                                     max_tokens=8)
    assert (raised.value.code, raised.value.param, raised.value.type) == \
        ("model_not_found", "model", "invalid_request_error")
    chat = httpx.post(diffusion_server.url + "/v1/chat/completions",
                      json={"model": "gpt-4", "messages": [{"role": "user", "content": QUESTIONS[0]}]})
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
    assert diffusion_server.engine.counts.lanes_done == before  # nothing reached the engine
    unnamed = httpx.post(diffusion_server.url + "/v1/completions", json={"prompt": format_example(QUESTIONS[0]),
                                                                          "max_tokens": 8, "temperature": 0})
    assert unnamed.status_code == 200 and unnamed.json()["model"] == "diffusion"  # the first served name


def test_the_server_defaults_are_openai_s_temperature_and_dllm_s_max_new_tokens_and_shown(diffusion_server):
    """A request without temperature or max_tokens samples at T=1 (OpenAI's default) for MAX_NEW_TOKENS tokens:
    the seeded offline run at those settings; /v1/models and the response's dllm object say so."""
    import httpx

    from dllm.defaults import MAX_NEW_TOKENS, SERVE_TEMPERATURE

    listed = httpx.get(diffusion_server.url + "/v1/models").json()["data"][0]["dllm"]
    assert (listed["temperature"], listed["max_tokens"], listed["sampler"]) == (1.0, MAX_NEW_TOKENS, "fef")
    assert SERVE_TEMPERATURE == 1.0
    prompt = format_example(QUESTIONS[4])
    response = diffusion_server.client().completions.create(model="diffusion", prompt=prompt, seed=11)
    extension = response.model_extra["dllm"]
    assert (extension["temperature"], extension["max_tokens"]) == (1.0, MAX_NEW_TOKENS)
    model = diffusion_server.app.state.settings.model
    assert _tokens(response) == _offline(model, prompt, 11, sampler="fef", max_new_tokens=MAX_NEW_TOKENS,
                                         temperature=1.0)


def test_served_model_names_and_a_greedy_default_are_flags():
    require_serve()
    import httpx
    from openai import NotFoundError

    from dllm.serve.cli import build

    app = build(serve_args("--model", "diffusion", "--served-model-name", "dllm-small", "gsm", "--default-temperature",
                           "0", "--default-max-tokens", "24"))
    with LiveServer(app) as server:
        listed = httpx.get(server.url + "/v1/models").json()["data"]
        assert [entry["id"] for entry in listed] == ["dllm-small", "gsm"]
        assert (listed[1]["dllm"]["temperature"], listed[1]["dllm"]["max_tokens"]) == (0.0, 24)
        client = server.client()
        prompt = format_example(QUESTIONS[6])
        response = client.completions.create(model="gsm", prompt=prompt, seed=5)  # no temperature, no max_tokens
        assert response.model == "gsm" and response.model_extra["dllm"]["temperature"] == 0.0
        assert _tokens(response) == _offline(app.state.settings.model, prompt, 5, sampler="fef", max_new_tokens=24,
                                             temperature=0)
        with pytest.raises(NotFoundError, match="dllm-small"):  # the message lists what is served
            client.completions.create(model="diffusion", prompt=prompt)


# ------------------------------------------------------------------------------------------------ chat templates


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_each_shipped_folder_declares_its_training_format_as_its_chat_template(name):
    """transformers reads the template from the folder, and so does dllm.load: one user message through it is
    the training format dllm generate builds without --chat."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": QUESTIONS[0]}]
    for tokenizer in (AutoTokenizer.from_pretrained(WEIGHTS / name), dllm.load(name).tokenizer):
        assert tokenizer.chat_template
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            format_example(QUESTIONS[0])
        assert dllm.apply_chat_template(tokenizer, QUESTIONS[0]) == format_example(QUESTIONS[0])


def test_dllm_generate_chat_and_the_chat_route_give_the_same_answer(diffusion_server, capsys):
    from dllm.cli import main

    assert main(["generate", QUESTIONS[2], "--chat", "--json", "--max-new-tokens", "32", "--temperature", "0"]) == 0
    offline = json.loads(capsys.readouterr().out)
    chat = diffusion_server.client().chat.completions.create(
        model="diffusion", messages=[{"role": "user", "content": QUESTIONS[2]}], max_tokens=32, temperature=0)
    assert offline["prompt"] == format_example(QUESTIONS[2])
    assert chat.choices[0].message.content == offline["completion"] and "####" in offline["completion"]


def test_a_tokenizer_without_a_chat_template_fails_alike_in_generate_and_serve(tmp_path, capsys):
    """The same message from dllm generate --chat (exit 2) and the chat route (400), each naming its fix; the
    serve flag --chat-template FILE then makes the route work."""
    require_serve()
    import httpx

    from dllm.cli import main
    from dllm.serve.cli import build

    folder = tmp_path / "plain"
    folder.mkdir()
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(WEIGHTS / "diffusion" / file, folder / file)
    assert main(["generate", QUESTIONS[0], "--model", str(folder), "--chat"]) == 2
    said = capsys.readouterr().err.strip()
    lead = "has no chat template (a model folder declares one in chat_template.jinja"
    assert lead in said and said.endswith("pass the prompt as plain text instead")
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    with LiveServer(build(serve_args("--model", str(folder)))) as server:
        refused = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages})
        message = refused.json()["error"]["message"]
        assert refused.status_code == 400 and lead in message and "--chat-template FILE" in message
    template = str(WEIGHTS / "diffusion" / "chat_template.jinja")
    with LiveServer(build(serve_args("--model", str(folder), "--chat-template", template))) as server:
        chat = server.client().chat.completions.create(model=str(folder), messages=messages, max_tokens=16,
                                                       temperature=0)
        plain = server.client().completions.create(model=str(folder), prompt=format_example(QUESTIONS[0]),
                                                   max_tokens=16, temperature=0)
        assert chat.choices[0].message.content == plain.choices[0].text


def test_stop_strings_end_the_text_and_the_lane(diffusion_server):
    client = diffusion_server.client()
    prompt = format_example(QUESTIONS[3])
    full = client.completions.create(model="diffusion", prompt=prompt, max_tokens=32, temperature=0).choices[0].text
    stop = full.strip()[4:7]
    cut = client.completions.create(model="diffusion", prompt=prompt, max_tokens=32, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="diffusion", prompt=prompt, max_tokens=32, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    llada = {"sampler": "llada"}  # an approximate sampler: a lane its stop string ends early is not called exact
    full = client.completions.create(model="diffusion", prompt=prompt, max_tokens=32, temperature=0, extra_body=llada)
    cut = client.completions.create(model="diffusion", prompt=prompt, max_tokens=32, temperature=0,
                                    stop=full.choices[0].text.strip()[4:7], extra_body=llada)
    assert cut.choices[0].finish_reason == "stop" and cut.model_extra["dllm"]["exact"] is False


@pytest.mark.parametrize("body, field", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 300}, "max_tokens"),
    ({"prompt": "word " * 300}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "sampler": "beam"}, "sampler"),
    ({"prompt": "hi", "sampler": "ar"}, "sampler"),
    ({"prompt": "hi", "window": 0}, "window"),
    ({"prompt": "hi", "windw": 4}, "windw"),
    ({"prompt": "hi", "drafter": "/etc"}, "drafter"),
    ({"prompt": "hi", "n": 99}, "n"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "top_p": 0.9}, "top_p"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "stop_token_ids": [2]}, "stop_token_ids"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "hi", "echo": 1}, "echo"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "logprobs": 1, "logprobs_mode": "processed"}, "logprobs_mode"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "model": 5}, "model"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_bad_completions_get_400_naming_the_field(diffusion_server, body, field):
    import httpx

    before = diffusion_server.engine.counts.lanes_done
    response = httpx.post(diffusion_server.url + "/v1/completions", json=body)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert field in message and "\n" not in message
    assert diffusion_server.engine.counts.lanes_done == before  # nothing reached the engine


@pytest.mark.parametrize("body, field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 3}]}, "content"),
    ({"prompt": "hi"}, "prompt"),
])
def test_bad_chat_requests_get_400_naming_the_field(diffusion_server, body, field):
    import httpx

    response = httpx.post(diffusion_server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and field in response.json()["error"]["message"]
    assert httpx.post(diffusion_server.url + "/v1/chat/completions", content=b"{not json").status_code == 400


def test_the_openai_client_raises_on_a_bad_request(diffusion_server):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="max_tokens"):
        diffusion_server.client().completions.create(model="diffusion", prompt="hi", max_tokens=10_000)


# ------------------------------------------------------------------------------------------------ load, faults


def test_a_disconnected_stream_cancels_its_lane(diffusion_server):
    import httpx

    engine = diffusion_server.engine
    body = {"prompt": format_example(QUESTIONS[1]), "max_tokens": 256 - 40, "stream": True, "temperature": 1.0,
            "sampler": "sequential"}  # one token a call: long enough to leave in the middle
    done = engine.counts.lanes_done
    with httpx.stream("POST", diffusion_server.url + "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # the first piece of text: leave
    deadline = time.monotonic() + 10
    while engine.counts.lanes_done == done and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.counts.lanes_done == done + 1 and engine.active == 0


def test_a_full_queue_answers_429_with_retry_after():
    require_serve()
    import httpx

    from dllm.serve.cli import build

    app = build(serve_args("--model", "diffusion", "--max-batch-size", "1", "--max-queue", "1"))
    with LiveServer(app) as server:
        body = {"prompt": format_example(QUESTIONS[0]), "max_tokens": 128, "sampler": "sequential",
                "temperature": 0}
        responses = _many(lambda _: httpx.post(server.url + "/v1/completions", json=body, timeout=60), range(6),
                          workers=6)
        statuses = sorted(r.status_code for r in responses)
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1" and "busy" in refused.json()["error"]["message"]
        texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
        assert len(texts) == 1  # every answered request got the same greedy answer


def test_a_failing_decode_answers_500_and_the_others_go_on(diffusion_server, monkeypatch):
    import dllm.serve.choice as choice

    real = choice.dllm.generate

    def flaky(model, ids, **kwargs):
        if kwargs.get("temperature") == 0.5:
            raise RuntimeError("injected failure")
        return real(model, ids, **kwargs)

    monkeypatch.setattr(choice.dllm, "generate", flaky)
    client = diffusion_server.client()
    from openai import InternalServerError

    def ask(temperature):
        try:
            return client.completions.create(model="diffusion", prompt=format_example(QUESTIONS[2]), max_tokens=16,
                                             temperature=temperature, seed=1).choices[0].text
        except InternalServerError as error:
            return error

    results = _many(ask, [0.5, 0.0, 1.0, 0.0])
    assert isinstance(results[0], InternalServerError) and "injected failure" in str(results[0])
    assert all(isinstance(text, str) for text in results[1:]) and results[1] == results[3]


def test_engine_stop_cancels_what_is_left_and_takes_nothing_new():
    from dllm.serve.engine import Cancelled, Engine, Lane, NotAccepting

    model = dllm.load("diffusion")
    engine = Engine(model, max_batch_size=1, max_queue=1)
    ended, release = {}, threading.Event()
    ids = torch.tensor([model.tokenizer(format_example(QUESTIONS[0]))["input_ids"]])

    def slow(lane_model):
        release.wait(5)
        return dllm.generate(lane_model, ids, sampler="sequential", max_new_tokens=200, temperature=0)

    lanes = [Lane(slow, lambda result, error, i=i: ended.__setitem__(i, error)) for i in range(2)]
    engine.submit(lanes)  # one runs, one waits
    release.set()
    engine.stop(grace=0.05)
    assert isinstance(ended[1], Cancelled) and isinstance(ended[0], Cancelled)
    with pytest.raises(NotAccepting):
        engine.submit([Lane(slow, lambda *a: None)])


# ------------------------------------------------------------------------------------------------ the command


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_finish_the_requests_in_flight_and_exit_0(name):
    """The real command in a session of its own: a stream in flight when the signal comes (SIGTERM to the process,
    SIGINT to its process group, as a terminal's Ctrl-C) is answered to its end, no new connection is taken, and
    the process exits 0 within the grace."""
    require_serve()
    import os
    import signal
    import subprocess
    import sys

    import httpx

    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--port", str(port), "--grace", "20"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"dllm serve did not start: {process.stdout.read()}") from None
                time.sleep(0.2)
        body = {"prompt": format_example(QUESTIONS[0]), "max_tokens": 160, "stream": True, "temperature": 0,
                "sampler": "sequential"}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not lines and line.startswith("data: {"):
                    if name == "SIGINT":
                        os.killpg(process.pid, signal.SIGINT)
                    else:
                        process.send_signal(signal.SIGTERM)
                lines.append(line)
        assert lines[-2] == "data: [DONE]" or lines[-1] == "data: [DONE]"
        assert process.wait(timeout=20 + 10) == 0
        assert process.stdout.read().strip().endswith(f"stopped by {name}")
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_bad_flags_fail_in_one_line(capsys):
    require_serve()
    from dllm.serve.cli import main

    assert main(["--max-batch-size", "0"]) == 2
    assert main(["--sampler", "ar"]) == 2
    assert main(["--chat-template", "/no/such/file"]) == 2
    assert main(["--default-temperature", "-1"]) == 2
    assert main(["--served-model-name", "a", "a"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0].startswith("dllm serve: ") and "--max-batch-size" in errors[0]
    assert "sampler" in errors[1] and "--chat-template" in errors[2]
    assert "--default-temperature" in errors[3] and "--served-model-name" in errors[4]


def test_the_readme_serving_commands_work_as_printed():
    """The README's commands, on a free port: the server starts, the curl line gets a seeded completion whose
    sampler options came from the body, and what the command prints is what the README shows after it."""
    require_serve()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    _check_serving_section(readme.split("## Serving\n", 1)[1].split("\n## ", 1)[0])


def test_the_guide_s_example_prints_what_the_guide_shows():
    """docs/guides/serve.md's Python example against the server it names (dllm serve --dtype float32)."""
    require_serve()
    import re
    import subprocess
    import sys

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "serve.md").read_text()
    flags, code, shown = re.search(r"With\s+`dllm serve ([^`]*)` running on a CPU:\s+```python\n(.*?)```.*?"
                                   r"```text\n(.*?)```", guide, re.S).groups()
    with _serve_command(flags.split()) as port:
        printed = subprocess.run([sys.executable, "-c", code.replace("8000", port)], capture_output=True, text=True,
                                 timeout=120)
    assert printed.stdout == shown, printed.stderr[-2000:]


@contextlib.contextmanager
def _serve_command(argv: list[str]):
    """``dllm serve ARGV`` in a process of its own on a free port (``--port`` replaced); yields the port once it
    answers, and ends it with SIGTERM (exit 0)."""
    import subprocess
    import sys

    import httpx

    port = str(_free_port())
    if "--port" in argv:
        argv = argv[: argv.index("--port")] + argv[argv.index("--port") + 2:]
    process = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", *argv, "--port", port],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
                time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0


def _check_serving_section(body: str) -> None:
    import re
    import shlex
    import subprocess
    import sys

    serve_line, command = re.search(r"```bash\n(.*?)\n(.*?)```", body, re.S).groups()
    shown = re.search(r"```bash\n.*?```.*?```text\n(.*?)```", body, re.S)
    serve_argv = shlex.split(serve_line.split("#")[0])
    assert serve_argv[:2] == ["dllm", "serve"]
    command = command.replace("python -c", f"{shlex.quote(sys.executable)} -c")
    with _serve_command(serve_argv[2:]) as port:
        curl = re.split(r"\|\s*\n", command)[0]  # the request, before a pipe that prints part of its answer
        done = subprocess.run(["bash", "-c", curl.replace("8000", port)], capture_output=True, text=True, timeout=60)
        answer = json.loads(done.stdout)
        assert answer["choices"][0]["text"] and answer["dllm"]["seed"] == 3
        assert answer["dllm"]["options"]["window"] == 8 and answer["dllm"]["exact"] is True
        if shown is not None:
            printed = subprocess.run(["bash", "-c", command.replace("8000", port)], capture_output=True, text=True,
                                     timeout=60)
            assert printed.stdout == shown.group(1), printed.stderr


def test_the_load_study_runs_and_checks_every_answer(tmp_path):
    """A small run of eval/study/load.py: its own server process, two concurrency levels, half the streams dropped;
    every other request answered exactly once, the table and the JSON written."""
    require_serve()
    from dllm.eval.study import load

    assert load.main(["--targets", "diffusion:fef", "--concurrency", "1", "2", "--requests", "4", "--max-tokens", "8",
                      "--disconnect", "0.5", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "load.json").read_text())
    assert [row["concurrency"] for row in result["rows"]] == [1, 2]
    assert all(row["answered"] == 2 and row["disconnected"] == 2 for row in result["rows"])
    assert "| diffusion:fef | 2 |" in (tmp_path / "load.md").read_text()

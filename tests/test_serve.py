"""`jetflow serve` end to end: a real server process on a free loopback port, driven by the official
`openai` client and raw HTTP (for inputs a client library would refuse to send)."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endless_dir(tmp_path_factory):
    """A tiny Llama without an EOS token, so every generation runs to max_tokens (long jobs on demand)."""
    from tiny import byte_tokenizer, tiny_model

    from jetflow.models.draft_head import DraftHead, DraftHeadConfig
    from jetflow.models.target import TargetModel

    path = tmp_path_factory.mktemp("endless")
    tok = byte_tokenizer()
    tok.eos_token = None
    model = tiny_model("llama")
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(path / "target")
    tok.save_pretrained(path / "target")
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(TargetModel.load(str(path / "target")), block_size=6))
    head.save_pretrained(path / "head")
    return path


def start_server(target, drafter, *extra, cache=None):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    if cache:
        env["JETFLOW_CACHE"] = str(cache)
    proc = subprocess.Popen([sys.executable, "-m", "jetflow.cli", "serve", "--target", str(target), "--drafter",
                             str(drafter), "--port", str(port), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up")


def stop(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def server(endless_dir, tmp_path_factory):
    proc, base = start_server(endless_dir / "target", endless_dir / "head", "--budget", "8", "--width", "3",
                              "--api-key", KEY, "--model-name", "tiny", "--max-queue", "2", "--max-batch", "1",
                              "--max-body-bytes", "20000", cache=tmp_path_factory.mktemp("cache"))
    yield base
    assert stop(proc) == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def test_models_chat_and_completions(client):
    assert [m.id for m in client.models.list().data] == ["target", "tiny"]  # served name + target name
    msgs = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 12
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 12
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # the server's first request: the warm-up left nothing
    stats = chat.model_extra["jetflow"]
    assert stats["rounds"] >= 1 and stats["tau"] >= 1 and stats["budget"] == 8
    parts = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == chat.choices[0].message.content  # stream == non-stream under greedy
    assert parts[-1].usage.completion_tokens == 12 and parts[-2].choices[0].finish_reason == "length"
    # the same prompt again: all of it from the cache but its last token, whose logits are needed
    assert parts[-1].usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1
    comp = client.completions.create(model="tiny", prompt="Once upon", max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=10, temperature=0, stream=True))
    assert streamed == comp.choices[0].text and comp.usage.completion_tokens == 10
    newer = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=5, temperature=0)
    assert newer.usage.completion_tokens == 5 and newer.choices[0].finish_reason == "length"


def test_greedy_text_equals_offline_decoding_and_stop_strings(client, endless_dir):
    import jetflow
    from jetflow.models.target import TargetModel

    target = TargetModel.load(str(endless_dir / "target"))
    msgs = [{"role": "user", "content": "Tell me"}]
    want = jetflow.generate(target, msgs, max_new_tokens=16).text
    got = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want
    stop = want[3:6]
    cut = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == want[:want.index(stop)]
    seeded = [client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0.8, top_p=0.9,
                                             seed=7).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    # the sampling parameters take effect: the text is the target's own seeded sampling (speculative
    # sampling draws each token from the target's distribution with the same generator), not greedy
    sampled = jetflow.generate(target, msgs, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7).text
    assert seeded[0] == sampled != want
    top_k = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=1.0, seed=3,
                                           extra_body={"top_k": 2}).choices[0].message.content
    assert top_k == jetflow.generate(target, msgs, max_new_tokens=16, temperature=1.0, top_k=2, seed=3).text
    assert top_k != jetflow.generate(target, msgs, max_new_tokens=16, temperature=1.0, seed=3).text


def post(base, path, body, key=KEY, raw=None, headers=None):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    h.update(headers or {})
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(base + path, content=content, headers={"Content-Type": "application/json", **h}, timeout=30)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("body, raw, status, message", [
    (None, b'{"model": "tiny", "messages": [', 400, "not valid JSON"),
    (None, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "not valid UTF-8"),
    (None, b"[1, 2]", 400, "must be a JSON object"),
    ({"model": "tiny"}, None, 400, "'messages' is required"),
    ({**CHAT, "messages": []}, None, 400, "'messages' must be a non-empty list"),
    ({**CHAT, "messages": [{"role": "user", "content": "  "}]}, None, 400, "non-empty user message"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, None, 400, "needs a 'role'"),
    ({**CHAT, "model": "gpt-9"}, None, 404, "The model 'gpt-9' does not exist"),
    ({**CHAT, "max_completion_tokens": 0}, None, 400, "'max_completion_tokens' must be >= 1"),
    ({**CHAT, "max_completion_tokens": 10**6}, None, 400, "max_completion_tokens 1000000 + prompt"),
    ({**CHAT, "temperature": "hot"}, None, 400, "'temperature' must be a number"),
    ({**CHAT, "max_tokens": "many"}, None, 400, "'max_tokens' must be an integer"),
    ({**CHAT, "max_tokens": -5}, None, 400, "'max_tokens' must be >= 1"),
    ({**CHAT, "max_tokens": 10 ** 9}, None, 400, "exceed this model's context of 512 tokens"),
    ({**CHAT, "temperature": 2.5}, None, 400, "'temperature' must be in [0.0, 2.0]"),
    ({**CHAT, "top_p": 0}, None, 400, "'top_p' must be in (0.0, 1.0]"),
    ({**CHAT, "n": 3}, None, 400, "only n=1 is supported"),
    ({**CHAT, "stop": [1]}, None, 400, "'stop' must be"),
    ({**CHAT, "stream": "yes"}, None, 400, "'stream' must be a boolean"),
    ({**CHAT, "messages": [{"role": "user", "content": "x " * 300}]}, None, 400, "this model's context is 512"),
    ({**CHAT, "messages": [{"role": "user", "content": "x" * 30000}]}, None, 413, "exceeds the limit of 20000"),
    ({**CHAT, "seed": 2 ** 64}, None, 400, "'seed' must be in [-9223372036854775808, 18446744073709551615]"),
    ({**CHAT, "seed": 2 ** 64, "stream": True}, None, 400, "'seed' must be in"),
    (None, b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi \\ud83d"}]}', 400,
     "messages[0].content is not valid Unicode: an unpaired surrogate at character 3"),
    ({**CHAT, "echo": True}, None, 400, "'echo' is not supported"),
    ({**CHAT, "logprobs": True}, None, 400, "'logprobs' is not supported"),
    ({**CHAT, "presence_penalty": 0.5}, None, 400, "'presence_penalty' is not supported"),
    ({**CHAT, "stream": True, "stream_options": {"include_usage": "no"}}, None, 400,
     "'stream_options.include_usage' must be a boolean"),
    ({**CHAT, "stream": True, "stream_options": []}, None, 400, "'stream_options' must be an object"),
    # JSON that Python's reader refuses, and numbers no float holds: 400s, not 500s
    (None, b'{"model": "tiny", "max_tokens": 1' + b"0" * 5000 + b"}", 400, "could not be read"),
    (None, b'{"model": "tiny", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
    (None, b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1'
     + b"0" * 400 + b"}", 400, "'temperature' must be in [0.0, 2.0]"),
    (None, b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 404, "The model '\\ud800' does not"),
    ({**CHAT, "tool_choice": "required"}, None, 400, "'tool_choice' is not supported"),
    ({**CHAT, "top_k": "few"}, None, 400, "'top_k' must be an integer"),
])
def test_bad_input_gets_openai_shaped_4xx_and_the_server_stays_up(server, body, raw, status, message):
    r = post(server, "/v1/chat/completions", body, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and {"type", "param", "code"} <= err.keys()
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_neutral_values_of_unsupported_parameters_are_accepted(server):
    body = {**CHAT, "echo": False, "logprobs": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "response_format": {"type": "text"}, "seed": -2 ** 63, "tool_choice": "none",
            "modalities": ["text"], "stream": None, "stream_options": None, "top_k": -1}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    r = post(server, "/v1/completions", None, raw=b'{"model": "tiny", "max_tokens": 2, "prompt": "ab\\ud800"}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_client_that_gives_up_on_a_plain_request_cancels_it(server):
    """Not only streams: a non-streaming request whose client disconnects stops generating, and (one
    request at a time here) the next client is served at once."""
    before = metric(server, "jetflow_cancelled_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/chat/completions", json={**CHAT, "max_tokens": 450},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    deadline = time.time() + 20
    while metric(server, "jetflow_cancelled_total") == before and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server, "jetflow_cancelled_total") == before + 1
    assert post(server, "/v1/chat/completions", CHAT).json()["usage"]["completion_tokens"] == 4
    assert 'jetflow_requests_total{endpoint="/v1/chat/completions",status="499"}' in httpx.get(server + "/metrics").text


def test_openai_client_routes_and_tool_call_history(server, client):
    """What OpenAI clients send besides chat: a model looked up by id, HEAD probes, and history with an
    assistant turn whose content is null (it called a tool)."""
    assert client.models.retrieve("tiny").id == "tiny"
    missing = httpx.get(server + "/v1/models/gpt-9", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.head(server + "/health").status_code == 200
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "go"}]
    assert post(server, "/v1/chat/completions", {**CHAT, "messages": history}).status_code == 200
    bad = [{"role": "user", "content": None}]
    assert "content must be a string" in post(server, "/v1/chat/completions", {**CHAT, "messages": bad}).text


def test_a_client_that_leaves_while_sending_its_body_is_499_not_500(server):
    """Not a server error: counted as 499, and the server goes on serving."""
    before = labelled(server, "/v1/chat/completions", "499")
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 500\r\n\r\n{\"model\":")
        time.sleep(0.3)
    deadline = time.time() + 10
    while labelled(server, "/v1/chat/completions", "499") == before and time.time() < deadline:
        time.sleep(0.1)
    assert labelled(server, "/v1/chat/completions", "499") == before + 1
    assert labelled(server, "/v1/chat/completions", "500") == 0
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200


def test_metrics_label_only_known_routes(server):
    for path in ("/v1/x123", "/v1/models/abc", "/whatever"):
        httpx.get(server + path, headers={"Authorization": f"Bearer {KEY}"})
    text = httpx.get(server + "/metrics").text
    assert "/v1/x123" not in text and "/v1/models/abc" not in text
    assert 'jetflow_requests_total{endpoint="other",status="404"}' in text


def test_a_busy_or_bad_port_fails_at_once(endless_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = dict(os.environ, JETFLOW_CACHE=str(tmp_path), PYTHONPATH=str(Path(__file__).parents[1]))
        for args, message in ((["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                              (["--port", "70000"], "must be a TCP port in [0, 65535]")):
            out = subprocess.run([sys.executable, "-m", "jetflow.cli", "serve", "--target", str(endless_dir / "target"),
                                  "--drafter", "none", *args], env=env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
            assert "serving" not in out.stderr


def test_completion_bad_input_and_auth(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": ""})
    assert r.status_code == 400 and "'prompt' must not be empty" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": ["a", "b"]})
    assert r.status_code == 400 and "batches of prompts" in r.json()["error"]["message"]
    assert post(server, "/v1/chat/completions", CHAT, key=None).json()["error"]["message"].startswith("missing API key")
    r = post(server, "/v1/chat/completions", CHAT, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(server + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_full_queue_gets_429_with_retry_after(server):
    async def burst():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {**CHAT, "max_tokens": 400}
            return await asyncio.gather(*[c.post(server + "/v1/chat/completions", json=body,
                                                 headers={"Authorization": f"Bearer {KEY}"}) for _ in range(8)])

    codes = [r.status_code for r in asyncio.run(burst())]
    assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}  # queue of 2 (+ 1 running)
    limited = next(r for r in asyncio.run(burst()) if r.status_code == 429)
    assert int(limited.headers["Retry-After"]) >= 1 and limited.json()["error"]["code"] == "queue_full"


def metric(base, name) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def labelled(base, endpoint, status) -> float:
    """jetflow_requests_total of one endpoint and status (0 before the first)."""
    key = f'jetflow_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    lines = [line for line in httpx.get(base + "/metrics").text.splitlines() if line.startswith(key)]
    return float(lines[0].split()[1]) if lines else 0.0


def test_disconnect_cancels_and_metrics(server):
    before = metric(server, "jetflow_cancelled_total")
    gone_before = labelled(server, "/v1/chat/completions", "499")
    with httpx.stream("POST", server + "/v1/chat/completions", json={**CHAT, "max_tokens": 450, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 20
    while metric(server, "jetflow_cancelled_total") == before and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server, "jetflow_cancelled_total") == before + 1
    assert labelled(server, "/v1/chat/completions", "499") == gone_before + 1  # not a 200: its client left
    text = httpx.get(server + "/metrics").text
    assert "jetflow_tau_bucket" in text and "jetflow_queue_depth 0" in text
    assert metric(server, "jetflow_generated_tokens_total") > 0


def test_sigterm_finishes_in_flight_work_and_exits_0(endless_dir, tmp_path):
    proc, base = start_server(endless_dir / "target", endless_dir / "head", "--budget", "8", cache=tmp_path)
    out = {}

    async def long_request():
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(base + "/v1/completions", json={"model": "target", "prompt": "go", "max_tokens": 400})
            out["status"], out["body"] = r.status_code, r.json()

    async def main():
        task = asyncio.create_task(long_request())
        await asyncio.sleep(0.3)  # the request is running
        proc.send_signal(signal.SIGTERM)
        await task

    asyncio.run(main())
    assert proc.wait(timeout=60) == 0
    assert out["status"] == 200 and out["body"]["usage"]["completion_tokens"] == 400
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", timeout=2)


def test_a_stream_past_the_shutdown_timeout_ends_with_an_error_event_and_done(endless_dir, tmp_path):
    """SIGTERM with a stream still running past --shutdown-timeout: the stream is cancelled just before
    the deadline and ends like any failed stream (an error event, then [DONE]), not cut mid-response."""
    proc, base = start_server(endless_dir / "target", endless_dir / "head", "--budget", "8", "--max-batch", "1",
                              "--shutdown-timeout", "0.6", cache=tmp_path)
    lines, t0 = [], time.time()
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=30,
                      json={**CHAT, "model": "target", "max_tokens": 480, "stream": True}) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 2:
                proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data: "):])
    assert "the server is shutting down" in error["error"]["message"], (error, time.time() - t0)
    assert "Traceback" not in proc.stderr.read()


@pytest.mark.real
def test_smollm2_server_with_the_shipped_drafter(tmp_path):
    import jetflow
    from jetflow.models.loading import load_target

    proc, base = start_server("smollm2-135m-instruct", "auto", "--budget", "16", cache=tmp_path)
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": "What is 12 times 7?"}]
        got = c.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=48, temperature=0)
        # the default backend: llama.cpp where llama-cpp-python is installed, else torch
        want = jetflow.generate(load_target("smollm2-135m-instruct"), msgs, max_new_tokens=48)
        assert got.choices[0].message.content == want.text
        assert got.model_extra["jetflow"]["tau"] > 1.2
    finally:
        assert stop(proc) == 0


@pytest.fixture(scope="module")
def batched(endless_dir, tmp_path_factory):
    proc, base = start_server(endless_dir / "target", endless_dir / "head", "--width", "3", "--max-batch", "4",
                              "--max-queue", "8", cache=tmp_path_factory.mktemp("cache"))  # --budget auto
    yield base
    assert stop(proc) == 0


def test_batched_server_outputs_equal_solo_decoding(batched, endless_dir):
    """Seven concurrent requests (some streamed, different lengths, one sampled with a seed) through
    a batch of at most 4: each output equals the same request decoded alone."""
    import jetflow
    from jetflow.models.target import TargetModel

    target = TargetModel.load(str(endless_dir / "target"))
    asks = [("Tell me", 30, False), ("Once", 12, True), ("A story about the sea", 40, False), ("Hi", 5, True),
            ("Why", 25, False), ("List three", 18, True), ("x" * 40, 22, False)]

    async def ask(c, text, n, stream, **kw):
        body = {"model": "target", "messages": [{"role": "user", "content": text}], "max_tokens": n,
                "temperature": 0, "stream": stream, **kw}
        if not stream:
            r = await c.post(batched + "/v1/chat/completions", json=body)
            return r.json()["choices"][0]["message"]["content"]
        parts = []
        async with c.stream("POST", batched + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:])["choices"]
                    parts += [ch["delta"].get("content") or "" for ch in choices]
        return "".join(parts)

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            sampled = ask(c, "Tell me", 20, False, temperature=0.9, seed=11)
            return await asyncio.gather(*[ask(c, *a) for a in asks], sampled)

    *texts, sampled = asyncio.run(main())
    for (text, n, _), got in zip(asks, texts):
        assert got == jetflow.generate(target, [{"role": "user", "content": text}], max_new_tokens=n).text
    alone = httpx.post(batched + "/v1/chat/completions", timeout=60, json={
        "model": "target", "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 20,
        "temperature": 0.9, "seed": 11}).json()["choices"][0]["message"]["content"]
    assert sampled == alone  # seeded sampling: the same alone and in a busy batch
    sizes = {line.split()[0]: float(line.split()[1]) for line in httpx.get(batched + "/metrics").text.splitlines()
             if line.startswith("jetflow_batch_size_")}
    assert sizes['jetflow_batch_size_bucket{le="1"}'] < sizes["jetflow_batch_size_count"]  # steps with >1 request
    assert metric(batched, "jetflow_tokens_per_forward_count") == sizes["jetflow_batch_size_count"]


def test_batched_server_cancels_on_disconnect_and_drains_on_sigterm(endless_dir, tmp_path):
    proc, base = start_server(endless_dir / "target", endless_dir / "head", "--budget", "4", "--max-batch", "4",
                              cache=tmp_path)
    out = {}

    async def long_request(key, n):
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(base + "/v1/completions", json={"model": "target", "prompt": key, "max_tokens": n})
            out[key] = (r.status_code, r.json())

    async def main():
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=30,
                          json={**CHAT, "model": "target", "max_tokens": 450, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")  # a client that leaves early
        deadline = time.time() + 20
        while metric(base, "jetflow_cancelled_total") < 1 and time.time() < deadline:
            await asyncio.sleep(0.1)
        assert metric(base, "jetflow_cancelled_total") == 1
        tasks = [asyncio.create_task(long_request(k, n)) for k, n in (("go", 300), ("run", 200))]
        await asyncio.sleep(0.5)  # both are running, in one batch
        proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert proc.wait(timeout=60) == 0
    assert out["go"][0] == 200 and out["go"][1]["usage"]["completion_tokens"] == 300
    assert out["run"][0] == 200 and out["run"][1]["usage"]["completion_tokens"] == 200


class RecordingEngine:
    """Stands in for the engine behind the HTTP app (no model): records the jobs it is given, which
    never produce an event, so only the app's own handling of a request is under test."""

    def __init__(self):
        from types import SimpleNamespace

        from tiny import byte_tokenizer

        self.jetflow = SimpleNamespace(target=SimpleNamespace(tokenizer=byte_tokenizer(), max_context=512))
        self.metrics, self.queue_depth, self.jobs, self.failure = None, 0, [], None

    def submit(self, ids, request):
        from jetflow.serve.engine import Job

        job = Job(ids, request, asyncio.get_running_loop())
        self.jobs.append(job)
        return job

    def shutdown(self, *args):
        pass


def call_app(app, method: str, path: str, body: bytes = b"", then_disconnect: bool = False) -> list[dict]:
    """Drive an ASGI app in-process (ASGI spec 2.3, as uvicorn reports it): the messages it sent."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    if then_disconnect:
        messages.append({"type": "http.disconnect"})
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # nothing more comes

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_a_stream_whose_client_left_before_it_began_is_cancelled_and_counted_499():
    """The client is gone by the time the stream would start (Starlette then cancels the stream
    before its generator first runs, so the generator's own cleanup never runs): the job must still
    be cancelled, or it generates to max_tokens for nobody, holding a batch slot."""
    from jetflow.serve.app import create_app
    from jetflow.serve.metrics import Metrics

    engine, metrics = RecordingEngine(), Metrics()
    app = create_app(engine, "tiny", metrics=metrics)
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 400, "stream": True}).encode()
    call_app(app, "POST", "/v1/completions", body, then_disconnect=True)
    assert len(engine.jobs) == 1 and engine.jobs[0].cancelled.is_set()
    assert metrics.cancelled == 1
    assert 'jetflow_requests_total{endpoint="/v1/completions",status="499"} 1' in metrics.render(0, 0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("drafted", [True, False])
def test_a_client_gone_while_its_text_is_held_back_stops_the_one_at_a_time_worker(endless_dir, monkeypatch, stream,
                                                                                  drafted):
    """--max-batch 1: a job with no text to send (a stop string longer than its output holds it all
    back) whose client leaves mid-generation stops at the end of the round it is in, not at
    max_tokens with the queue blocked meanwhile, and the request counts as cancelled (499). Both
    loops: speculative (a verify per round) and plain (a greedy step per token)."""
    import threading

    from jetflow import JetFlow
    from jetflow.models.draft_head import DraftHead
    from jetflow.models.target import TargetModel
    from jetflow.serve.app import create_app
    from jetflow.serve.engine import Engine
    from jetflow.serve.metrics import Metrics

    target = TargetModel.load(str(endless_dir / "target"))
    head = DraftHead.from_pretrained(str(endless_dir / "head")) if drafted else None
    jf = JetFlow(target, head, budget=4, width=3)
    engine, metrics, app = None, Metrics(), None
    step = "verify" if drafted else "greedy_step"  # what each round of the loop calls once
    run_round, rounds, jobs = getattr(target, step), [], []
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 300, "stop": "x" * 400, "temperature": 0,
                       "stream": stream}).encode()

    async def main():
        loop, leave, sent = asyncio.get_running_loop(), asyncio.Event(), []

        def round_then_leave(*args, **kw):  # the worker's round: in the third, the client leaves
            rounds.append(len(rounds) + 1)
            if len(rounds) == 3:
                jobs.extend(engine._running)
                loop.call_soon_threadsafe(leave.set)
                assert jobs[0].cancelled.wait(30)  # the app has noticed and cancelled the job
            return run_round(*args, **kw)

        monkeypatch.setattr(target, step, round_then_leave)
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        await asyncio.to_thread(engine.shutdown, False, 60)  # the worker finishes the job, then stops
        return await asyncio.wait_for(jobs[0].events.get(), 10), sent

    engine = Engine(jf, max_batch=1)
    app = create_app(engine, "tiny", metrics=metrics)
    (kind, _), sent = asyncio.run(main())
    assert rounds == [1, 2, 3]  # no round after the one the client left in
    assert kind == "cancelled"
    assert sent[0]["status"] == (200 if stream else 499)
    assert metrics.cancelled == 1
    assert 'jetflow_requests_total{endpoint="/v1/completions",status="499"} 1' in metrics.render(0, 0)


def test_health_is_503_once_the_worker_has_died():
    from jetflow.serve.app import create_app

    engine = RecordingEngine()
    app = create_app(engine, "tiny")
    assert call_app(app, "GET", "/health")[0]["status"] == 200
    engine.failure = "the generation worker stopped: MemoryError: no room"
    sent = call_app(app, "GET", "/health")
    assert sent[0]["status"] == 503 and b"MemoryError" in sent[1]["body"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("event, status, code", [
    (("error", "step"), 500, None),  # the batch's step failed: the server's fault, not the request's
    (("cancelled", "the server is shutting down"), 503, "shutting_down"),
    (("error", "invalid"), 400, None),  # the worker found the request itself unusable
])
def test_what_the_worker_reports_maps_to_the_status_a_client_sees(event, status, code, stream):
    """Each way a job can end inside the worker, as a plain response's status and error body, and
    as a stream's error event (its 200 already sent), with the request counted under that status."""
    from jetflow.errors import InvalidRequestError
    from jetflow.serve.app import create_app
    from jetflow.serve.engine import StepFailed
    from jetflow.serve.metrics import Metrics

    kind, what = event
    payload = {"step": StepFailed("batch step failed: RuntimeError: boom"),
               "invalid": InvalidRequestError("prompt too long for the batch")}.get(what, what)

    class Reporting(RecordingEngine):
        def submit(self, ids, request):
            job = super().submit(ids, request)
            job.events.put_nowait((kind, payload))
            return job

    metrics = Metrics()
    app = create_app(Reporting(), "tiny", metrics=metrics)
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": stream}).encode()
    sent = call_app(app, "POST", "/v1/completions", body)
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    if stream:
        assert sent[0]["status"] == 200 and text.rstrip().endswith("data: [DONE]")
        error = json.loads(text.split("data: ")[1])["error"]
    else:
        assert sent[0]["status"] == status
        error = json.loads(text)["error"]
        assert f'jetflow_requests_total{{endpoint="/v1/completions",status="{status}"}} 1' in metrics.render(0, 0)
    assert str(payload) in error["message"] and error["type"] in ("server_error", "invalid_request_error")
    if code and not stream:
        assert error["code"] == code

#!/usr/bin/env python3
"""Real clients against the real `strata serve` binary and the default model.

The pinned official `openai` SDK (installed by scripts/setup.sh into $STRATA_CACHE/clients-venv)
does chat, completions and streaming with and without an API key (and sees `system_fingerprint`);
a browser origin's CORS preflight is answered before the key (`--allowed-origins`); a real nginx
(Debian package, stock `proxy_buffering on`) proxies the server, and streamed chunks must reach the
client as they are generated; 64 concurrent streams through nginx finish with no error and no leaked KV block;
SIGTERM stops the server with exit status 0.

usage: clients-venv/bin/python tests/clients/real_clients.py   (env STRATA_BIN: the binary)
"""
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request

import openai
import pydantic
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("STRATA_BIN", os.path.join(ROOT, "target", "debug", "strata"))
MODEL = "smol"
API_KEY = "client-test-key"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


# The flags of every server here; tests/soak/soak.py passes its own.
SERVE_FLAGS = ["--threads", "2", "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--max-num-seqs", "64",
               "--shutdown-timeout", "20"]


class Server:
    """`strata serve` on a free port; stop() sends SIGTERM and expects exit status 0."""

    def __init__(self, tmp, api_key=None, flags=SERVE_FLAGS):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp, f"strata-{self.port}.log")
        env = dict(os.environ)
        env.pop("STRATA_API_KEY", None)
        if api_key:
            env["STRATA_API_KEY"] = api_key
        args = [BIN, "serve", "--port", str(self.port), "--served-model-name", MODEL] + flags
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if http_get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("strata serve did not become healthy in 120 s:\n" + self.log_tail())
            time.sleep(0.2)

    def log_tail(self):
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-30:])

    def metrics(self):
        text = http_get(self.url + "/metrics")[1]
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(strata_\S+) (\S+)$", text, re.M)}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("strata serve did not stop within 60 s of SIGTERM")
        self.log.close()
        assert code == 0, f"strata serve exited with {code} after SIGTERM:\n{self.log_tail()}"


class Nginx:
    """A real nginx in front of `upstream`, stock buffering (proxy_buffering on), no daemon.
    The server's `X-Accel-Buffering: no` is what tells it to pass a stream through."""

    def __init__(self, tmp, upstream_port):
        self.port = free_port()
        self.start(os.path.join(tmp, "nginx"), f"""
    server {{
        listen 127.0.0.1:{self.port};
        location / {{
            proxy_pass http://127.0.0.1:{upstream_port};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 300s;
        }}
    }}""")

    def start(self, prefix, http_body):
        """Writes nginx.conf under `prefix` with `http_body` inside its http block, checks it with
        `nginx -t`, runs it (no daemon) and waits until `self.port` listens."""
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(prefix, exist_ok=True)
        user = "user root;" if os.geteuid() == 0 else ""
        temp = "".join(f"{kind}_temp_path {prefix}/{kind};\n" for kind in
                       ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"])
        conf = f"""{user}
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log off;
    {temp}
    {http_body}
}}
"""
        path = os.path.join(prefix, "nginx.conf")
        with open(path, "w") as f:
            f.write(conf)
        args = [nginx, "-p", prefix, "-c", path, "-e", f"{prefix}/error.log"]
        test = subprocess.run(args[:1] + ["-t"] + args[1:], capture_output=True, text=True)
        if test.returncode != 0:
            raise RuntimeError(f"nginx -t:\n{test.stderr}")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}; see {prefix}/error.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("nginx did not listen in 20 s")
                time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def check_sdk_calls(client):
    """Chat, completion and both streams through the official SDK."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert chat.object == "chat.completion", chat
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content, chat
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    two = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=4, n=2, seed=7,
                                         temperature=0.8, extra_body={"top_k": 20})
    assert [c.index for c in two.choices] == [0, 1], two

    completion = client.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"],
                                           max_tokens=4, temperature=0, logprobs=1)
    assert completion.object == "text_completion"
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(c.text and c.logprobs.tokens for c in completion.choices), completion

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"]), finishes
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert text == whole.choices[0].message.content, (text, whole)

    parts = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices)
    assert parts[-1].choices[0].finish_reason == "length"

    try:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
        raise AssertionError("temperature -1 was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "temperature", e.body
    try:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.body["code"] == "model_not_found", e.body
    assert [m.id for m in client.models.list()] == [MODEL]


BROWSER_ORIGIN = "http://localhost:5173"


def check_browser_cors(base_url):
    """A browser page's preflight before a keyed SDK call: 204 for the allowed origin with what it
    may send, 403 for another; the real call's answer names the origin too."""
    def options(origin):
        req = urllib.request.Request(base_url + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-stainless-lang"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.headers
    status, headers = options(BROWSER_ORIGIN)
    assert status == 204, status
    assert headers["Access-Control-Allow-Origin"] == BROWSER_ORIGIN, dict(headers)
    allowed = headers["Access-Control-Allow-Headers"]
    assert all(h in allowed for h in ["authorization", "content-type", "x-stainless-lang"]), allowed
    assert "POST" in headers["Access-Control-Allow-Methods"], dict(headers)
    status, headers = options("http://evil.example")
    assert status == 403 and headers["Access-Control-Allow-Origin"] is None, (status, dict(headers))
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120,
                           default_headers={"Origin": BROWSER_ORIGIN})
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert raw.headers["access-control-allow-origin"] == BROWSER_ORIGIN, dict(raw.headers)


def check_system_fingerprint(client):
    """`system_fingerprint` on a chat completion, every stream chunk and a completion: one value."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    fingerprint = chat.system_fingerprint
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fingerprint or ""), fingerprint
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True))
    assert chunks and all(c.system_fingerprint == fingerprint for c in chunks), chunks
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert completion.system_fingerprint == fingerprint, completion


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    """Nested objects, an array and an enum: the shape of the structured-output check."""
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Annotated[str, pydantic.Field(max_length=12)]] = pydantic.Field(max_length=3)


def check_structured_output(client):
    """The SDK's `parse` with a pydantic model (strict json_schema): 50 sampled answers, every one
    parses and validates; a streamed one equals the unstreamed; json_object gives an object."""
    messages = [{"role": "user", "content": "Invent a person and describe them as JSON."}]

    def one(seed):
        done = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Person,
                                             max_tokens=300, temperature=1.0, seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", (seed, choice)
        assert isinstance(choice.message.parsed, Person), (seed, choice.message.content)
        Person.model_validate_json(choice.message.content, strict=True)
        return choice.message.parsed
    with ThreadPoolExecutor(16) as pool:
        people = list(pool.map(one, range(50)))
    assert len({p.model_dump_json() for p in people}) > 1, "50 seeds gave one answer"
    print(f"     50 of 50 sampled answers validate, e.g. {people[0].model_dump_json()}")
    schema = {"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                     "schema": openai.lib._pydantic.to_strict_json_schema(Person)}}
    whole = client.chat.completions.create(model=MODEL, messages=messages, response_format=schema,
                                           max_tokens=300, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, response_format=schema,
                                                 max_tokens=300, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content, (streamed, whole)
    Person.model_validate_json(streamed, strict=True)
    obj = client.chat.completions.create(
        model=MODEL, response_format={"type": "json_object"}, max_tokens=300, temperature=0,
        messages=[{"role": "user", "content": "Give me a JSON object with the keys name and age of a cat."}])
    assert obj.choices[0].finish_reason == "stop", obj
    assert isinstance(json.loads(obj.choices[0].message.content), dict), obj
    try:
        client.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "sound"})
        raise AssertionError("response_format sound was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"].startswith("response_format"), e.body


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def check_tool_calls(client):
    """tool_choice="required" through the SDK, whole and streamed: the grammar makes the tiny model
    call get_weather with arguments that parse and match the schema."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
               tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=64,
               temperature=0)
    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", whole
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather", call
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments.get("city"), str) and set(arguments) == {"city"}, arguments

    calls, finishes = {}, []
    for chunk in client.chat.completions.create(stream=True, **ask):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            if part.index not in calls:
                assert part.id.startswith("call_") and part.function.arguments == "", part
                calls[part.index] = [part.function.name, ""]
            else:
                calls[part.index][1] += part.function.arguments
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    assert finishes == ["tool_calls"], finishes
    assert list(calls.values()) == [["get_weather", call.function.arguments]], (calls, call)


def stream_arrivals(client):
    """Streams 64 greedy tokens; returns (start, [arrival time of each content chunk], end)."""
    start = time.monotonic()
    arrivals = []
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    return start, arrivals, time.monotonic()


def bursts(arrivals, gap=0.001):
    """How many separate deliveries the chunks came in (arrivals closer than `gap` are one). Chunks
    a proxy held back arrive in one read, microseconds apart; the CPU generates tokens at least
    ~3 ms apart even in a release build (a 5 ms gap counted fast decode as bursts)."""
    return 1 + sum(1 for a, b in zip(arrivals, arrivals[1:]) if b - a > gap)


def assert_incremental(start, arrivals, end):
    """Chunks that came through a proxy as they were generated: many, in separate deliveries, the
    first well before the end (held back, it would have come with the rest)."""
    assert len(arrivals) >= 32, len(arrivals)
    # Buffered, they would come in a few large deliveries at the end.
    assert bursts(arrivals) >= len(arrivals) // 2, "the proxy delivered the stream in bursts"
    # Relative to the request's time: decode speed varies with the machine and the build.
    assert end - arrivals[0] > 0.5 * (end - start), "the proxy held the stream back until the end"


def check_responses(client, via_nginx):
    """The Responses API through the SDK: the answer the chat path gives, `incomplete` at
    max_output_tokens, the events in order through nginx as they are generated, the stream helper's
    final response, a forced function call and its output sent back, a stateful request refused."""
    r = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_"), r
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text", r
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}] + MESSAGES,
                                          max_tokens=8, temperature=0)
    assert r.output_text and r.output_text == chat.choices[0].message.content, (r.output_text, chat)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed"), r

    start = time.monotonic()
    events, arrivals = [], []
    for event in via_nginx.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=48, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}):
        events.append(event)
        if event.type == "response.output_text.delta":
            arrivals.append(time.monotonic())
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events))), types
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(arrivals)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete"]), types
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens", final
    assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.usage.output_tokens == 48, final.usage
    print(f"     responses via nginx: {len(arrivals)} deltas in {bursts(arrivals)} deliveries, the first "
          f"{arrivals[0] - start:.2f}s after the request")
    assert bursts(arrivals) >= len(arrivals) // 2, "nginx delivered the response stream in bursts"

    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=200, temperature=0) as helper:
        texts = [e.delta for e in helper if e.type == "response.output_text.delta"]
        done = helper.get_final_response()
    assert done.status == "completed" and done.output_text == "".join(texts) and texts, done

    # A forced call, then its output sent back with the SDK's own output items, as OpenAI's docs do.
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.responses.create(model=MODEL, input=ask, tools=[tool], parallel_tool_calls=False, temperature=0,
                                     max_output_tokens=64, tool_choice={"type": "function", "name": "get_weather"})
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather", called
    assert isinstance(json.loads(call.arguments).get("city"), str), call
    answered = client.responses.create(model=MODEL, tools=[tool], max_output_tokens=8, temperature=0, input=ask
                                       + called.output + [{"type": "function_call_output", "call_id": call.call_id,
                                                           "output": "18C and sunny"}])
    assert answered.output_text, answered

    try:
        client.responses.create(model=MODEL, input="hi", store=True)
        raise AssertionError("store: true was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "store", e.body


async def concurrent_streams(base_url, api_key, n):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)

    async def one(i):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}?"}],
            max_tokens=4, stream=True, temperature=0.7, seed=i)
        finish = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        if finish not in ("stop", "length"):
            raise AssertionError(f"stream {i} ended without a finish reason")

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    await client.close()
    return [r for r in results if isinstance(r, BaseException)]


def wait_no_blocks_used(server):
    deadline = time.time() + 15
    while True:
        m = server.metrics()
        if m["strata_kv_blocks_used"] == 0 and m["strata_num_requests_running"] == 0:
            return m
        if time.time() > deadline:
            raise AssertionError(f"KV blocks still used: {m['strata_kv_blocks_used']}")
        time.sleep(0.1)


class Skip(Exception):
    """A check that cannot run on this machine; the message says why."""


class Checks:
    """Runs named checks one by one, printing ok / skip / FAIL with the traceback, and tallies them."""

    def __init__(self, label):
        self.label = label
        self.results = []

    def run(self, name, fn):
        t0 = time.monotonic()
        try:
            fn()
            self.results.append("passed")
            print(f"ok   {name} ({time.monotonic() - t0:.1f}s)")
        except Skip as why:
            self.results.append("skipped")
            print(f"skip {name}: {why}")
        except Exception:
            self.fail(name)

    def fail(self, name):
        """Records a failure outside a check (its setup), with the exception being handled."""
        self.results.append("failed")
        print(f"FAIL {name}\n{traceback.format_exc()}")

    def exit(self):
        passed, failed, skipped = (self.results.count(k) for k in ["passed", "failed", "skipped"])
        print(f"{self.label}: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
        sys.exit(1 if failed else 0)


def main():
    if not os.path.exists(BIN):
        sys.exit(f"{BIN} is missing; build it first (cargo build -p strata-cli) or set STRATA_BIN")
    print(f"real clients: openai {openai.__version__}, {BIN}")
    tmp = tempfile.mkdtemp(prefix="strata-clients-")
    checks = Checks("real clients")
    run = checks.run

    open_server = keyed = proxy = None
    try:
        open_server = Server(tmp)
        keyed = Server(tmp, api_key=API_KEY, flags=SERVE_FLAGS + ["--allowed-origins", BROWSER_ORIGIN])
        plain = openai.OpenAI(base_url=open_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with_key = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        def startup_log_and_flag_errors():
            log = open_server.log_tail()
            assert re.search(r"KV cache: \d+ blocks x 16 tokens = \d+ tokens .*sequences of --max-model-len 2048 fit",
                             log), log
            for args, says in [(["--kv-cache-memory", "1MiB"], "raise --kv-cache-memory"),
                               (["--kv-cache-memory", "lots"], "not a size"),
                               (["--port", str(open_server.port)], "pass another --port")]:
                done = subprocess.run([BIN, "serve", "--max-model-len", "2048"] + args, capture_output=True,
                                      text=True, timeout=120)
                assert done.returncode != 0 and says in done.stderr, (args, done.returncode, done.stderr)
        run("strata serve: capacity in the start log, flag errors say the fix", startup_log_and_flag_errors)
        run("openai SDK: chat, completions, streams, errors (no API key)", lambda: check_sdk_calls(plain))
        run("openai SDK: chat, completions, streams, errors (--api-key)", lambda: check_sdk_calls(with_key))

        def refused_without_key():
            for key in ["wrong-key", API_KEY + "x"]:
                bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)
                try:
                    bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
                    raise AssertionError("a wrong key was accepted")
                except openai.AuthenticationError as e:
                    assert e.status_code == 401 and e.body["code"] == "invalid_api_key", e.body
            assert http_get(keyed.url + "/health")[0] == 200
        run("--api-key: wrong keys get 401 in OpenAI's shape, /health stays open", refused_without_key)
        run("--allowed-origins: a browser's preflight gets 204 before the key, another origin 403",
            lambda: check_browser_cors(keyed.url))
        run("openai SDK: system_fingerprint on completions and every chunk", lambda: check_system_fingerprint(plain))
        run("openai SDK: structured output (parse with a pydantic model), 50 of 50 validate",
            lambda: check_structured_output(plain))
        run("openai SDK: tool_choice=required calls parse, whole and streamed", lambda: check_tool_calls(plain))

        proxy = Nginx(tmp, open_server.port)
        via_nginx = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def incremental_through_nginx():
            start, arrivals, end = stream_arrivals(via_nginx)
            lead = end - arrivals[0]
            print(f"     via nginx: {len(arrivals)} content chunks in {bursts(arrivals)} deliveries; the first "
                  f"{arrivals[0] - start:.2f}s after the request and {lead:.2f}s before the end")
            assert_incremental(start, arrivals, end)
        run("nginx (proxy_buffering on): chunks arrive as generated", incremental_through_nginx)

        run("openai SDK: responses, streamed through nginx and not", lambda: check_responses(plain, via_nginx))

        def sixty_four_streams():
            t0 = time.monotonic()
            errors = asyncio.run(concurrent_streams(proxy.url + "/v1", "unused", 64))
            print(f"     64 streams through nginx in {time.monotonic() - t0:.1f}s, {len(errors)} errors")
            assert not errors, [repr(e) for e in errors[:5]]
            m = wait_no_blocks_used(open_server)
            assert m["strata_kv_blocks_free"] == m["strata_kv_blocks_total"]
            assert m['strata_http_requests_total{route="/v1/chat/completions",status="200"}'] >= 64
        run("64 concurrent streams: 0 errors, no leaked KV blocks", sixty_four_streams)

        def sigterm_exits_zero():
            for s in (open_server, keyed):
                s.stop()
        run("SIGTERM: strata serve exits 0", sigterm_exits_zero)
    except Exception:
        checks.fail("setup")
    finally:
        if proxy:
            proxy.stop()
        for s in (open_server, keyed):
            if s and s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    checks.exit()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Soak: the real `strata serve` binary on the default model (CPU) under mixed load for a while.

Workers send chat and completions, streamed and not; disconnect mid-stream (closing or resetting
the socket); send bad bodies (malformed JSON, wrong types, numbers too large for their field);
and read streams slowly through a small receive buffer. One more client sends every bad body in
turn, four a second. The KV cache is small enough that the
scheduler must preempt. At the end it checks: no 5xx (as seen by the clients and in /metrics),
every request answered or cleanly refused (a 4xx with an OpenAI-style JSON error, or 429), KV
blocks back to their idle baseline once the server is idle, preemptions > 0, server RSS at the end
of the load within 10% of its high-water mark after the warm-up, and exit status 0 on SIGTERM.
It prints a summary table and exits 1 on any violation. The standard library, plus the Server of
tests/clients/real_clients.py (so run it with the clients venv's python, as the Makefile does).

usage: clients-venv/bin/python tests/soak/soak.py [--duration S] [--workers N]   (env STRATA_BIN: the binary)
"""
import argparse
import collections
import http.client
import json
import os
import random
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "clients"))
from real_clients import BIN, MODEL, Server  # noqa: E402  `strata serve` on a free port, SIGTERM to stop

# A KV cache that holds about three of the eight running sequences (SmolLM2-135M: ~45 KiB per
# token, so 16 MiB is 22 blocks of 16 tokens), so the scheduler must preempt; a short queue, so
# some requests get 429.
SERVER_FLAGS = ["--threads", "2", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
                "--max-num-seqs", "8", "--max-queue", "8", "--shutdown-timeout", "20"]
REQUEST_TIMEOUT_S = 180
RSS_GROWTH_LIMIT = 0.10
WORDS = ("sea river stone cloud light ember quiet north garden lantern harbor meadow signal "
         "winter copper orchard window thunder paper valley").split()

# Kinds of request and how often each is sent.
KIND_WEIGHTS = {
    "chat_stream": 4,
    "chat": 2,
    "completion_stream": 3,
    "completion": 2,
    "slow_reader": 2,
    "disconnect": 2,
    "bad_body": 3,
}
OUTCOMES = ["ok", "4xx", "429", "client_closed", "violation"]

# Bodies the server must refuse with a 4xx and a JSON error: (name, path, body bytes).
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def _j(value):
    return json.dumps(value).encode()


BAD_BODIES = [
    ("truncated JSON", CHAT, b'{"model": "soak", "messages": [{"role": "user", "content": "hi"'),
    ("not JSON", CHAT, b"hello there"),
    ("empty body", COMPLETIONS, b""),
    ("trailing garbage", COMPLETIONS, b'{"prompt": "hi"}}'),
    ("array body", CHAT, b'[{"role": "user", "content": "hi"}]'),
    ("invalid UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}'),
    ("messages is a string", CHAT, _j({"messages": "hello"})),
    ("role is a number", CHAT, _j({"messages": [{"role": 5, "content": "x"}]})),
    ("messages missing", CHAT, _j({"model": MODEL})),
    ("prompt is a number", COMPLETIONS, _j({"prompt": 42})),
    ("max_tokens is a string", CHAT, _j({"messages": HI, "max_tokens": "ten"})),
    ("stream is a string", COMPLETIONS, _j({"prompt": "hi", "stream": "yes"})),
    ("temperature is a string", CHAT, _j({"messages": HI, "temperature": "hot"})),
    ("max_tokens 2^64", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 18446744073709551616}'),
    ("max_tokens 1e30", COMPLETIONS, b'{"prompt": "hi", "max_tokens": 1e30}'),
    ("max_tokens negative", COMPLETIONS, _j({"prompt": "hi", "max_tokens": -5})),
    ("temperature 1e300", CHAT, _j({"messages": HI, "temperature": 1e300})),
    ("temperature 1e999", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}'),
    ("n 10^11", COMPLETIONS, _j({"prompt": "hi", "n": 10 ** 11})),
    ("seed 10^30", COMPLETIONS, b'{"prompt": "hi", "seed": 1000000000000000000000000000000}'),
    ("top_logprobs 2^32", CHAT, _j({"messages": HI, "logprobs": True, "top_logprobs": 2 ** 32})),
    ("token id 10^9", COMPLETIONS, _j({"prompt": [10 ** 9]})),
    ("prompt longer than --max-model-len", COMPLETIONS, _j({"prompt": " ".join(["word"] * 600)})),
    ("unknown model", CHAT, _j({"model": "gpt-9", "messages": HI})),
]


def vm_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


class Violation(Exception):
    """The server did something a client must never see."""


def connect(port, rcvbuf=None):
    """An HTTP connection; with `rcvbuf`, a small receive buffer set before connecting (a slow reader)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(REQUEST_TIMEOUT_S)
    sock.connect(("127.0.0.1", port))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    conn.sock = sock
    return conn


def post(conn, path, body):
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    return conn.getresponse()


def refusal(resp):
    """Outcome of a non-2xx answer: a clean refusal, or a Violation."""
    body = resp.read()
    if resp.status >= 500:
        raise Violation(f"HTTP {resp.status}: {body[:200]!r}")
    if not 400 <= resp.status < 500:
        raise Violation(f"unexpected HTTP {resp.status}: {body[:200]!r}")
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if not isinstance(message, str) or not message:
        raise Violation(f"HTTP {resp.status} without an OpenAI-style JSON error: {body[:200]!r}")
    return "429" if resp.status == 429 else "4xx"


class SseEvents:
    """Splits bytes into SSE `data:` payloads; checks each is JSON without an error, or [DONE]."""

    def __init__(self):
        self.buffer = b""
        self.done = False
        self.content_events = 0

    def feed(self, data):
        self.buffer += data
        while b"\n\n" in self.buffer and not self.done:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments (`: keep-alive`) and other fields
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    break
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    raise Violation(f"bad JSON in the stream: {payload[:200]!r}")
                if "error" in chunk:
                    raise Violation(f"error event in the stream: {payload[:200]!r}")
                if chunk.get("choices"):
                    self.content_events += 1


def good_body(rng, chat, stream):
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60)))
    body = {"model": MODEL, "max_tokens": rng.randint(8, 64), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Write about {words}."}]
    else:
        body["prompt"] = f"Once upon a time, {words}"
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        body["seed"] = rng.randint(0, 2 ** 31)
    return _j(body)


def check_full(resp, chat):
    body = resp.read()
    try:
        answer = json.loads(body)
        choice = answer["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        finish = choice["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise Violation(f"a 200 answer without choices: {body[:200]!r}")
    if not isinstance(text, str) or finish not in ("stop", "length"):
        raise Violation(f"odd answer: text {text!r}, finish_reason {finish!r}")
    return "ok"


def read_stream(resp, events, slow=False, rng=None):
    while not events.done:
        data = resp.read1(256) if slow else resp.read1(65536)
        if not data:
            raise Violation("the stream ended without data: [DONE]")
        events.feed(data)
        if slow:
            time.sleep(rng.uniform(0.05, 0.15))
    if events.content_events == 0:
        raise Violation("a stream with no chunk")
    return "ok"


def send_bad_body(port, name, path, body):
    """Sends one body the server must refuse; returns the outcome, or raises Violation."""
    conn = connect(port)
    try:
        with post(conn, path, body) as resp:
            if 200 <= resp.status < 300:
                raise Violation(f"bad body ({name}) was accepted with HTTP {resp.status}")
            return refusal(resp)
    except (OSError, http.client.HTTPException) as e:
        raise Violation(f"bad body ({name}): {type(e).__name__}: {e}")
    finally:
        conn.close()


def one_request(port, kind, rng):
    """Sends one request of `kind`; returns its outcome, or raises Violation."""
    if kind == "bad_body":
        return send_bad_body(port, *rng.choice(BAD_BODIES))
    chat = kind.startswith("chat") or (kind in ("slow_reader", "disconnect") and rng.random() < 0.5)
    stream = kind.endswith("_stream") or kind in ("slow_reader", "disconnect")
    path = CHAT if chat else COMPLETIONS
    slow = kind == "slow_reader"
    conn = connect(port, rcvbuf=4096 if slow else None)
    resp = None
    try:
        resp = post(conn, path, good_body(rng, chat, stream))
        if resp.status != 200:
            return refusal(resp)
        if not stream:
            return check_full(resp, chat)
        events = SseEvents()
        if kind == "disconnect":
            # Leave after 0-4 events: before the first token (queued), or mid-stream.
            wanted = rng.randint(0, 4)
            while events.content_events < wanted and not events.done:
                data = resp.read1(4096)
                if not data:
                    raise Violation("the stream ended without data: [DONE]")
                events.feed(data)
            if rng.random() < 0.5:  # a reset instead of a clean close
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return "client_closed"
        return read_stream(resp, events, slow=slow, rng=rng)
    except (OSError, http.client.HTTPException) as e:
        raise Violation(f"{type(e).__name__}: {e}")
    finally:
        if resp is not None:
            resp.close()  # the response holds the socket open too
        conn.close()


class Tally:
    """Outcomes by kind, and the first violations."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = collections.defaultdict(collections.Counter)
        self.violations = []

    def add(self, kind, outcome, message=None):
        with self.lock:
            self.counts[kind][outcome] += 1
            if message is not None:
                self.violations.append(f"{kind}: {message}")


def worker(port, deadline, seed, tally):
    rng = random.Random(seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    while time.time() < deadline:
        kind = rng.choices(kinds, weights)[0]
        outcome = "violation"
        try:
            outcome = one_request(port, kind, rng)
            tally.add(kind, outcome)
        except Violation as v:
            tally.add(kind, outcome, str(v))
        except Exception as e:  # a client-side error is still a request that was not answered
            tally.add(kind, outcome, f"{type(e).__name__}: {e}")
        if outcome == "429":
            time.sleep(rng.uniform(0.5, 1.5))


def bad_body_worker(port, deadline, tally, pause_s=0.25):
    """Every bad body in turn, a few a second, beside the generation: each is refused many times."""
    i = 0
    while time.time() < deadline:
        name, path, body = BAD_BODIES[i % len(BAD_BODIES)]
        try:
            tally.add("bad_body", send_bad_body(port, name, path, body))
        except Violation as v:
            tally.add("bad_body", "violation", str(v))
        i += 1
        time.sleep(pause_s)


class Sampler(threading.Thread):
    """Every half second: the server's VmRSS and KV blocks in use, with the time."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server = server
        self.samples = []  # (unix time, rss KiB, kv blocks used)
        self.stop_event = threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            try:
                rss = vm_rss_kib(self.server.proc.pid)
                used = self.server.metrics().get("strata_kv_blocks_used", float("nan"))
                self.samples.append((time.time(), rss, used))
            except (OSError, RuntimeError):
                pass
            self.stop_event.wait(0.5)


def wait_idle(server, baseline_used, timeout=60):
    """Metrics once nothing runs or waits and the KV blocks are back (or the timeout passes)."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        idle = m.get("strata_num_requests_running") == 0 and m.get("strata_num_requests_waiting") == 0
        if (idle and m.get("strata_kv_blocks_used") == baseline_used) or time.time() > deadline:
            return m
        time.sleep(0.5)


def server_5xx(m):
    return sum(v for k, v in m.items() if k.startswith("strata_http_requests_total") and 'status="5' in k)


def table(headers, rows):
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    fmt = lambda row: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60, help="seconds of load (default 60)")
    parser.add_argument("--workers", type=int, default=10, help="concurrent clients (default 10)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the RSS reference (default: a quarter of --duration, at most 60)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else min(60.0, args.duration / 4)
    if not 0 < warmup < args.duration:
        sys.exit("error: --warmup must be between 0 and --duration")

    tmp = tempfile.mkdtemp(prefix="strata-soak-")
    print(f"soak: {BIN} serve {' '.join(SERVER_FLAGS)}; {args.workers} clients + 1 of bad bodies for {args.duration:.0f} s "
          f"(warm-up {warmup:.0f} s)", flush=True)
    server = Server(tmp, flags=SERVER_FLAGS)
    failures = []
    finished = False
    try:
        before = server.metrics()
        baseline_used = before["strata_kv_blocks_used"]
        tally = Tally()
        sampler = Sampler(server)
        sampler.start()
        load_start = time.time()
        deadline = load_start + args.duration
        threads = [threading.Thread(target=worker, args=(server.port, deadline, args.seed * 1000 + i, tally))
                   for i in range(args.workers)]
        threads.append(threading.Thread(target=bad_body_worker, args=(server.port, deadline, tally)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        load_end = time.time()
        load_s = load_end - load_start
        after = wait_idle(server, baseline_used)
        sampler.stop_event.set()
        sampler.join()
        rss_idle = vm_rss_kib(server.proc.pid)
        alive = server.proc.poll() is None
        finished = True
    finally:
        try:
            server.stop()
            stopped = "exit status 0"
        except AssertionError as e:
            stopped = str(e)
        with open(server.log_path) as f:
            log_tail = "".join(f.readlines()[-30:])
        shutil.rmtree(tmp, ignore_errors=True)
        if not finished:
            print(f"soak: stopped early; server log, last lines:\n{log_tail}")

    # Figures.
    # RSS: the high-water mark of the warm-up against that of the last fifth (at least 3 s) of the
    # time requests were being started; the drain after it runs fewer requests.
    during = [(t - load_start, rss, used) for t, rss, used in sampler.samples if t <= load_end]
    warm = [rss for t, rss, _ in during if t <= warmup]
    tail_from = args.duration - max(3.0, 0.2 * args.duration)
    tail = [rss for t, rss, _ in during if tail_from <= t <= args.duration and t > warmup]
    rss_warm = max(warm) if warm else float("nan")
    rss_end = max(tail) if tail else float("nan")
    growth = rss_end / rss_warm - 1 if warm and tail else float("nan")
    peak_used = max((u for _, _, u in during if u == u), default=float("nan"))
    preemptions = after.get("strata_preemptions_total", 0) - before.get("strata_preemptions_total", 0)
    five_xx = server_5xx(after)
    counts = tally.counts
    rows = []
    for kind in KIND_WEIGHTS:
        c = counts.get(kind, collections.Counter())
        rows.append([kind, sum(c.values())] + [c[o] for o in OUTCOMES])
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    rows.append(["all", sum(total.values())] + [total[o] for o in OUTCOMES])
    print()
    print(table(["requests", "sent"] + OUTCOMES, rows))
    print()
    print(f"load: {args.duration:.0f} s of new requests + {load_s - args.duration:.1f} s to finish them, "
          f"{sum(total.values()) / load_s:.2f} requests/s, "
          f"{after.get('strata_generation_tokens_total', 0) - before.get('strata_generation_tokens_total', 0):.0f} "
          f"tokens generated")
    print(f"preemptions: {preemptions:.0f}")
    print(f"KV blocks: {after.get('strata_kv_blocks_total', 0):.0f} in all; used {baseline_used:.0f} before the load, "
          f"{peak_used:.0f} at the peak, {after.get('strata_kv_blocks_used', -1):.0f} once idle after it")
    print(f"server RSS: {rss_warm / 1024:.1f} MiB after the {warmup:.0f} s warm-up (high-water), "
          f"{rss_end / 1024:.1f} MiB at the end of the load ({100 * growth:+.1f}%), {rss_idle / 1024:.1f} MiB idle")
    print(f"5xx in the server's /metrics: {five_xx:.0f}; after SIGTERM: {stopped}")

    # Checks.
    if total["violation"]:
        failures.append(f"{total['violation']} requests not answered or not cleanly refused; first ones:\n  "
                        + "\n  ".join(tally.violations[:10]))
    if five_xx:
        failures.append(f"the server counted {five_xx:.0f} 5xx responses")
    if not alive:
        failures.append("the server died during the soak")
    if after.get("strata_kv_blocks_used") != baseline_used:
        failures.append(f"KV blocks used {after.get('strata_kv_blocks_used')} once idle, baseline {baseline_used}")
    if preemptions <= 0:
        failures.append("no preemption: the KV cache was never short (raise the load or lower --kv-cache-memory)")
    if not growth < RSS_GROWTH_LIMIT:
        failures.append(f"server RSS grew {100 * growth:.1f}% after the warm-up (limit {100 * RSS_GROWTH_LIMIT:.0f}%)")
    if total["ok"] == 0:
        failures.append("no request was answered")
    if stopped != "exit status 0":
        failures.append(stopped)
    if failures:
        print("\nsoak: FAILED\n- " + "\n- ".join(failures))
        print(f"\nserver log, last lines:\n{log_tail}")
        return 1
    print("\nsoak: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

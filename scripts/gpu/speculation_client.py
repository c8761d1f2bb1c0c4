#!/usr/bin/env python3
"""Speculation on and off against one `strata serve` (started with --speculative-ngram or
--speculative-model): the input-grounded chat tasks of bench/speculation_tasks.json, greedy, up to
128 tokens, ending at end-of-generation. One user sends the tasks in turn, with `speculative` on
and off interleaved (the order alternates by round); then, for each count in USERS, that many
closed-loop users do the same twice, off then on and on then off (the first crowd run of a
pair warms what the second reuses: in one H100 call the 64-user "on" run, second and without a
single draft under the batch-size rule, came out 1.21x "off"), their ratio over both. The acceptance comes from /metrics. Prints a table,
writes JSON. With the server's --speculative-disable-by-batch-size raised, the user counts show
where drafting stops paying; with the default they check that the rule keeps throughput.

usage: speculation_client.py PORT OUT.json [--rounds 2] [--users 64[,N...]] [--label NAME]
"""
import json
import sys
import threading
import time
import urllib.request


def post(port, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("strata_spec_decode_num_", "strata_engine_d")) and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


MODEL = []


def model_id(port):
    """The id the server serves (asked once)."""
    if not MODEL:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            MODEL.append(json.load(r)["data"][0]["id"])
    return MODEL[0]


def request(port, task, speculative):
    body = {
        "model": model_id(port),
        "messages": [{"role": "user", "content": task}],
        "max_tokens": 128,
        "temperature": 0,
        "speculative": speculative,
    }
    start = time.perf_counter()
    r = post(port, body)
    return time.perf_counter() - start, r["usage"]["completion_tokens"], r["choices"][0]["message"]["content"]


def one_user(port, tasks, speculative):
    """Each task once, in turn: tokens, seconds, the answers, and the engine's decode steps over
    the run (from /metrics): how many, how long, and those that verified drafts."""
    before = metrics(port)
    tokens, seconds, answers = 0, 0.0, []
    for task in tasks:
        s, n, text = request(port, task, speculative)
        tokens += n
        seconds += s
        answers.append(text)
    after = metrics(port)
    d = lambda name: after.get(f"strata_engine_{name}", 0.0) - before.get(f"strata_engine_{name}", 0.0)
    steps, drafted = d("decode_steps_total"), d("drafted_steps_total")
    plain_s = d("decode_step_seconds_total") - d("drafted_step_seconds_total")
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "answers": answers,
            "decode_steps": steps, "drafted_steps": drafted,
            "plain_step_ms": 1e3 * plain_s / max(steps - drafted, 1),
            "drafted_step_ms": 1e3 * d("drafted_step_seconds_total") / max(drafted, 1)}


def many_users(port, tasks, speculative, users, per_user=2):
    """`users` closed loops, each sending `per_user` tasks: aggregate output tok/s."""
    counts = []
    lock = threading.Lock()

    def loop(u):
        for i in range(per_user):
            _, n, _ = request(port, tasks[(u + i) % len(tasks)], speculative)
            with lock:
                counts.append(n)

    threads = [threading.Thread(target=loop, args=(u,)) for u in range(users)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"tokens": sum(counts), "seconds": wall, "tok_s": sum(counts) / wall}


def main():
    port, out = int(sys.argv[1]), sys.argv[2]
    args = sys.argv[3:]
    opt = lambda name, default: type(default)(args[args.index(name) + 1]) if name in args else default
    rounds, label = opt("--rounds", 2), opt("--label", "speculation")
    users = [int(u) for u in opt("--users", "64").split(",") if int(u) > 0]
    with open("bench/speculation_tasks.json") as f:
        tasks = json.load(f)["tasks"]
    # Warm-up: every prompt into the prefix cache (both modes then reuse it alike), and the
    # graphs of both kinds of step.
    one_user(port, tasks, False)
    one_user(port, tasks[:1], True)
    before = metrics(port)
    runs = []
    for r in range(rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        res = {}
        for spec in order:
            res["on" if spec else "off"] = one_user(port, tasks, spec)
        same = res["on"]["answers"] == res["off"]["answers"]
        runs.append({"round": r, "on": res["on"], "off": res["off"], "same_answers": same,
                     "ratio": res["on"]["tok_s"] / res["off"]["tok_s"]})
    after = metrics(port)
    key = "strata_spec_decode_num_draft_tokens_total"
    acc_key = "strata_spec_decode_num_accepted_tokens_total"
    proposed = after.get(key, 0) - before.get(key, 0)
    accepted = after.get(acc_key, 0) - before.get(acc_key, 0)
    crowd = []
    for n in users:
        pairs = []
        for order in ([False, True], [True, False]):
            res = {("on" if spec else "off"): many_users(port, tasks, spec, n) for spec in order}
            pairs.append({"first": "on" if order[0] else "off", **res})
        off = sum(p["off"]["tok_s"] for p in pairs) / 2
        on = sum(p["on"]["tok_s"] for p in pairs) / 2
        crowd.append({"users": n, "pairs": pairs, "off_tok_s": off, "on_tok_s": on, "ratio": on / off,
                      "ratio_by_order": [p["on"]["tok_s"] / p["off"]["tok_s"] for p in pairs]})
    print(f"| {label} | round | off tok/s | on tok/s | on/off | same answers |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        print(f"| 1 user | {run['round']} | {run['off']['tok_s']:.1f} | {run['on']['tok_s']:.1f} | "
              f"{run['ratio']:.2f}x | {run['same_answers']} |")
    if proposed:
        print(f"drafts at one user: {proposed:.0f} proposed, {accepted:.0f} accepted ({accepted / proposed:.2f})")
    for run in runs:
        off, on = run["off"], run["on"]
        print(f"round {run['round']} decode steps: off {off['decode_steps']:.0f} at {off['plain_step_ms']:.3f} ms; "
              f"on {on['drafted_steps']:.0f} drafted at {on['drafted_step_ms']:.3f} ms and "
              f"{on['decode_steps'] - on['drafted_steps']:.0f} plain at {on['plain_step_ms']:.3f} ms")
    for c in crowd:
        orders = ", ".join(f"{r:.2f}x" for r in c["ratio_by_order"])
        print(f"| {c['users']} users | off-on, on-off | {c['off_tok_s']:.1f} | {c['on_tok_s']:.1f} | "
              f"{c['ratio']:.2f}x ({orders}) | - |")
    for run in runs:
        for k in ("on", "off"):
            run[k].pop("answers")
    json.dump({"label": label, "one_user": runs, "drafts_one_user": {"proposed": proposed, "accepted": accepted},
               "users": users, "many_users": crowd, "metrics_after": after}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""strata against llama.cpp on this machine's CPU, side by side in one sitting (issue 31).

Builds the pinned llama.cpp (the source inside the llama-cpp-python sdist that scripts/fetch.py
pins) once per variant into $STRATA_CACHE/llama.cpp/build-<variant>/bin, then runs, interleaved
(strata, llama.cpp, strata, llama.cpp, ...):
  - `strata bench-local` against `llama-bench`: pp512 and tg128, single stream;
  - `strata serve` against `llama-server -np 32`, both loaded by `strata bench` at 1 and 32 users
    (64 prompt tokens, 64 output tokens, the same seeded prompts).
Prints medians over the rounds and the ratios strata/llama.cpp, and writes them to
bench/results/peers_cpu_<variant>.json.

usage: scripts/bench_peers.py [--variant avx512|avx2] [--rounds 2] [--build-only]
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fetch  # noqa: E402  (the pinned-download helpers beside this script)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_DIR = os.path.join(fetch.CACHE, "llama.cpp")
DEFAULT_MODEL = os.path.join(fetch.CACHE, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
THREADS = 2
INPUT_LEN, OUTPUT_LEN = 64, 64
USERS = [1, 32]
# Measured requests and warm-up requests per user count (32 users: three waves after one).
REQUESTS = {1: (16, 2), 32: (96, 32)}

# llama.cpp's CMake flags common to every variant: CPU only, no network at build or run time
# (no HTTPS client, no web UI download), only what the two binaries need.
CMAKE_COMMON = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",  # -march=native died with SIGILL on the machine
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_BLAS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
X86_BASE = ["-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
# variant -> (llama.cpp ISA flags, environment for strata). `avx2` stands for an AVX2-only CPU on
# an AVX-512 one: llama.cpp built without AVX-512, strata capped by STRATA_CPU_ISA.
VARIANTS = {
    "avx512": (X86_BASE + ["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON"], {}),
    "avx2": (X86_BASE, {"STRATA_CPU_ISA": "avx2"}),
}
TARGETS = ["llama-bench", "llama-server"]


def fail(msg):
    print(f"bench-peers: {msg}", file=sys.stderr)
    sys.exit(1)


def ensure_cmake():
    """cmake only this benchmark needs: installed when root on Debian, else asked for."""
    if shutil.which("cmake"):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("bench-peers: installing Debian package cmake")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "cmake"]):
            if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
                fail(f"`{' '.join(cmd)}` failed; install cmake and rerun")
        return
    fail("cmake is missing; install it (Debian: sudo apt-get install cmake) and rerun")


def build_llama_cpp(variant):
    """The two llama.cpp binaries of one variant, built once; returns their folder."""
    bin_dir = os.path.join(LLAMA_DIR, f"build-{variant}", "bin")
    if all(os.access(os.path.join(bin_dir, t), os.X_OK) for t in TARGETS):
        return bin_dir
    ensure_cmake()
    src = fetch.fetch_tree("llama-cpp-source")
    build_dir = os.path.dirname(bin_dir)
    isa_flags, _ = VARIANTS[variant]
    print(f"bench-peers: building llama.cpp ({variant}) in {build_dir}; this takes a while")
    for cmd in (
        ["cmake", "-S", src, "-B", build_dir] + CMAKE_COMMON + isa_flags,
        ["cmake", "--build", build_dir, "--config", "Release", "--target"] + TARGETS + ["-j2"],
    ):
        r = subprocess.run(cmd)
        if r.returncode != 0:
            fail(f"`{' '.join(cmd[:4])} ...` failed (exit {r.returncode}); see the output above")
    return bin_dir


def run_json(cmd, env=None):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if r.returncode != 0:
        fail(f"`{' '.join(cmd)}` failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


def strata_local(strata, model, precision, env, tmp):
    """pp512 and tg128 tok/s of `strata bench-local` (median of its 3 repeats)."""
    out = os.path.join(tmp, "strata-local.json")
    run_json([strata, "bench-local", "-m", model, "-t", str(THREADS), "--prompt-tokens", "512",
              "--gen-tokens", "128", "--repeats", "3", "--activation-precision", precision,
              "--out", out], env)
    with open(out) as f:
        r = json.load(f)
    return {"pp512": r["prompt_tps_median"], "tg128": r["decode_tps_median"]}


def llama_local(bin_dir, model):
    """pp512 and tg128 tok/s of `llama-bench` (mean of its 3 repetitions)."""
    out = run_json([os.path.join(bin_dir, "llama-bench"), "-m", model, "-p", "512", "-n", "128",
                    "-t", str(THREADS), "-r", "3", "-o", "json"])
    rows = json.loads(out)
    got = {}
    for row in rows:
        key = "pp512" if row["n_prompt"] == 512 and row["n_gen"] == 0 else "tg128"
        got[key] = row["avg_ts"]
    if set(got) != {"pp512", "tg128"}:
        fail(f"llama-bench gave {sorted(got)}, expected pp512 and tg128")
    return got


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free port, up once GET /v1/models answers 200; stop() ends it."""

    def __init__(self, name, args_for_port, env, tmp):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp, f"{name}-{self.port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args_for_port(self.port), env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while True:
            if self.proc.poll() is not None:
                fail(f"{name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.time() > deadline:
                tail = self.log_tail()
                self.stop()
                fail(f"{name} did not answer /v1/models within 180 s:\n{tail}")
            time.sleep(0.25)

    def log_tail(self):
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-20:])

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def load(strata, server, model, users, seed, tmp):
    """`strata bench` on one server: the run's figures that the table compares."""
    n, warmup = REQUESTS[users]
    out = os.path.join(tmp, f"{server.name}-{users}-{seed}.json")
    # --tokenizer: both servers get the same prompts, counted by the same tokenizer.
    run_json([strata, "bench", "--base-url", server.url, "--endpoint", "completions",
              "-c", str(users), "-n", str(n), "--warmup", str(warmup),
              "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--ignore-eos",
              "--tokenizer", model, "--seed", str(seed), "--label", server.name, "-o", out])
    with open(out) as f:
        run = json.load(f)["runs"][0]
    return {
        "output_tok_s": run["output_token_throughput"],
        "ttft_p50_ms": run["ttft_ms"]["p50"],
        "ttft_p95_ms": run["ttft_ms"]["p95"],
        "error_rate": run["error_rate"],
        "output_tokens_per_request": run["output_tokens"]["mean_per_request"],
    }


def strata_server(strata, model, precision, env, tmp):
    return Server("strata", lambda port: [
        strata, "serve", "-m", model, "--port", str(port), "--threads", str(THREADS),
        "--device", "cpu", "--max-num-seqs", "64", "--activation-precision", precision,
    ], env, tmp)


def llama_server(bin_dir, model, tmp):
    ctx = max(USERS) * (INPUT_LEN + OUTPUT_LEN + 64)  # 64 tokens of slack per slot
    return Server("llama-server", lambda port: [
        os.path.join(bin_dir, "llama-server"), "-m", model, "-np", str(max(USERS)), "-c", str(ctx),
        "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS), "--no-webui",
    ], None, tmp)


def median_of(runs):
    """Field-wise medians of a list of dicts with the same numeric fields."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def ratio(a, b):
    return a / b if b else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), default="avx512")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of each tool (medians)")
    p.add_argument("--strata", default=os.path.join(ROOT, "target", "release", "strata"))
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--activation-precision", default="standard", choices=["high", "standard"],
                   help="strata's CPU activation precision (bench-local and serve; default: strata's)")
    p.add_argument("--out", help="results JSON (default bench/results/peers_cpu_<variant>.json)")
    p.add_argument("--build-only", action="store_true", help="build llama.cpp and stop")
    a = p.parse_args()
    if a.rounds < 1:
        fail("--rounds must be at least 1")
    bin_dir = build_llama_cpp(a.variant)
    if a.build_only:
        print(f"bench-peers: llama.cpp binaries in {bin_dir}")
        return
    for path, what in ((a.strata, "strata binary (make build)"), (a.model, "model (make fetch)")):
        if not os.path.exists(path):
            fail(f"{path} not found; build or fetch the {what} first")
    out_path = a.out or os.path.join(ROOT, "bench", "results", f"peers_cpu_{a.variant}.json")
    strata_env = dict(os.environ, **VARIANTS[a.variant][1])

    raw = {"strata": {"local": [], 1: [], 32: []}, "llama.cpp": {"local": [], 1: [], 32: []}}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            print(f"bench-peers: round {rnd + 1}/{a.rounds}: local pp512/tg128", flush=True)
            raw["strata"]["local"].append(strata_local(a.strata, a.model, a.activation_precision, strata_env, tmp))
            raw["llama.cpp"]["local"].append(llama_local(bin_dir, a.model))
            for name, start in (
                ("strata", lambda: strata_server(a.strata, a.model, a.activation_precision, strata_env, tmp)),
                ("llama.cpp", lambda: llama_server(bin_dir, a.model, tmp)),
            ):
                print(f"bench-peers: round {rnd + 1}/{a.rounds}: {name} over HTTP", flush=True)
                server = start()
                try:
                    for users in USERS:
                        raw[name][users].append(load(a.strata, server, a.model, users, 100 * rnd + users, tmp))
                finally:
                    server.stop()

    med = {tool: {str(k): median_of(v) for k, v in parts.items()} for tool, parts in raw.items()}
    rows = [("pp512 tok/s", "local", "pp512"), ("tg128 tok/s", "local", "tg128")]
    for users in USERS:
        rows += [
            (f"{users} user(s) output tok/s", str(users), "output_tok_s"),
            (f"{users} user(s) TTFT p50 ms (lower: better)", str(users), "ttft_p50_ms"),
            (f"{users} user(s) TTFT p95 ms (lower: better)", str(users), "ttft_p95_ms"),
            (f"{users} user(s) error rate", str(users), "error_rate"),
        ]
    table = [
        {"figure": label, "strata": med["strata"][part][key], "llama.cpp": med["llama.cpp"][part][key],
         "ratio": ratio(med["strata"][part][key], med["llama.cpp"][part][key])}
        for label, part, key in rows
    ]
    print(f"\nstrata vs llama.cpp, {a.variant}, {THREADS} threads, medians of {a.rounds} rounds")
    print(f"{'figure':<44}{'strata':>12}{'llama.cpp':>12}{'strata/llama':>14}")
    for r in table:
        rt = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"{r['figure']:<44}{r['strata']:>12.2f}{r['llama.cpp']:>12.2f}{rt:>14}")

    result = {
        "tool": "bench_peers",
        "variant": a.variant,
        "llama_cpp": {"source": "llama-cpp-python==0.3.36 sdist, vendor/llama.cpp",
                      "cmake_flags": CMAKE_COMMON + VARIANTS[a.variant][0]},
        "strata_env": VARIANTS[a.variant][1],
        "strata_activation_precision": a.activation_precision,
        "model": os.path.basename(a.model),
        "threads": THREADS,
        "http": {"endpoint": "completions", "stream": True, "input_len": INPUT_LEN,
                 "output_len": OUTPUT_LEN, "ignore_eos": True,
                 "requests_and_warmup": {str(k): v for k, v in REQUESTS.items()}},
        "rounds": a.rounds,
        "order": "each round: strata bench-local, llama-bench, strata serve (1 then 32 users), llama-server",
        "table": table,
        "medians": med,
        "runs": {tool: {str(k): v for k, v in parts.items()} for tool, parts in raw.items()},
        "cpu": fetch_cpu_name(),
        "date_unix": int(time.time()),
    }
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"\nbench-peers: wrote {out_path}")


def fetch_cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()

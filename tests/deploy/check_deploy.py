#!/usr/bin/env python3
"""Checks deploy/ and the Dockerfile against the real things that can run here.

A real nginx runs deploy/nginx.conf (`nginx -t`, then in front of two `strata serve` processes, one
started through the image's entrypoint): streams arrive as generated, plain requests and long bodies
pass, one X-Session-ID always reaches the same replica while many spread over both. Every metric the
Grafana dashboard queries exists, with the right type, in a live /metrics. The systemd unit passes
`systemd-analyze verify` (and `security`); the Dockerfile, compose files, Prometheus config and
Kubernetes manifests are checked statically (stages, COPY sources against .dockerignore, pinned
images without a registry host, mounted files, probes, selectors). The cost model's two-box topologies
load and plan. With a Docker engine, `docker compose up` brings the CPU stack up and serves a chat
through nginx; without one that part is skipped with the reason.

usage: clients-venv/bin/python tests/deploy/check_deploy.py   (env STRATA_BIN: the binary)
"""
import fnmatch
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error

import openai
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
sys.path.insert(0, os.path.join(ROOT, "tests", "clients"))
import real_clients as rc  # noqa: E402  (the Server and nginx helpers of the real-client tests)

SESSION_HEADER = "X-Session-ID"
MESSAGES = rc.MESSAGES


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def load_yaml(*parts):
    return yaml.safe_load(read(*parts))


def registry_host(image):
    """The registry host an image reference names, or None (a Docker Hub name like nginx:1.28-alpine)."""
    first = image.split("/")[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return first
    return None


def check_image_ref(image, where):
    assert registry_host(image) is None, f"{where}: image {image} names a registry host"
    name, _, tag = image.rpartition(":")
    assert name and tag and tag != "latest" and "/" not in tag, f"{where}: image {image} has no pinned tag"


# ---- Dockerfile -------------------------------------------------------------------------------

def dockerfile_instructions():
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in read("Dockerfile").splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def dockerignore_includes(path):
    """Whether the build context keeps `path` under .dockerignore (last matching pattern wins, a
    pattern matching a parent folder matches the file, `!` re-includes)."""
    included = True
    for raw in read(".dockerignore").splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        parts = path.split("/")
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            included = negate
    return included


def dockerfile_stages():
    return [m.group(1) for word, args in dockerfile_instructions() if word == "FROM"
            for m in [re.search(r"\sAS\s+(\S+)$", args, re.I)] if m]


def check_dockerfile():
    instructions = dockerfile_instructions()
    stages, placed, runs = [], set(), []
    healthcheck = entrypoint = None
    for word, args in instructions:
        if word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            assert m, f"FROM {args}"
            if m.group(1) not in stages:
                check_image_ref(m.group(1), "Dockerfile")
            stages.append(m.group(2))
        elif word == "COPY":
            tokens = args.split()
            flags = [t for t in tokens if t.startswith("--")]
            sources, dest = [t for t in tokens if not t.startswith("--")][:-1], tokens[-1]
            origin = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            if origin is not None:
                assert origin in stages, f"COPY --from={origin}: no earlier stage of that name ({stages})"
            else:
                for src in sources:
                    assert os.path.exists(os.path.join(ROOT, src)), f"COPY {src}: not in the repository"
                    assert dockerignore_includes(src.rstrip("/")), f"COPY {src}: excluded by .dockerignore"
            for src in sources:
                placed.add(dest + os.path.basename(src.rstrip("/")) if dest.endswith("/") else dest)
        elif word == "RUN":
            runs.append(args)
        elif word == "HEALTHCHECK":
            healthcheck = args
        elif word == "ENTRYPOINT":
            entrypoint = json.loads(args)
    assert any("cargo build --release --locked -p strata-cli" in r for r in runs), "no release build of strata-cli"
    assert stages[-1] == "cpu" and "cuda" in stages, f"stages {stages}: want `cuda` and `cpu` last (the default)"
    assert healthcheck and "/opt/strata/healthcheck.py" in healthcheck and "/opt/strata/healthcheck.py" in placed
    assert entrypoint and entrypoint[0] in placed, f"ENTRYPOINT {entrypoint} is not a copied file"
    assert "/usr/local/bin/strata" in placed, "the binary is not copied into the runtime"
    fetch_default = re.search(r'fetch="\$\{STRATA_FETCH:-(\S+?)\}"', read("deploy", "docker-entrypoint.sh"))
    assert fetch_default and fetch_default.group(1) in placed, "the entrypoint's fetch.py is not in the image"
    for script in ["deploy/docker-entrypoint.sh", "deploy/install-cuda-libs.sh"]:
        done = subprocess.run(["sh", "-n", os.path.join(ROOT, script)], capture_output=True, text=True)
        assert done.returncode == 0, f"sh -n {script}: {done.stderr}"


def check_cuda_libraries():
    """The image's CUDA folder holds every library strata dlopens (the driver comes from the host) and
    pins NVRTC exactly as scripts/fetch.py does."""
    libraries = read("crates", "strata-runtime", "src", "cuda", "libraries.rs")
    names = set(re.findall(r'file: "(lib[^"]+)"', libraries)) - {"libcuda.so.1"}
    assert len(names) >= 4, names
    script = read("deploy", "install-cuda-libs.sh")
    for name in names:
        assert re.search(rf"(/|\s){re.escape(name)}(\s|\"|$)", script), f"install-cuda-libs.sh does not provide {name}"
    pins = {}
    for line in read("deploy", "cuda-requirements.txt").splitlines():
        if line.strip() and not line.startswith("#"):
            m = re.fullmatch(r"(\S+)==(\S+) --hash=sha256:([0-9a-f]{64})", line.strip())
            assert m, f"cuda-requirements.txt: {line!r} is not `name==version --hash=sha256:...`"
            pins[m.group(1)] = (m.group(2), m.group(3))
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import fetch
    pip_args, sha, _ = fetch.ARTIFACTS["nvrtc"]
    name, version = next(a for a in pip_args if "==" in a).split("==")
    assert pins.get(name) == (version, sha), f"NVRTC pinned as {pins.get(name)}, fetch.py has {(version, sha)}"


# ---- the entrypoint, the health check and nginx around live servers ---------------------------

def entrypoint_env(cache, **extra):
    env = dict(os.environ, STRATA_BIN=rc.BIN, STRATA_CACHE=cache, STRATA_HOST="127.0.0.1",
               STRATA_FETCH=os.path.join(ROOT, "scripts", "fetch.py"))
    env.update(extra)
    return env


def start_through_entrypoint(tmp):
    """rc.Server, but started the way the image starts it: the entrypoint with a fresh $STRATA_CACHE
    holding the default model (so fetch.py checks its sha256 and downloads nothing)."""
    cache = os.path.join(tmp, "cache")
    os.makedirs(os.path.join(cache, "models"))
    model = os.path.join("models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    user_cache = os.environ.get("STRATA_CACHE") or os.path.expanduser("~/.cache/strata")
    os.symlink(os.path.join(user_cache, model), os.path.join(cache, model))
    saved_bin, saved_env = rc.BIN, dict(os.environ)
    os.environ.update(entrypoint_env(cache))
    rc.BIN = os.path.join(ROOT, "deploy", "docker-entrypoint.sh")
    try:
        return rc.Server(tmp)
    finally:
        rc.BIN = saved_bin
        os.environ.clear()
        os.environ.update(saved_env)


def check_entrypoint_branches(tmp, server):
    entrypoint = os.path.join(ROOT, "deploy", "docker-entrypoint.sh")
    # exec, not a child: the PID the container would signal is strata itself, with the defaults added.
    exe = os.path.realpath(f"/proc/{server.proc.pid}/exe")
    assert exe == os.path.realpath(rc.BIN), f"the entrypoint left {exe} running, not strata"
    with open(f"/proc/{server.proc.pid}/cmdline") as f:
        argv = f.read().split("\0")
    assert argv[1:6] == ["serve", "--host", "127.0.0.1", "--port", str(server.port)], argv
    empty = os.path.join(tmp, "empty-cache")
    os.makedirs(empty)
    cases = [
        ([], {"STRATA_FETCH": os.path.join(tmp, "no-fetch.py")}, 2, "pass --model /models/FILE"),
        ([], {"STRATA_MODEL": os.path.join(tmp, "missing.gguf")}, None, "missing.gguf"),
        (["plan", "--model", "llama-3-8b", "--topology",
          os.path.join(ROOT, "crates", "strata-parallel", "fixtures", "a30x4_seeds.json")], {}, 0, "plan:"),
    ]
    for args, extra, code, says in cases:
        done = subprocess.run([entrypoint] + args, env=entrypoint_env(empty, **extra), capture_output=True,
                              text=True, timeout=120)
        assert (done.returncode == code if code is not None else done.returncode != 0), (args, extra, done)
        assert says in done.stdout + done.stderr, (args, extra, done.stdout, done.stderr)


def check_healthcheck(server):
    script = os.path.join(ROOT, "deploy", "healthcheck.py")
    up = subprocess.run([sys.executable, script], env=dict(os.environ, STRATA_PORT=str(server.port),
                        http_proxy="http://127.0.0.1:9"), capture_output=True, text=True, timeout=30)
    assert up.returncode == 0, up.stderr
    down = subprocess.run([sys.executable, script], env=dict(os.environ, STRATA_PORT=str(rc.free_port())),
                          capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and "refused" in down.stderr.lower(), down


class DeployNginx(rc.Nginx):
    """A real nginx running deploy/nginx.conf inside an http block (as the nginx image's conf.d does),
    its strata-upstream.conf listing `upstream_ports`, its `listen 80` moved to a free port. The http
    block turns gzip on for event streams and JSON, so deploy/nginx.conf must turn it off itself."""

    def __init__(self, tmp, upstream_ports):
        self.port = rc.free_port()
        prefix = os.path.join(tmp, "deploy-nginx")
        os.makedirs(prefix, exist_ok=True)
        site = read("deploy", "nginx.conf")
        site, n = re.subn(r"^(\s*)listen 80;$", rf"\g<1>listen 127.0.0.1:{self.port};", site, flags=re.M)
        assert n == 1, "deploy/nginx.conf should have one `listen 80;`"
        with open(os.path.join(prefix, "strata.conf"), "w") as f:
            f.write(site)
        with open(os.path.join(prefix, "strata-upstream.conf"), "w") as f:
            f.write("".join(f"server 127.0.0.1:{p};\n" for p in upstream_ports))
        self.start(prefix, """
    gzip on;
    gzip_types text/event-stream application/json;
    gzip_min_length 1;
    gzip_proxied any;
    include strata.conf;""")


def chat_count(server):
    return server.metrics().get('strata_http_requests_total{route="/v1/chat/completions",status="200"}', 0)


def check_streaming(client):
    start, arrivals, end = rc.stream_arrivals(client)
    print(f"     via deploy/nginx.conf: {len(arrivals)} content chunks in {rc.bursts(arrivals)} deliveries")
    rc.assert_incremental(start, arrivals, end)


def check_plain_requests(proxy, client):
    reply = client.chat.completions.create(model=rc.MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length"), reply
    assert rc.http_get(proxy.url + "/health") == (200, '{"status":"ok"}')
    try:
        rc.http_get(proxy.url + "/metrics")
        raise AssertionError("/metrics is public through nginx")
    except urllib.error.HTTPError as e:
        assert e.code == 403, e.code
    # A stream asked for with gzip comes back plain, as server-sent events.
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    body = json.dumps({"messages": MESSAGES, "max_tokens": 4, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", "Accept-Encoding": "gzip"})
    response = conn.getresponse()
    data = response.read()
    assert response.status == 200 and response.getheader("Content-Type", "").startswith("text/event-stream")
    assert response.getheader("Content-Encoding") is None, "nginx gzipped the event stream"
    assert data.startswith(b"data: ") and data.rstrip().endswith(b"data: [DONE]"), data[:200]
    conn.close()
    # A 1.4 MB body (over nginx's default 1m) reaches strata, which answers with its own error.
    try:
        client.completions.create(model=rc.MODEL, prompt=[1] * 700_000, max_tokens=1)
        raise AssertionError("a 700,000-token prompt was accepted")
    except openai.BadRequestError as e:
        assert e.body["code"] == "context_length_exceeded", e.body


def check_routing(servers, client):
    """One X-Session-ID always lands on one replica; many sessions, and requests without one, spread."""
    def counts():
        return [chat_count(s) for s in servers]

    def ask(session=None):
        headers = {SESSION_HEADER: session} if session else None
        client.chat.completions.create(model=rc.MODEL, messages=MESSAGES, max_tokens=1, extra_headers=headers)

    before = counts()
    for _ in range(6):
        ask("alice")
    delta = [a - b for a, b in zip(counts(), before)]
    assert sorted(delta) == [0, 6], f"session alice was split over the replicas: {delta}"
    for label, sessions in [("24 sessions", [f"user-{i}" for i in range(24)]), ("no header", [None] * 24)]:
        before = counts()
        for s in sessions:
            ask(s)
        delta = [a - b for a, b in zip(counts(), before)]
        print(f"     {label}: {delta[0]} and {delta[1]} requests on the two replicas")
        assert sum(delta) == 24 and min(delta) > 0, f"{label} all went to one replica: {delta}"


# ---- the dashboard against a live /metrics ---------------------------------------------------

def metric_types(text):
    """{series name: its metric's TYPE}, with a histogram's _bucket, _sum and _count."""
    types = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        types[name] = kind
        if kind == "histogram":
            for suffix in ["_bucket", "_sum", "_count"]:
                types[name + suffix] = "histogram " + suffix[1:]
    return types


def labels_seen(text):
    seen = {}
    for name, labels in re.findall(r"^(strata_\w+)\{([^}]*)\}", text, re.M):
        seen.setdefault(name, set()).update(re.findall(r'(\w+)="', labels))
    return seen


def dashboard_exprs():
    dash = json.loads(read("deploy", "grafana", "strata-dashboard.json"))
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))
    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            exprs.append(q["query"])
    return dash, exprs


def check_dashboard(metrics_text):
    types, seen = metric_types(metrics_text), labels_seen(metrics_text)
    dash, exprs = dashboard_exprs()
    assert dash["uid"] and dash["panels"] and exprs
    used = set()
    for expr in exprs:
        for name in re.findall(r"\bstrata_\w+", expr):
            assert name in types, f"the dashboard queries {name}, which /metrics does not have: {expr}"
            used.add(name)
        for name in re.findall(r"\b(?:rate|irate|increase)\((strata_\w+)", expr):
            assert types[name] in ("counter", "histogram bucket", "histogram sum", "histogram count"), \
                f"rate() over the {types[name]} {name}: {expr}"
        for inner in re.findall(r"histogram_quantile\([^,]+,(.*)", expr):
            for name in re.findall(r"\bstrata_\w+", inner):
                assert types[name] == "histogram bucket", f"histogram_quantile over {name}: {expr}"
        for name, selector in re.findall(r"\b(strata_\w+)\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*=~?", selector):
                assert label in {"instance", "job"} | seen.get(name, set()), \
                    f"{name} has no label {label} in /metrics: {expr}"
        for label in re.findall(r"by \(([^)]*)\)", expr):
            for l in [x.strip() for x in label.split(",")]:
                assert l in {"instance", "job"} or any(l in seen.get(n, set()) for n in used), f"by ({l}): {expr}"
    # What the dashboard is for: TTFT, ITL, tokens/s, queue, KV use, preemptions, errors.
    for needed in ["strata_time_to_first_token_seconds_bucket", "strata_inter_token_latency_seconds_bucket",
                   "strata_generation_tokens_total", "strata_num_requests_waiting", "strata_kv_blocks_used",
                   "strata_preemptions_total", "strata_http_requests_total"]:
        assert needed in used, f"the dashboard does not show {needed}"
    print(f"     {len(exprs)} queries over {len(used)} metrics, all in /metrics")


# ---- static files ----------------------------------------------------------------------------

def volume_parts(spec):
    """(source, target) of a short-syntax volume `SRC:DST[:ro]`; SRC may be `${VAR:-default}`."""
    parts = spec.rsplit(":", 2)
    if len(parts) == 3 and parts[2] not in ("ro", "rw"):
        parts = spec.rsplit(":", 1)
    return parts[0], parts[1]


def volume_sources(service):
    return [volume_parts(v)[0] for v in service.get("volumes", []) if isinstance(v, str)]


def check_compose():
    stages = dockerfile_stages()
    compose = load_yaml("deploy", "compose.yaml")
    services = compose["services"]
    assert {"strata", "nginx", "prometheus", "grafana"} <= set(services), set(services)
    strata = services["strata"]
    assert os.path.exists(os.path.join(DEPLOY, strata["build"]["context"], strata["build"]["dockerfile"]))
    assert strata["build"]["target"] in stages
    assert "/opt/strata/healthcheck.py" in strata["healthcheck"]["test"]
    assert services["nginx"]["depends_on"]["strata"]["condition"] == "service_healthy"
    mounts = dict(volume_parts(v) for v in services["nginx"]["volumes"])
    assert re.fullmatch(r"/etc/nginx/conf\.d/\w+\.conf", mounts["./nginx.conf"]), mounts
    # nginx.conf's relative `include strata-upstream.conf` resolves beside the image's /etc/nginx/nginx.conf.
    assert "include strata-upstream.conf;" in read("deploy", "nginx.conf")
    assert mounts["./strata-upstream.conf"] == "/etc/nginx/strata-upstream.conf", mounts
    assert any(p.endswith(":80") for p in services["nginx"]["ports"])
    upstream = re.findall(r"^server (\S+):(\d+)", read("deploy", "strata-upstream.conf"), re.M)
    assert upstream == [("strata", str(strata["expose"][0]))], upstream
    for name, service in services.items():
        if "image" in service and "build" not in service:
            check_image_ref(service["image"], f"compose {name}")
        for src in volume_sources(service):
            if src.startswith("."):
                assert os.path.exists(os.path.join(DEPLOY, src)), f"compose {name} mounts {src}, which is missing"
    named = {src for s in services.values() for src in volume_sources(s) if not src.startswith((".", "/", "$"))}
    assert named <= set(compose.get("volumes") or {}), named
    prom = load_yaml("deploy", "prometheus.yml")
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "strata")
    assert job["metrics_path"] == "/metrics" and job["dns_sd_configs"][0]["names"] == ["strata"]
    assert job["dns_sd_configs"][0]["port"] == int(strata["expose"][0])
    grafana = dict(volume_parts(v) for v in services["grafana"]["volumes"])
    provider = load_yaml("deploy", "grafana", "provisioning", "dashboards", "strata.yml")["providers"][0]
    assert os.path.dirname(grafana["./grafana/strata-dashboard.json"]) == provider["options"]["path"]
    source = load_yaml("deploy", "grafana", "provisioning", "datasources", "prometheus.yml")["datasources"][0]
    assert source["type"] == "prometheus" and source["url"].endswith(":9090")

    gpu = load_yaml("deploy", "compose.gpu.yaml")["services"]["strata"]
    assert gpu["build"]["target"] == "cuda" and "cuda" in stages
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], device
    assert any(volume_parts(v)[1] == "/models" for v in gpu["volumes"]), gpu["volumes"]
    assert gpu["environment"]["STRATA_MODEL"].startswith("/models/") and gpu["shm_size"]


def check_k8s():
    docs = [d for f in ["strata.yaml", "router.yaml"] for d in yaml.safe_load_all(read("deploy", "k8s", f)) if d]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    strata = deployments["strata"]["spec"]
    labels = strata["template"]["metadata"]["labels"]
    assert strata["selector"]["matchLabels"].items() <= labels.items()
    container = strata["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000}, ports
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"]:
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert "--model" in container["args"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/models", "/var/cache/strata", "/dev/shm"} <= mounts, mounts
    for d in deployments.values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            check_image_ref(c["image"], f"k8s {d['metadata']['name']}")
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    for s in services.values():
        target = next(d for d in deployments.values()
                      if s["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items())
        names = {p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert all(p["targetPort"] in names for p in s["spec"]["ports"]), s["metadata"]["name"]
    headless = services["strata-pods"]
    assert headless["spec"]["clusterIP"] == "None"
    upstream = read("deploy", "k8s", "strata-upstream.conf")
    assert re.search(rf"^server strata-pods\.\w+\.svc\.cluster\.local:{headless['spec']['ports'][0]['port']} resolve",
                     upstream, re.M), upstream
    router = deployments["strata-router"]["spec"]["template"]["spec"]
    nginx_image = router["containers"][0]["image"]
    assert nginx_image == load_yaml("deploy", "compose.yaml")["services"]["nginx"]["image"]
    version = tuple(int(x) for x in re.match(r"nginx:(\d+)\.(\d+)", nginx_image).groups())
    assert version >= (1, 28), f"{nginx_image}: `resolve` in an upstream needs nginx 1.27.3 or later"
    paths = {m["mountPath"]: m.get("subPath") for m in router["containers"][0]["volumeMounts"]}
    assert paths == {"/etc/nginx/conf.d/default.conf": "default.conf",
                     "/etc/nginx/strata-upstream.conf": "strata-upstream.conf"}, paths


def check_systemd(tmp):
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        raise rc.Skip("systemd-analyze is not installed")
    unit = read("deploy", "strata.service")
    for key in ["NoNewPrivileges=yes", "PrivateTmp=yes", "ProtectSystem=strict", "ProtectHome=yes",
                "ReadWritePaths=/var/cache/strata", "DynamicUser=yes", "Restart=on-failure", "LimitNOFILE="]:
        assert re.search(rf"^{re.escape(key)}", unit, re.M), f"strata.service lacks {key}"
    # verify needs ExecStart's binary to exist: point it at the one under test.
    unit, n = re.subn(r"^ExecStart=/usr/local/bin/strata ", f"ExecStart={os.path.realpath(rc.BIN)} ", unit, flags=re.M)
    assert n == 1
    path = os.path.join(tmp, "strata.service")
    with open(path, "w") as f:
        f.write(unit)
    done = subprocess.run([analyze, "verify", path], capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and bad values too; its warnings name the file.
    assert done.returncode == 0 and "strata.service" not in done.stdout + done.stderr, done.stdout + done.stderr
    security = subprocess.run([analyze, "security", "--offline=yes", "--threshold=25", path],
                              capture_output=True, text=True, timeout=60)
    if "unrecognized option" in security.stderr:
        print("     (systemd-analyze security --offline is not supported here)")
        return
    level = re.search(r"Overall exposure level for strata\.service: (\S+)", security.stdout)
    assert security.returncode == 0 and level, security.stdout[-500:] + security.stderr
    print(f"     systemd-analyze security: exposure {level.group(1)} (of 10)")


def check_multinode_plans():
    """The two-box topologies load, and over 25 Gb/s the plan keeps TP inside a box and cuts across it."""
    boxes = [set(range(4)), set(range(4, 8))]
    for gbit in [25, 100]:
        topology = os.path.join(DEPLOY, "multinode", f"a30x4-two-boxes-{gbit}gbe.json")
        done = subprocess.run([rc.BIN, "plan", "--model", "llama-3-70b", "--topology", topology, "--json"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        chosen = json.loads(done.stdout)["chosen"]
        groups = [set(s["gpus"]) for s in chosen["stages"]]
        print(f"     {gbit} Gb/s: TP {chosen['tp']} x PP {chosen['pp']} on {[sorted(g) for g in groups]}, "
              f"{chosen['single_stream_ms']:.2f} ms/token alone, {chosen['concurrent_ms']:.2f} ms per 64-stream step")
        if gbit == 25:
            assert chosen["pp"] >= 2 and all(any(g <= b for b in boxes) for g in groups), groups


def check_compose_up(tmp):
    """The CPU stack from deploy/compose.yaml, built and started by a real Docker engine."""
    info = subprocess.run(["docker", "info"], capture_output=True, text=True) if shutil.which("docker") else None
    if info is None or info.returncode != 0:
        reason = "no docker client" if info is None else (info.stderr.strip().splitlines() or ["failed"])[-1]
        raise rc.Skip(f"no Docker engine (`docker info`: {reason})")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        raise rc.Skip("the Docker engine answers but `docker compose` is not installed")
    port = rc.free_port()
    env = dict(os.environ, STRATA_HTTP_PORT=str(port))
    compose = ["docker", "compose", "-p", f"strata-check-{os.getpid()}", "-f", os.path.join(DEPLOY, "compose.yaml")]
    try:
        up = subprocess.run(compose + ["up", "-d", "--build", "--wait", "strata", "nginx"], env=env,
                            capture_output=True, text=True, timeout=3600)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content, reply
        chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, stream=True))
        assert chunks and chunks[0].choices[0].delta.role == "assistant"
    finally:
        subprocess.run(compose + ["down", "-v"], env=env, capture_output=True, timeout=300)


def main():
    if not os.path.exists(rc.BIN):
        sys.exit(f"{rc.BIN} is missing; build it first (cargo build -p strata-cli) or set STRATA_BIN")
    print(f"deploy checks: {rc.BIN}, nginx, openai {openai.__version__}")
    tmp = tempfile.mkdtemp(prefix="strata-deploy-")
    checks = rc.Checks("deploy")
    run = checks.run

    run("Dockerfile: stages, COPY sources in the context, entrypoint and health check in the image, sh -n",
        check_dockerfile)
    run("CUDA image: every library strata dlopens, NVRTC pinned as scripts/fetch.py pins it", check_cuda_libraries)
    run("compose.yaml + compose.gpu.yaml, prometheus.yml, Grafana provisioning: keys, stages, mounted files",
        check_compose)
    run("Kubernetes manifests: probes on /health, selectors, ports, the router's upstream", check_k8s)
    run("systemd unit: systemd-analyze verify and security", lambda: check_systemd(tmp))
    run("cost model: the two-box 70B topologies plan, PP across the boxes over 25 Gb/s", check_multinode_plans)

    servers, proxy = [], None
    try:
        servers.append(rc.Server(tmp))
        servers.append(start_through_entrypoint(tmp))
        run("entrypoint: execs strata serve with the defaults; no model, STRATA_MODEL, subcommands",
            lambda: check_entrypoint_branches(tmp, servers[1]))
        run("healthcheck.py: 0 on a live /health (past a proxy setting), 1 on a closed port",
            lambda: check_healthcheck(servers[1]))
        proxy = DeployNginx(tmp, [s.port for s in servers])
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        run("deploy/nginx.conf (nginx -t passed): streamed chunks arrive as generated", lambda: check_streaming(client))
        run("deploy/nginx.conf: plain chat, /health, /metrics refused, no gzip on streams, 1.4 MB bodies",
            lambda: check_plain_requests(proxy, client))
        run(f"deploy/nginx.conf: one {SESSION_HEADER} sticks to a replica, many spread", lambda: check_routing(servers, client))
        run("Grafana dashboard: every queried metric exists in a live /metrics with its type and labels",
            lambda: check_dashboard(rc.http_get(servers[0].url + "/metrics")[1]))
        run("SIGTERM through the entrypoint: strata exits 0", servers[1].stop)
    except Exception:
        checks.fail("setup")
    finally:
        if proxy:
            proxy.stop()
        for s in servers:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGKILL)
                s.proc.wait()
    run("docker compose up (CPU): a chat through nginx", lambda: check_compose_up(tmp))
    shutil.rmtree(tmp, ignore_errors=True)
    checks.exit()


if __name__ == "__main__":
    main()

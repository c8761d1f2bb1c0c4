#!/usr/bin/env python3
"""Independent reference forward pass of SmolLM2 (GGUF) in numpy, for strata's fidelity test.

Weights come from the `gguf` package's own dequantization (gguf==0.19.0, numpy==2.4.6), the
math is written from the Llama architecture in HF layout: Q/K rows are un-permuted back from
llama.cpp's interleaved order and RoPE uses rotate_half, all in float64. It shares no code
with strata. Input: tests/fidelity/prompts.json (token ids); output:
tests/fidelity/smollm2_reference.json (top-k logits at every prompt position and greedy
32-token continuations).

usage: python3 scripts/reference_smollm2.py [model.gguf]
"""
import json
import os
import sys

import numpy as np
import gguf
from gguf.quants import dequantize

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CACHE = os.environ.get("STRATA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "strata"))
MODEL = sys.argv[1] if len(sys.argv) > 1 else os.path.join(CACHE, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TOP_K = 10
CONTINUATION = 32


def field(r, key):
    return r.fields[key].contents()


def load(path):
    r = gguf.GGUFReader(path)
    cfg = {
        "layers": field(r, "llama.block_count"),
        "hidden": field(r, "llama.embedding_length"),
        "heads": field(r, "llama.attention.head_count"),
        "kv_heads": field(r, "llama.attention.head_count_kv"),
        "eps": field(r, "llama.attention.layer_norm_rms_epsilon"),
        "theta": field(r, "llama.rope.freq_base"),
    }
    w = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        w[t.name] = a.reshape([int(d) for d in reversed(t.shape)]) if a.ndim > 1 else a
    return cfg, w


def unpermute(m, n_head):
    """Inverse of llama.cpp's convert permutation: interleaved RoPE rows back to HF halves."""
    rows, cols = m.shape
    return m.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def rms_norm(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def forward(cfg, w, ids, last_only=False):
    """Logits (len(ids) x vocab, or 1 x vocab with last_only) of a full causal pass."""
    L, H = len(ids), cfg["hidden"]
    nh, nkv = cfg["heads"], cfg["kv_heads"]
    hd = H // nh
    x = w["token_embd.weight"][ids]
    inv = cfg["theta"] ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.outer(np.arange(L, dtype=np.float64), inv)
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    mask = np.triu(np.full((L, L), -np.inf), 1)
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], cfg["eps"])
        q = (h @ unpermute(w[p + "attn_q.weight"], nh).T).reshape(L, nh, hd)
        k = (h @ unpermute(w[p + "attn_k.weight"], nkv).T).reshape(L, nkv, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(L, nkv, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = nh // nkv
        k = np.repeat(k, rep, axis=1)
        v = np.repeat(v, rep, axis=1)
        att = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", att, v).reshape(L, H)
        x = x + o @ w[p + "attn_output.weight"].T
        h = rms_norm(x, w[p + "ffn_norm.weight"], cfg["eps"])
        g = h @ w[p + "ffn_gate.weight"].T
        u = h @ w[p + "ffn_up.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "ffn_down.weight"].T
    if last_only:
        x = x[-1:]
    x = rms_norm(x, w["output_norm.weight"], cfg["eps"])
    head = w.get("output.weight", w["token_embd.weight"])
    return x @ head.T


def main():
    prompts = json.load(open(os.path.join(ROOT, "tests", "fidelity", "prompts.json")))
    cfg, w = load(MODEL)
    out = {"model": os.path.basename(MODEL), "top_k": TOP_K, "precision": "float64", "prompts": []}
    for p in prompts:
        ids = list(p["ids"])
        logits = forward(cfg, w, ids)
        top = []
        for row in logits:
            idx = np.argsort(-row)[:TOP_K]
            lse = float(np.log(np.sum(np.exp(row - row.max()))) + row.max())
            top.append({"ids": [int(i) for i in idx], "logits": [float(row[i]) for i in idx], "logsumexp": lse})
        seq = list(ids)
        for _ in range(CONTINUATION):
            seq.append(int(np.argmax(forward(cfg, w, seq, last_only=True)[-1])))
        out["prompts"].append({"text": p["text"], "chat": p["chat"], "ids": ids, "positions": top, "greedy": seq[len(ids):]})
        print(f"{p['text']!r}: greedy {seq[len(ids):][:8]}...", file=sys.stderr)
    path = os.path.join(ROOT, "tests", "fidelity", "smollm2_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()

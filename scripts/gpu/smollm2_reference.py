#!/usr/bin/env python3
"""On the GPU machine: the reference of the default model with its real weights, in the format of
hf_reference.py's `reference.json`, so that cuda.rs's checkpoint test runs it like the random-weight
ones: transformers loads the same Q4_1 GGUF strata serves (its GGUF loader dequantizes to float32,
the `gguf` package from a carried wheel), and gives the last-position logits and greedy 64-token
continuations of the prompts `strata tokenize` wrote, in bfloat16 and in float32. Real weights have
clear winners at most steps, so greedy text can be compared token for token ("real_weights").

usage: smollm2_reference.py MODEL.gguf PROMPTS.json OUT_DIR
       (PROMPTS.json: `strata tokenize` output; OUT_DIR gets model.gguf, a link, and reference.json)
"""
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def greedy_and_logits(model, ids):
    x = torch.tensor([ids], device="cuda")
    logits = model(x).logits[0, -1].float().cpu().tolist()
    gen = model.generate(x, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    return gen, logits


def main():
    gguf, prompts_json, out = sys.argv[1], sys.argv[2], sys.argv[3]
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    link = os.path.join(out, "model.gguf")
    if not os.path.exists(link):
        os.symlink(os.path.abspath(gguf), link)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(gguf)),
                                                 gguf_file=os.path.basename(gguf),
                                                 torch_dtype=torch.float32).cuda().eval()
    prompts = [p["ids"] for p in json.load(open(prompts_json))]
    ref = {"arch": "smollm2-135m (real weights)", "real_weights": True, "prompts": [],
           "note": "transformers " + __import__("transformers").__version__}
    with torch.no_grad():
        for ids in prompts:
            gen, logits = greedy_and_logits(model, ids)
            ref["prompts"].append({"ids": ids, "greedy_f32": gen, "last_logits_f32": logits})
        model.to(torch.bfloat16)
        for r in ref["prompts"]:
            r["greedy"], r["last_logits"] = greedy_and_logits(model, r["ids"])
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f)
    print(f"smollm2: reference written in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()

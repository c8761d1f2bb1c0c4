#!/usr/bin/env python3
"""On the GPU machine: transformers' own speed on a checkpoint, to print beside strata's
(bench-gpu) in the same run: TTFT of one 512-token prompt, single-stream decode, and a batch of
concurrent greedy requests through generate().

usage: transformers_speed.py CHECKPOINT_DIR OUT_JSON [BATCH]
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ckpt, out = sys.argv[1], sys.argv[2]
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.bfloat16, device_map="cuda").eval()
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompt = torch.randint(1000, vocab - 1000, (1, 512), generator=g).cuda()
    res = {"checkpoint": ckpt, "transformers": __import__("transformers").__version__}
    with torch.no_grad():
        for _ in range(2):
            model(prompt)
        torch.cuda.synchronize()
        t = time.time()
        for _ in range(5):
            model(prompt)
        torch.cuda.synchronize()
        res["ttft_512_ms"] = (time.time() - t) / 5 * 1e3
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate(prompt[:, :16], max_new_tokens=8, min_new_tokens=8, **kw)
        torch.cuda.synchronize()
        t = time.time()
        model.generate(prompt[:, :16], max_new_tokens=128, min_new_tokens=128, **kw)
        torch.cuda.synchronize()
        res["single_stream_decode_tok_s"] = 128 / (time.time() - t)
        prompts = torch.randint(1000, vocab - 1000, (batch, 512), generator=g).cuda()
        t = time.time()
        model.generate(prompts, max_new_tokens=128, min_new_tokens=128, **kw)
        torch.cuda.synchronize()
        res[f"batch_{batch}_512in_128out_output_tok_s"] = batch * 128 / (time.time() - t)
    print(json.dumps(res, indent=1))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

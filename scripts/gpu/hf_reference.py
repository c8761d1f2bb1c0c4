#!/usr/bin/env python3
"""On the GPU machine: make a random-weight checkpoint of a real architecture with transformers
(bf16, safetensors) beside a real tokenizer, and the reference strata is compared with:
greedy 64-token continuations and last-position logits of 3 prompts, from transformers' own
forward pass on the same weights, in bf16 and again in float32.

usage: hf_reference.py ARCH OUT_DIR TOKENIZER_DIR [--prompts-only | --config-only]
       (ARCH: llama3-8b | qwen2.5-7b | qwen2.5-32b; --prompts-only writes the prompts without
       transformers' outputs, for speed runs of large models; --config-only writes config.json
       alone, for `strata quantize --random-weights`)
"""
import json
import os
import shutil
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ARCHS = {
    "llama3-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=128001,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen2.5-32b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=5120, intermediate_size=27648,
        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
        rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
}

PROMPT_LENGTHS = [7, 23, 61]


def main():
    arch, out, tok_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    t0 = time.time()
    cfg = AutoConfig.for_model(**ARCHS[arch])
    cfg.torch_dtype = torch.bfloat16
    if "--config-only" in sys.argv:
        # The shape alone, for `strata quantize --random-weights` (a model larger than the disk).
        os.makedirs(out, exist_ok=True)
        cfg.to_json_file(os.path.join(out, "config.json"))
        print(f"{arch}: config written", flush=True)
        return
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(tok_dir, f), os.path.join(out, f))
    print(f"{arch}: checkpoint written in {time.time() - t0:.1f}s", flush=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1000, 100000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    ref = {"arch": arch, "prompts": [], "note": "transformers " + __import__("transformers").__version__}
    if "--prompts-only" in sys.argv:
        ref["prompts"] = [{"ids": ids} for ids in prompts]
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(ref, f)
        return
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            logits = model(x).logits[0, -1].float().cpu()
            gen = model.generate(x, max_new_tokens=64, do_sample=False, min_new_tokens=64,
                                 eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
            ref["prompts"].append({"ids": ids, "greedy": gen, "last_logits": logits.tolist()})
    # The same weights in float32 end to end: the reference without bf16 rounding of activations.
    model.float()
    with torch.no_grad():
        for r in ref["prompts"]:
            x = torch.tensor([r["ids"]], device="cuda")
            r["last_logits_f32"] = model(x).logits[0, -1].float().cpu().tolist()
            r["greedy_f32"] = model.generate(x, max_new_tokens=64, do_sample=False, min_new_tokens=64,
                                             eos_token_id=None, pad_token_id=0)[0, len(r["ids"]):].tolist()
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f)
    print(f"{arch}: reference written in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()

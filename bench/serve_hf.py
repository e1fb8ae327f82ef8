"""Generation speed of transformers' `generate` (KV cache, greedy), for comparison with
`loom-run --generate` on a serving bundle of the same model.

Builds the model from a config with random weights (nothing is downloaded): GPT-2 at
350M (L=24, h=1024, 16 heads, V=50304) or TinyLlama 1.1B, in bf16 on the GPU, then for
each batch size generates --new tokens after a --prompt-token prompt of random ids and
prints the time to first token (a generate of one new token), the time per new token
((total - first) / (new - 1)) and tokens/s, after --warmup runs, the median of --runs.

usage: python3 bench/serve_hf.py [--model gpt2-350m|llama-1.1b] [--batches 1,32]
       [--prompt 128 --new 128 --runs 3 --warmup 1]
"""
import argparse
import statistics
import time

import torch


def build(name):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name == "gpt2-350m":
        cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, vocab_size=50304, n_positions=1024,
                         activation_function="gelu_new", attn_implementation="sdpa")
        model = GPT2LMHeadModel(cfg)
    elif name == "llama-1.1b":
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                          max_position_embeddings=2048, attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown model {name}")
    return model.to(device="cuda", dtype=torch.bfloat16).eval(), cfg.vocab_size


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-350m")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    torch.manual_seed(0)
    model, vocab = build(a.model)
    for batch in [int(b) for b in a.batches.split(",")]:
        ids = torch.randint(0, vocab, (batch, a.prompt), device="cuda")
        mask = torch.ones_like(ids)

        def gen(n):
            return lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                          min_new_tokens=n, do_sample=False, use_cache=True,
                                          pad_token_id=0)
        with torch.no_grad():
            for _ in range(a.warmup):
                gen(a.new)()
            firsts = [timed(gen(1)) for _ in range(a.runs)]
            totals = [timed(gen(a.new)) for _ in range(a.runs)]
        first, total = statistics.median(firsts), statistics.median(totals)
        per_token = (total - first) / (a.new - 1)
        print(f"transformers {a.model} batch {batch}: time to first token {first * 1e3:.2f} ms, "
              f"per-token {per_token * 1e3:.3f} ms, {batch * a.new / total:.0f} tokens/s "
              f"({a.new} new after {a.prompt}, median of {a.runs})", flush=True)


if __name__ == "__main__":
    main()

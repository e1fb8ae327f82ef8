#!/usr/bin/env python3
"""Hugging Face checkpoints for loomc import's tests, with the standard library
only (CI has no transformers, torch or numpy).

  write KIND DIR [--dtype f32|bf16] [--shards N] [--tokenizer F] [--break WHAT]
      a random-weight checkpoint in transformers' layout: config.json and
      model.safetensors (or an index and N shards); KIND is gpt2, llama (grouped
      key/value heads, rope theta 500000, RMSNorm eps 1e-5) or llama-tied.
      --break damages it the way a test needs.
  tokens FILE --batch B --seq S --vocab V
      a safetensors file with an i32 'tokens' input for loom-run --input.
  check DIR TOKENS LOGITS [--tol T]
      compares loom-run's logits with this file's own forward pass, written in
      Hugging Face's layout and conventions (Conv1D weights, nn.Linear [out, in],
      rotate_half rotary embeddings, repeat_kv grouped attention).
  same DIR_A DIR_B
      the two checkpoints hold the same tensors (names, shapes, values) and the
      same model configuration.
"""
import argparse
import json
import math
import os
import random
import struct
import sys

CONFIGS = {
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 64,
        "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
        "bos_token_id": 0, "eos_token_id": 0, "dtype": "float32",
    },
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
    },
}
CONFIGS["llama-tied"] = dict(CONFIGS["llama"], tie_word_embeddings=True,
                             rope_parameters=None, rope_theta=10000.0, rms_norm_eps=1e-6)


# --- safetensors ------------------------------------------------------------

def f32_to_bf16_bits(v):
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def encode(values, dtype):
    if dtype == "F32":
        return struct.pack("<%df" % len(values), *values)
    if dtype == "BF16":
        return struct.pack("<%dH" % len(values), *[f32_to_bf16_bits(v) for v in values])
    if dtype == "I32":
        return struct.pack("<%di" % len(values), *values)
    raise ValueError(dtype)


def decode(data, dtype):
    if dtype == "F32":
        return list(struct.unpack("<%df" % (len(data) // 4), data))
    if dtype == "BF16":
        bits = struct.unpack("<%dH" % (len(data) // 2), data)
        return [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]
    if dtype == "I32":
        return list(struct.unpack("<%di" % (len(data) // 4), data))
    raise ValueError(dtype)


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (dtype, shape, values)}"""
    header, blobs, offset = {"__metadata__": metadata or {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        dtype, shape, values = tensors[name]
        blob = encode(values, dtype)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        out[name] = (e["shape"], decode(data[8 + n + a:8 + n + b], e["dtype"]))
    return out


def read_checkpoint(d):
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return read_safetensors(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for name in files:
        out.update(read_safetensors(os.path.join(d, name)))
    return out


# --- checkpoints ------------------------------------------------------------

def hf_shapes(c):
    if c["model_type"] == "gpt2":
        h, v, f = c["n_embd"], c["vocab_size"], c["n_inner"] or 4 * c["n_embd"]
        shapes = {"transformer.wte.weight": [v, h], "transformer.wpe.weight": [c["n_positions"], h],
                  "transformer.ln_f.weight": [h], "transformer.ln_f.bias": [h]}
        for i in range(c["n_layer"]):
            p = "transformer.h.%d." % i
            shapes.update({p + "ln_1.weight": [h], p + "ln_1.bias": [h],
                           p + "attn.c_attn.weight": [h, 3 * h], p + "attn.c_attn.bias": [3 * h],
                           p + "attn.c_proj.weight": [h, h], p + "attn.c_proj.bias": [h],
                           p + "ln_2.weight": [h], p + "ln_2.bias": [h],
                           p + "mlp.c_fc.weight": [h, f], p + "mlp.c_fc.bias": [f],
                           p + "mlp.c_proj.weight": [f, h], p + "mlp.c_proj.bias": [h]})
        return shapes
    h, v, f = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [v, h]
    for i in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % i
        shapes.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                       p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
                       p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
                       p + "mlp.gate_proj.weight": [f, h], p + "mlp.up_proj.weight": [f, h],
                       p + "mlp.down_proj.weight": [h, f]})
    return shapes


def write(args):
    c = json.loads(json.dumps(CONFIGS[args.kind]))
    c = {k: v for k, v in c.items() if v is not None or k == "n_inner"}
    rng = random.Random(args.seed)
    dtype = "BF16" if args.dtype == "bf16" else "F32"
    tensors = {}
    for name, shape in hf_shapes(c).items():
        n = math.prod(shape)
        if len(shape) == 1 and name.endswith("weight"):  # norm gains around 1
            values = [1.0 + 0.1 * rng.gauss(0, 1) for _ in range(n)]
        else:
            values = [0.15 * rng.gauss(0, 1) for _ in range(n)]
        tensors[name] = (dtype, shape, values)
    brk = args.break_ or ""
    if brk == "arch":
        c["architectures"] = ["BertForMaskedLM"]
    elif brk == "field":
        c["n_head" if "n_head" in c else "num_attention_heads"] = "four"
    elif brk == "kv-heads":
        c["num_key_value_heads"] = 3
    elif brk == "rope-scaling":
        c["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    elif brk == "activation":
        c["activation_function"] = "relu"
    elif brk == "shape":
        name = sorted(n for n in tensors if n.endswith(("c_attn.weight", "k_proj.weight")))[0]
        dt, shape, values = tensors[name]
        tensors[name] = (dt, [shape[0], shape[1] - 2], values[:shape[0] * (shape[1] - 2)])
    elif brk == "missing":
        del tensors[sorted(n for n in tensors if n.endswith(("ln_2.bias", "o_proj.weight")))[-1]]
    elif brk == "extra":
        tensors["transformer.h.0.attn.rotary.weight"] = ("F32", [2], [0.0, 1.0])
    elif brk == "dtype":
        name = sorted(n for n in tensors if n.endswith(("ln_1.weight", "input_layernorm.weight")))[0]
        tensors[name] = ("I32", tensors[name][1], [1] * math.prod(tensors[name][1]))
    os.makedirs(args.dir, exist_ok=True)
    text = json.dumps(c, indent=2)
    if brk == "config-json":
        text = text[:len(text) // 2]
    with open(os.path.join(args.dir, "config.json"), "w") as f:
        f.write(text)
    if args.shards > 1 or brk == "shard-escape":
        names = sorted(tensors)
        weight_map = {}
        for k in range(max(args.shards, 1)):
            file = "model-%05d-of-%05d.safetensors" % (k + 1, args.shards)
            part = names[k::args.shards]
            write_safetensors(os.path.join(args.dir, file), {n: tensors[n] for n in part})
            weight_map.update({n: file for n in part})
        if brk == "shard-escape":
            weight_map[names[0]] = "../elsewhere.safetensors"
        with open(os.path.join(args.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    else:
        write_safetensors(os.path.join(args.dir, "model.safetensors"), tensors)
    if brk == "truncated":
        path = os.path.join(args.dir, "model.safetensors")
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size - 100)
    if args.tokenizer:
        with open(args.tokenizer, "rb") as src:
            name = "tokenizer.json" if args.tokenizer.endswith(".json") else "tokenizer.model"
            with open(os.path.join(args.dir, name), "wb") as dst:
                dst.write(src.read())


def tokens(args):
    rng = random.Random(7)
    ids = [rng.randrange(args.vocab) for _ in range(args.batch * args.seq)]
    write_safetensors(args.file, {"tokens": ("I32", [args.batch, args.seq], ids)})


# --- the reference forward pass, in Hugging Face's layout -------------------

def matvec_rows(x, w, rows, cols):
    """x [cols] times nn.Linear weight w [rows, cols] (row-major) -> [rows]."""
    return [sum(x[k] * w[r * cols + k] for k in range(cols)) for r in range(rows)]


def vec_conv1d(x, w, b, n_in, n_out):
    """x [n_in] times Conv1D weight w [n_in, n_out] plus bias -> [n_out]."""
    out = list(b) if b is not None else [0.0] * n_out
    for k in range(n_in):
        xk, base = x[k], k * n_out
        if xk:
            for j in range(n_out):
                out[j] += xk * w[base + j]
    return out


def layernorm(x, g, b, eps):
    m = sum(x) / len(x)
    var = sum((v - m) ** 2 for v in x) / len(x)
    s = 1.0 / math.sqrt(var + eps)
    return [(v - m) * s * g[i] + b[i] for i, v in enumerate(x)]


def rmsnorm(x, g, eps):
    s = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [v * s * g[i] for i, v in enumerate(x)]


def attention(q, k, v, heads, kv_heads, d):
    """q [S][heads*d], k and v [S][kv_heads*d]; causal; repeat_kv grouping."""
    S, rep, out = len(q), heads // kv_heads, []
    for s in range(S):
        row = []
        for h in range(heads):
            g = h // rep
            qh = q[s][h * d:(h + 1) * d]
            scores = [sum(qh[i] * k[t][g * d + i] for i in range(d)) / math.sqrt(d) for t in range(s + 1)]
            m = max(scores)
            p = [math.exp(x - m) for x in scores]
            z = sum(p)
            row += [sum(p[t] * v[t][g * d + i] for t in range(s + 1)) / z for i in range(d)]
        out.append(row)
    return out


def gpt2_forward(c, w, toks):
    h, nh, eps = c["n_embd"], c["n_head"], c["layer_norm_epsilon"]
    f, V = c.get("n_inner") or 4 * h, c["vocab_size"]
    wte, wpe = w["transformer.wte.weight"][1], w["transformer.wpe.weight"][1]
    x = [[wte[t * h + i] + wpe[p * h + i] for i in range(h)] for p, t in enumerate(toks)]
    for l in range(c["n_layer"]):
        P = lambda n: w["transformer.h.%d.%s" % (l, n)][1]
        a = [layernorm(r, P("ln_1.weight"), P("ln_1.bias"), eps) for r in x]
        qkv = [vec_conv1d(r, P("attn.c_attn.weight"), P("attn.c_attn.bias"), h, 3 * h) for r in a]
        att = attention([r[:h] for r in qkv], [r[h:2 * h] for r in qkv], [r[2 * h:] for r in qkv],
                        nh, nh, h // nh)
        o = [vec_conv1d(r, P("attn.c_proj.weight"), P("attn.c_proj.bias"), h, h) for r in att]
        x = [[a_ + b_ for a_, b_ in zip(r, s)] for r, s in zip(x, o)]
        m = [layernorm(r, P("ln_2.weight"), P("ln_2.bias"), eps) for r in x]
        u = [vec_conv1d(r, P("mlp.c_fc.weight"), P("mlp.c_fc.bias"), h, f) for r in m]
        u = [[0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in r]
             for r in u]
        d = [vec_conv1d(r, P("mlp.c_proj.weight"), P("mlp.c_proj.bias"), f, h) for r in u]
        x = [[a_ + b_ for a_, b_ in zip(r, s)] for r, s in zip(x, d)]
    x = [layernorm(r, w["transformer.ln_f.weight"][1], w["transformer.ln_f.bias"][1], eps) for r in x]
    return [matvec_rows(r, wte, V, h) for r in x]


def rope_half(x, heads, d, pos, theta):
    """transformers' rotate_half convention: pairs (i, i + d/2) of each head."""
    out = list(x)
    for hd in range(heads):
        for i in range(d // 2):
            ang = pos * theta ** (-2.0 * i / d)
            a, b = x[hd * d + i], x[hd * d + i + d // 2]
            out[hd * d + i] = a * math.cos(ang) - b * math.sin(ang)
            out[hd * d + i + d // 2] = b * math.cos(ang) + a * math.sin(ang)
    return out


def llama_forward(c, w, toks):
    h, nh, eps, V = c["hidden_size"], c["num_attention_heads"], c["rms_norm_eps"], c["vocab_size"]
    nkv, f, d = c["num_key_value_heads"], c["intermediate_size"], h // nh
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    emb = w["model.embed_tokens.weight"][1]
    x = [emb[t * h:(t + 1) * h] for t in toks]
    for l in range(c["num_hidden_layers"]):
        P = lambda n: w["model.layers.%d.%s" % (l, n)][1]
        a = [rmsnorm(r, P("input_layernorm.weight"), eps) for r in x]
        q = [rope_half(matvec_rows(r, P("self_attn.q_proj.weight"), h, h), nh, d, p, theta)
             for p, r in enumerate(a)]
        k = [rope_half(matvec_rows(r, P("self_attn.k_proj.weight"), nkv * d, h), nkv, d, p, theta)
             for p, r in enumerate(a)]
        v = [matvec_rows(r, P("self_attn.v_proj.weight"), nkv * d, h) for r in a]
        o = [matvec_rows(r, P("self_attn.o_proj.weight"), h, h) for r in attention(q, k, v, nh, nkv, d)]
        x = [[a_ + b_ for a_, b_ in zip(r, s)] for r, s in zip(x, o)]
        m = [rmsnorm(r, P("post_attention_layernorm.weight"), eps) for r in x]
        g = [matvec_rows(r, P("mlp.gate_proj.weight"), f, h) for r in m]
        u = [matvec_rows(r, P("mlp.up_proj.weight"), f, h) for r in m]
        gu = [[gi / (1 + math.exp(-gi)) * ui for gi, ui in zip(gr, ur)] for gr, ur in zip(g, u)]
        dn = [matvec_rows(r, P("mlp.down_proj.weight"), h, f) for r in gu]
        x = [[a_ + b_ for a_, b_ in zip(r, s)] for r, s in zip(x, dn)]
    x = [rmsnorm(r, w["model.norm.weight"][1], eps) for r in x]
    head = w["model.embed_tokens.weight" if c["tie_word_embeddings"] else "lm_head.weight"][1]
    return [matvec_rows(r, head, V, h) for r in x]


def check(args):
    with open(os.path.join(args.dir, "config.json")) as f:
        c = json.load(f)
    w = read_checkpoint(args.dir)
    shape, ids = read_safetensors(args.tokens)["tokens"]
    out = read_safetensors(args.logits)
    (lshape, logits), = out.values()
    B, S = shape
    forward = gpt2_forward if c["model_type"] == "gpt2" else llama_forward
    V = c["vocab_size"]
    assert lshape == [B, S, V], "logits are %s, expected %s" % (lshape, [B, S, V])
    worst, scale = 0.0, 0.0
    for b in range(B):
        ref = forward(c, w, ids[b * S:(b + 1) * S])
        for s in range(S):
            for j in range(V):
                got = logits[(b * S + s) * V + j]
                worst = max(worst, abs(got - ref[s][j]))
                scale = max(scale, abs(ref[s][j]))
    rel = worst / scale
    print("max |loom - reference| = %.3g, max |reference| = %.3g, relative %.3g (tolerance %g)"
          % (worst, scale, rel, args.tol))
    if not rel <= args.tol:
        print("FAIL: relative error above tolerance")
        return 1
    print("ok")
    return 0


def same(args):
    a, b = read_checkpoint(args.a), read_checkpoint(args.b)
    if sorted(a) != sorted(b):
        print("tensors differ: only in %s: %s; only in %s: %s" % (
            args.a, sorted(set(a) - set(b)), args.b, sorted(set(b) - set(a))))
        return 1
    for name in a:
        if a[name] != b[name]:
            print("tensor %s differs" % name)
            return 1
    ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in (args.a, args.b))
    theta = lambda c: (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta"))
    keys = set(ca) & set(cb) - {"dtype", "torch_dtype", "transformers_version", "n_inner",
                                 "bos_token_id", "eos_token_id", "rope_parameters", "rope_theta"}
    for k in sorted(keys):
        if ca[k] != cb[k]:
            print("config field %s: %r vs %r" % (k, ca[k], cb[k]))
            return 1
    if theta(ca) != theta(cb):
        print("rope theta: %r vs %r" % (theta(ca), theta(cb)))
        return 1
    print("same: %d tensors" % len(a))
    return 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("kind", choices=sorted(CONFIGS))
    w.add_argument("dir")
    w.add_argument("--dtype", default="f32")
    w.add_argument("--shards", type=int, default=1)
    w.add_argument("--seed", type=int, default=1)
    w.add_argument("--tokenizer")
    w.add_argument("--break", dest="break_")
    t = sub.add_parser("tokens")
    t.add_argument("file")
    t.add_argument("--batch", type=int, required=True)
    t.add_argument("--seq", type=int, required=True)
    t.add_argument("--vocab", type=int, required=True)
    c = sub.add_parser("check")
    c.add_argument("dir")
    c.add_argument("tokens")
    c.add_argument("logits")
    c.add_argument("--tol", type=float, default=1e-5)
    s = sub.add_parser("same")
    s.add_argument("a")
    s.add_argument("b")
    args = p.parse_args()
    return {"write": write, "tokens": tokens, "check": check, "same": same}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())

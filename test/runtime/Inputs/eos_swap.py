"""Makes a tokenizer whose end-of-sequence token is one a greedy answer holds.

usage: eos_swap.py TOKENIZER.json ANSWER.txt OUT.json
ANSWER.txt is loom-run --generate's output for one prompt with --ignore-eos,
ANSWER.txt.prompt the prompt's ids (loom-tokenize).
The first answer token T that is not in the prompt trades ids with
"<|endoftext|>" (id 0), so the prompt encodes to the same ids and the model
(same weights) gives the same answer up to T, which is now the end of
sequence. Prints the line loom-run should print without --ignore-eos.
"""
import json
import sys

tok_path, answer_path, out_path = sys.argv[1:4]
lines = open(answer_path).read().splitlines()
head = [l for l in lines if l.startswith("request 0: ")][0]
counts, ids = head.split(":", 1)[1], head.split(":")[2].split()
n_prompt = int(counts.split()[0])
tok = json.load(open(tok_path))
vocab = tok["model"]["vocab"]
eos = [a for a in tok["added_tokens"] if a["content"] == "<|endoftext|>"][0]
prompt_ids = set(int(x) for x in open(answer_path + ".prompt").read().split())
pick = next(i for i, t in enumerate(ids) if int(t) not in prompt_ids and int(t) != eos["id"])
t = int(ids[pick])
word = [k for k, v in vocab.items() if v == t][0]
vocab[word], eos["id"] = eos["id"], t
vocab[eos["content"]] = t
json.dump(tok, open(out_path, "w"))
print("request 0: %d prompt + %d new tokens (stop): %s" % (n_prompt, pick + 1, " ".join(ids[:pick + 1])))

"""loom-serve with a bundle that carries a tokenizer (standard library only).

usage: serve_text.py BUNDLE GENERATED.txt PROMPT

GENERATED.txt is loom-run --generate --prompt-text PROMPT --ignore-eos's
output. Checks that a text prompt is answered with the same tokens and text,
streamed (the chunks' "text" concatenated) and not, and that a prompt of token
ids still works. Every wait is bounded; a failure exits 1 with the reason.
"""
import http.client
import json
import re
import subprocess
import sys
import threading
import time

TIMEOUT = 30


def fail(why):
    print("FAIL:", why, flush=True)
    server.kill()
    sys.exit(1)


def check(cond, why):
    if not cond:
        fail(why)


def post(body):
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body))
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


bundle, generated, prompt = sys.argv[1:4]
out = open(generated).read()
want_tokens = [int(t) for t in re.search(r"request 0: .*\):(.*)", out).group(1).split()]
want_text = json.loads(re.search(r"request 0 text: (.*)", out).group(1))

server = subprocess.Popen(["loom-serve", bundle, "--port", "0", "--threads", "2"], stdout=subprocess.PIPE, text=True)
lines = []
threading.Thread(target=lambda: [lines.append(l) for l in server.stdout], daemon=True).start()
end = time.monotonic() + 30
while not any("listening on" in l for l in lines) and server.poll() is None and time.monotonic() < end:
    time.sleep(0.05)
m = re.search(r"listening on (\S+):(\d+)", "".join(lines))
check(m, "loom-serve did not start: " + "".join(lines))
host, port = m.group(1), int(m.group(2))

body = {"prompt": prompt, "max_tokens": len(want_tokens), "ignore_eos": True}
status, text = post(body)
check(status == 200, f"text prompt answered {status}: {text}")
choice = json.loads(text)["choices"][0]
check(choice["tokens"] == want_tokens, f"tokens {choice['tokens']} vs loom-run's {want_tokens}")
check(choice["text"] == want_text, f"text {choice['text']!r} vs loom-run's {want_text!r}")
print("text: %d tokens, %r as loom-run" % (len(want_tokens), want_text))

status, text = post(dict(body, stream=True))
check(status == 200, f"streamed text prompt answered {status}")
pieces, tokens = [], []
for line in text.splitlines():
    if line.startswith("data: ") and line != "data: [DONE]":
        c = json.loads(line[len("data: "):])["choices"][0]
        tokens += c["tokens"]
        pieces.append(c["text"])
check(tokens == want_tokens, f"streamed tokens {tokens} vs {want_tokens}")
check("".join(pieces) == want_text, f"streamed text {''.join(pieces)!r} vs {want_text!r}")
print("stream: %d chunks, their text joined as loom-run's" % len(pieces))

status, text = post({"prompt": 7, "max_tokens": 2})
check(status == 400 and "text or an array of token ids" in text, f"a number as prompt answered {status}: {text}")
status, text = post({"prompt": "", "max_tokens": 2})
check(status == 400 and "empty" in text, f"an empty text prompt answered {status}: {text}")
print("errors: 400 for a number and an empty text")
server.terminate()
server.wait(timeout=30)
print("PASS")

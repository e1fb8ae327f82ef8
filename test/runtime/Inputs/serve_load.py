"""Load and failure test of loom-serve (standard library only).

usage: serve_load.py BUNDLE GREEDY.txt PROMPTS.txt MAX_NEW

Starts loom-serve on a free port, then checks: concurrent clients get every
request answered once, with the greedy tokens of loom-run --generate (GREEDY.txt,
run with --max-new MAX_NEW on PROMPTS.txt), streamed or not; bad requests get
400/404/413; a burst beyond --max-queue gets 429s and loses nothing; a streaming
client that disconnects cancels its request and its cache blocks come back;
/metrics parses; SIGTERM lets the request in flight finish and exits 0.
Every wait is bounded; a failure exits 1 with the reason.
"""
import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time

DEADLINE = time.monotonic() + 240  # the whole test, whatever happens
TIMEOUT = 30  # one HTTP exchange
MAX_QUEUE = 2


def fail(why):
    print("FAIL:", why, flush=True)
    if server.poll() is None:
        server.kill()
    sys.exit(1)


def check(cond, why):
    if not cond:
        fail(why)


def request(method, path, body=None, raw=None):
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    try:
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def complete(body):
    status, text = request("POST", "/v1/completions", body)
    return status, (json.loads(text) if text.strip() else None)


def stream(body, on_first=None):
    """POSTs with stream=true; returns (status, tokens, finish_reason, id)."""
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)))
        r = conn.getresponse()
        if r.status != 200:
            return r.status, None, None, None
        tokens, finish, ident, done = [], None, None, False
        while not done:
            line = r.readline()
            check(line, "the stream ended before data: [DONE]")
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            chunk = json.loads(payload)
            ident = chunk["id"]
            tokens += chunk["choices"][0]["tokens"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            if on_first and tokens:
                on_first()
                on_first = None
        return 200, tokens, finish, ident
    finally:
        conn.close()


def metrics():
    status, text = request("GET", "/metrics")
    check(status == 200, f"/metrics answered {status}")
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)', line)
        check(m, f"/metrics line does not parse: {line!r}")
        values[m.group(1)] = float(m.group(2))
    return values


def wait_for(cond, what, seconds=20):
    end = min(time.monotonic() + seconds, DEADLINE)
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    fail(f"timed out waiting for {what}")


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))] if v else 0.0


bundle, greedy_file, prompts_file, max_new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = [[int(t) for t in re.sub(r"[,\[\]]", " ", l).split()] for l in open(prompts_file) if l.strip()]
expected = {}
for line in open(greedy_file):
    m = re.match(r"request (\d+): .*\):(.*)", line)
    if m:
        expected[int(m.group(1))] = [int(t) for t in m.group(2).split()]
assert len(expected) == len(prompts), "GREEDY.txt does not match PROMPTS.txt"

server = subprocess.Popen(["loom-serve", bundle, "--port", "0", "--threads", "2", "--max-queue", str(MAX_QUEUE)],
                          stdout=subprocess.PIPE, text=True)
lines = []


def read_stdout():
    for line in server.stdout:
        lines.append(line)


threading.Thread(target=read_stdout, daemon=True).start()
wait_for(lambda: any("listening on" in l for l in lines) or server.poll() is not None, "loom-serve to listen")
check(server.poll() is None, "loom-serve exited at start")
host, port = re.search(r"listening on (\S+):(\d+)", "".join(lines)).groups()
port = int(port)
max_seq = int(re.search(r"max sequence (\d+)", "".join(lines)).group(1))
wait_for(lambda: request("GET", "/health")[0] == 200, "/health")
print("health: ok")

# Concurrent clients: every request answered once, with loom-run's tokens.
CLIENTS, EACH = 8, 5
answers, latencies, errors, retried = [], [], [], []
lock = threading.Lock()


def client(c):
    for m in range(EACH):
        q = (c * EACH + m) % len(prompts)
        body = {"prompt": prompts[q], "max_tokens": max_new}
        start, retries = time.monotonic(), 0
        try:
            while True:  # a full queue (429) is retried, as a client would
                if (c + m) % 2:
                    status, tokens, finish, ident = stream(body)
                else:
                    status, doc = complete(body)
                    tokens, finish, ident = ((doc["choices"][0]["tokens"], doc["choices"][0]["finish_reason"],
                                              doc["id"]) if status == 200 else (None, None, None))
                if status != 429 or retries == 200 or time.monotonic() > DEADLINE:
                    break
                retries += 1
                time.sleep(0.005 * (1 + c))
        except Exception as e:  # noqa: BLE001 (any failure of a client is the test's failure)
            with lock:
                errors.append(f"client {c} request {m}: {e!r}")
            continue
        with lock:
            latencies.append(time.monotonic() - start)
            answers.append((c, m, q, status, tokens, finish, ident))
            retried.append(retries)


threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
for t in threads:
    t.start()
for t in threads:
    t.join(max(0.0, DEADLINE - time.monotonic()))
check(not errors, "; ".join(errors[:3]))
check(len(answers) == CLIENTS * EACH, f"{len(answers)} of {CLIENTS * EACH} requests answered")
check(len({(a[0], a[1]) for a in answers}) == CLIENTS * EACH, "a request was answered twice")
served = [a[6] for a in answers if a[3] == 200]
check(len(set(served)) == len(served), "two answers share an id")
for c, m, q, status, tokens, finish, ident in answers:
    check(status == 200, f"client {c} request {m} answered {status}")
    check(tokens == expected[q], f"prompt {q}: served {tokens}, loom-run --generate gave {expected[q]}")
    check(finish == "length", f"prompt {q}: finish_reason {finish}")
print(f"load: {CLIENTS} clients x {EACH} requests: {len(answers)} answered with loom-run's tokens "
      f"(streamed and not), ids unique; {sum(retried)} retries after 429")
print(f"latency: p50 {pct(latencies, 0.5) * 1e3:.1f} ms, p99 {pct(latencies, 0.99) * 1e3:.1f} ms")

# Bad requests.
def expect(status, want, what, text=""):
    check(status == want, f"{what}: answered {status}, want {want} {text}")


status, text = request("POST", "/v1/completions", raw="{not json")
expect(status, 400, "malformed JSON", text)
check("error" in json.loads(text) and json.loads(text)["error"]["message"], "an error body has error.message")
expect(complete({"prompt": [1, 2], "max_tokens": -1})[0], 400, "negative max_tokens")
status, doc = complete({"prompt": [1] * (max_seq + 8)})
expect(status, 400, "a prompt longer than max_seq")
check("max" in doc["error"]["message"], f"long prompt message: {doc}")
status, doc = complete({"prompt": [1, 2, 300]})
expect(status, 400, "a token outside the vocabulary")
check("vocabulary" in doc["error"]["message"], f"vocabulary message: {doc}")
status, doc = complete({"prompt": "hello"})
expect(status, 400, "a text prompt")
check("no tokenizer" in doc["error"]["message"], f"text prompt message: {doc}")
expect(complete({"prompt": [1], "temperature": "hot"})[0], 400, "a temperature that is not a number")
expect(request("GET", "/v1/nothing")[0], 404, "an unknown path")
expect(request("POST", "/v1/completions", raw=" " * (2 << 20))[0], 413, "a 2 MiB body")
print("errors: malformed JSON, negative max_tokens, long prompt, out-of-vocabulary token, text prompt -> 400; "
      "unknown path -> 404; oversized body -> 413")

# A burst beyond --max-queue: some 429, none lost, the server answers afterwards.
BURST = 24
burst = []


def burst_client(i):
    try:
        # Long requests (to max_seq), so that the burst outlasts the queue.
        status, doc = complete({"prompt": prompts[i % len(prompts)], "max_tokens": 10000})
        with lock:
            burst.append((i, status, doc))
    except Exception as e:  # noqa: BLE001
        with lock:
            errors.append(f"burst {i}: {e!r}")


threads = [threading.Thread(target=burst_client, args=(i,), daemon=True) for i in range(BURST)]
for t in threads:
    t.start()
for t in threads:
    t.join(max(0.0, DEADLINE - time.monotonic()))
check(not errors, "; ".join(errors[:3]))
check(len(burst) == BURST, f"burst: {len(burst)} of {BURST} answered")
codes = [s for _, s, _ in burst]
check(set(codes) <= {200, 429}, f"burst answers {sorted(set(codes))}")
check(429 in codes, f"a burst of {BURST} beyond --max-queue {MAX_QUEUE} got no 429")
for i, s, doc in burst:
    if s == 200:
        tokens = doc["choices"][0]["tokens"]
        check(tokens[:max_new] == expected[i % len(prompts)] and
              len(tokens) == max_seq - len(prompts[i % len(prompts)]), f"burst {i}: wrong tokens")
status, doc = complete({"prompt": prompts[0], "max_tokens": max_new})
check(status == 200 and doc["choices"][0]["tokens"] == expected[0], "the server answers after the burst")
print(f"burst: {BURST} at once, queue of {MAX_QUEUE}: {codes.count(200)} answered, {codes.count(429)} refused "
      "(429), none lost; the server answers afterwards")

# A streaming client that goes away mid-stream: its request is cancelled and
# its blocks return. The request is long (to max_seq), so it still runs
# when the client goes away.
before = metrics()
conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [5], "max_tokens": 1000, "stream": True}))
r = conn.getresponse()
check(r.status == 200, f"stream answered {r.status}")
while not r.readline().startswith(b"data: "):
    pass
conn.sock.close()
conn.close()
wait_for(lambda: metrics()["loom_requests_cancelled_total"] > before["loom_requests_cancelled_total"],
         "the disconnected stream's request to be cancelled")
wait_for(lambda: (lambda m: m["loom_cache_blocks_free"] == m["loom_cache_blocks_total"] and
                  m["loom_running_requests"] == 0)(metrics()), "the cache blocks to come back")
status, doc = complete({"prompt": prompts[1], "max_tokens": max_new})
check(status == 200 and doc["choices"][0]["tokens"] == expected[1], "the server answers after the disconnect")
m = metrics()
for name in ("loom_requests_submitted_total", "loom_requests_finished_total", "loom_requests_refused_total",
             "loom_queue_length", "loom_tokens_per_second", 'loom_time_to_first_token_seconds{quantile="0.99"}',
             'loom_inter_token_latency_seconds{quantile="0.5"}', "loom_generated_tokens_total"):
    check(name in m, f"/metrics has no {name}")
print(f"disconnect: the stream's request was cancelled, {int(m['loom_cache_blocks_free'])} of "
      f"{int(m['loom_cache_blocks_total'])} blocks free; /metrics parses")
q50, q99 = '{quantile="0.5"}', '{quantile="0.99"}'
ttft, itl = "loom_time_to_first_token_seconds", "loom_inter_token_latency_seconds"
print(f"metrics: time to first token p50 {m[ttft + q50] * 1e3:.2f} ms, p99 {m[ttft + q99] * 1e3:.2f} ms; "
      f"per token p50 {m[itl + q50] * 1e3:.2f} ms, p99 {m[itl + q99] * 1e3:.2f} ms")

# SIGTERM while a stream is in flight: it finishes, then the server exits 0.
result = {}


def sigterm():
    server.send_signal(signal.SIGTERM)


def in_flight():
    result["answer"] = stream({"prompt": [7], "max_tokens": 1000}, on_first=sigterm)


t = threading.Thread(target=in_flight, daemon=True)
t.start()
t.join(max(0.0, DEADLINE - time.monotonic()))
check("answer" in result, "the in-flight stream did not end")
status, tokens, finish, _ = result["answer"]
check(status == 200 and finish == "length" and len(tokens) == max_seq - 1,
      f"in-flight request after SIGTERM: {status} {finish} {tokens and len(tokens)} tokens")
try:
    rc = server.wait(timeout=10)
except subprocess.TimeoutExpired:
    fail("loom-serve did not exit within 10 s of SIGTERM")
check(rc == 0, f"loom-serve exited {rc} after SIGTERM")
print(f"sigterm: the in-flight request finished ({len(tokens)} tokens, {finish}); loom-serve exited 0")
print("PASS")

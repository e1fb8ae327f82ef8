"""Generation from a serving bundle: loom.Server's iterators yield loom-run's
greedy tokens, stream, run from several threads at once, cancel when closed
early, reproduce seeded sampling, decode text with the bundle's tokenizer, and
refuse bad input with the runtime's message."""

import gc
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import loom
from conftest import ROOT, _tool

PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [7, 9, 7, 9, 7, 9, 7, 9, 7, 9, 7], [100], [50, 60]]
MAX_NEW = 16  # as python/examples/generate.py generates
LONG = 500  # new tokens of a request that runs a while (text.serve has max_seq 512)


@pytest.fixture(scope="session")
def serve_bundles(tmp_path_factory) -> Path:
    """gpt.serve: gpt-tiny (vocabulary 256, max_seq 32, batch 3); text.serve: a
    GPT of vocabulary 576, max_seq 512, with test/tokenizer's byte-level BPE."""
    loomc = _tool("loomc")
    if not loomc.name:
        pytest.skip("no loomc in LOOM_BUILD_DIR")
    out = tmp_path_factory.mktemp("serve")
    quiet = {"check": True, "stdout": subprocess.DEVNULL}
    subprocess.run([str(loomc), "compile", str(ROOT / "models" / "gpt-tiny.mlir"), "--serve", "--max-batch", "3",
                    "--seed", "7", "-o", str(out / "gpt.serve")], **quiet)
    subprocess.run([str(loomc), "models", "gpt", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "512",
                    "--vocab", "576", "--ffn", "1024", "-o", str(out / "text.mlir")], **quiet)
    subprocess.run([str(loomc), "compile", str(out / "text.mlir"), "--serve", "--max-batch", "4", "--tokenizer",
                    str(ROOT / "test" / "tokenizer" / "bpe.tokenizer.json"), "-o", str(out / "text.serve")], **quiet)
    # spm.serve: a Llama with test/tokenizer's SentencePiece model (BOS first).
    subprocess.run([str(loomc), "models", "llama", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads",
                    "1", "--seq", "32", "--vocab", "512", "-o", str(out / "spm.mlir")], **quiet)
    subprocess.run([str(loomc), "compile", str(out / "spm.mlir"), "--serve", "--seed", "4", "--tokenizer",
                    str(ROOT / "test" / "tokenizer" / "spm.model"), "-o", str(out / "spm.serve")], **quiet)
    return out


@pytest.fixture(scope="module")
def server(serve_bundles):
    with loom.Server(serve_bundles / "gpt.serve", threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def loom_run_tokens(serve_bundles, loom_run, tmp_path_factory) -> list[list[int]]:
    """loom-run --generate's greedy tokens for PROMPTS."""
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    prompts.write_text("".join(" ".join(map(str, p)) + "\n" for p in PROMPTS))
    text = subprocess.run([str(loom_run), str(serve_bundles / "gpt.serve"), "--prompt", str(prompts), "--max-new",
                           str(MAX_NEW), "--threads", "1"], check=True, capture_output=True, text=True).stdout
    found = {int(i): [int(t) for t in tokens.split()]
             for i, tokens in re.findall(r"^request (\d+): \d+ prompt \+ \d+ new tokens \(\w+\):(.*)$", text, re.M)}
    assert sorted(found) == list(range(len(PROMPTS))), text
    return [found[i] for i in range(len(PROMPTS))]


def test_greedy_tokens_equal_loom_run(server, loom_run_tokens):
    for prompt, expected in zip(PROMPTS, loom_run_tokens):
        with server.generate(prompt, max_new_tokens=MAX_NEW) as g:
            assert list(g) == expected
            assert g.finish_reason == "length" and g.tokens == expected and g.prompt == prompt
    # A NumPy array of any integer dtype is a prompt too.
    assert list(server.generate(np.array(PROMPTS[1], np.int64), max_new_tokens=MAX_NEW)) == loom_run_tokens[1]


def test_several_threads_at_once(server, loom_run_tokens):
    """Each thread iterates its own requests while the others run; every
    request gets exactly loom-run's tokens."""
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(first: int) -> None:
        try:
            for i in range(first, len(PROMPTS) * 2, 4):
                results[i] = list(server.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=MAX_NEW))
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert {i: results[i] for i in sorted(results)} == {
        i: loom_run_tokens[i % len(PROMPTS)] for i in range(len(PROMPTS) * 2)}


def test_tokens_stream_and_early_close_cancels(serve_bundles):
    """The first token arrives while the request still runs; closing the
    iterator then cancels it, and so does dropping it; the cache comes back
    and the server goes on. (A request takes about 0.1 s; one that finished
    before the test looked, on a busy machine, is tried again.)"""
    with loom.Server(serve_bundles / "text.serve", threads=1) as s:
        total = s.stats()["total_blocks"]
        for _ in range(5):
            g = s.generate([1], max_new_tokens=LONG)
            first = next(g)
            streamed = g.finish_reason is None  # yielded before the last token was made
            g.close()
            rest = list(g)  # what was produced before the cancel took effect
            if streamed and g.finish_reason == "cancelled":
                break
        else:
            pytest.fail(f"no request was still running at its first token: {g.finish_reason}")
        assert g.tokens == [first, *rest] and len(g.tokens) < LONG
        for _ in range(5):
            before = s.stats()["cancelled"]
            g2 = s.generate([2], max_new_tokens=LONG)
            del g2
            gc.collect()
            assert _wait(lambda: _settled(s.stats(), total)), s.stats()
            if s.stats()["cancelled"] == before + 1:
                break
        else:
            pytest.fail(f"dropping an unfinished generation did not cancel it: {s.stats()}")
        assert len(list(s.generate([1], max_new_tokens=5))) == 5  # still serving


def _settled(stats: dict[str, int], total_blocks: int) -> bool:
    """No request left, and every cache block back."""
    return (stats["finished"] + stats["cancelled"] == stats["submitted"]
            and stats["free_blocks"] == total_blocks)


def _wait(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_seeded_sampling_reproduces(server):
    args = dict(max_new_tokens=20, temperature=1.5, top_k=50, top_p=0.95, repetition_penalty=1.1)
    a = list(server.generate([3, 1, 4], seed=11, **args))
    b = list(server.generate([3, 1, 4], seed=11, **args))
    c = list(server.generate([3, 1, 4], seed=12, **args))
    assert a == b and len(a) == 20
    assert a != c


def test_stop_tokens(server, loom_run_tokens):
    expected = loom_run_tokens[0]
    stop = expected[2]
    with server.generate(PROMPTS[0], max_new_tokens=MAX_NEW, stop_tokens=[stop]) as g:
        tokens = list(g)
    assert tokens == expected[:expected.index(stop) + 1] and g.finish_reason == "stop"


def test_text_prompts_and_streamed_text(serve_bundles):
    with loom.Server(serve_bundles / "text.serve", threads=1) as s:
        tok = s.tokenizer
        assert tok is not None and tok.vocab_size == 571 and tok.eos_id == 0
        ids = tok.encode("hello world")
        assert tok.decode(ids) == "hello world"
        g = s.generate("hello world", max_new_tokens=12, temperature=1.0, seed=5)
        assert g.prompt == ids
        pieces = list(g.text())
        assert "".join(pieces) == tok.decode(g.tokens) and g.finish_reason in ("length", "stop")
        # The same ids as a list give the same tokens (seeded); the text
        # prompt also stopped at <|endoftext|> (id 0), which ids do not.
        same = list(s.generate(ids, max_new_tokens=12, temperature=1.0, seed=5, stop_tokens=[0]))
        assert same == g.tokens
    assert loom.Tokenizer(serve_bundles / "text.serve").encode("hello world") == ids


def test_text_prompts_as_loom_run(serve_bundles, loom_run):
    """A text prompt gives loom-run --prompt-text's ids, tokens and text: BOS
    first for a SentencePiece model, none for GPT-2's BPE."""
    for bundle, bos in (("text.serve", False), ("spm.serve", True)):
        out = subprocess.run([str(loom_run), str(serve_bundles / bundle), "--prompt-text", "hello world",
                              "--max-new", "6", "--ignore-eos", "--threads", "1"],
                             check=True, capture_output=True, text=True).stdout
        counts, tokens = re.search(r"^request 0: (\d+) prompt \+ \d+ new tokens \(\w+\):(.*)$", out, re.M).groups()
        text = json.loads(re.search(r"^request 0 text: (.*)$", out, re.M).group(1))
        with loom.Server(serve_bundles / bundle, threads=1) as s:
            tok = s.tokenizer
            assert tok.prepends_bos == bos
            g = s.generate("hello world", max_new_tokens=6, ignore_eos=True)
            assert "".join(g.text()) == text
            assert g.tokens == [int(t) for t in tokens.split()]
            assert g.prompt == ([tok.bos_id] if bos else []) + tok.encode("hello world")
            assert len(g.prompt) == int(counts)


def test_bad_input_raises_the_runtimes_message(server, bundles, serve_bundles):
    with pytest.raises(loom.LoomError, match=r"this bundle does not serve \(mode 'infer'\)") as e:
        loom.Server(bundles / "gpt-tiny-infer.loom", threads=1)
    assert e.value.code == "invalid_argument"
    with pytest.raises(loom.LoomError, match=r"prompt token 2 is 300, outside the vocabulary \[0, 256\)") as e:
        server.generate([1, 2, 300])
    assert e.value.code == "invalid_argument"
    with pytest.raises(loom.LoomError, match="the prompt has 40 tokens; this bundle serves sequences of at most 32"):
        server.generate([1] * 40)
    with pytest.raises(loom.LoomError, match="the prompt is empty"):
        server.generate([])
    with pytest.raises(loom.LoomError, match="stop token 999 is outside"):
        server.generate([1], stop_tokens=[999])
    with pytest.raises(loom.LoomError, match="top_p"):
        server.generate([1], top_p=0)
    with pytest.raises(loom.LoomError, match="no token id"):
        server.generate([1, 2**40])
    with pytest.raises(loom.LoomError, match="this bundle has no tokenizer"):
        server.generate("hello")
    with server.generate([1]) as g, pytest.raises(loom.LoomError, match="this bundle has no tokenizer"):
        g.text()
    with pytest.raises(TypeError, match="prompt must be token ids"):
        server.generate([1.5, 2.0])
    with pytest.raises(TypeError, match="prompt must be token ids"):
        server.generate([[1, 2], [3, 4]])
    with pytest.raises(loom.LoomError, match="carries no tokenizer"):
        loom.Tokenizer(serve_bundles / "gpt.serve")
    assert server.stats()["refused"] >= 5
    assert list(server.generate([1, 2], max_new_tokens=3)) == list(server.generate([1, 2], max_new_tokens=3))


def test_closed_server(serve_bundles):
    s = loom.Server(serve_bundles / "text.serve", threads=1)
    g = s.generate([1], max_new_tokens=LONG)
    tok = s.tokenizer
    assert tok is not None
    s.close()
    s.close()  # harmless
    assert s.closed and "closed" in repr(s)
    list(g)
    assert g.finish_reason in ("cancelled", "length")
    for call in (lambda: s.generate([1]), s.stats, s.drain, lambda: tok.decode([1])):
        with pytest.raises(loom.LoomError, match="the server is closed"):
            call()


def test_generate_example(serve_bundles, loom_run_tokens):
    """python/examples/generate.py streams loom-run's tokens, from one thread
    and from several."""
    example = ROOT / "python" / "examples" / "generate.py"
    bundle = str(serve_bundles / "gpt.serve")
    out = subprocess.run([sys.executable, str(example), bundle, *map(str, PROMPTS[0])],
                         check=True, capture_output=True, text=True).stdout
    assert [int(t) for t in re.findall(r"^token (\d+)$", out, re.M)] == loom_run_tokens[0]
    out = subprocess.run([sys.executable, str(example), bundle, *map(str, PROMPTS[0]), "--", *map(str, PROMPTS[1])],
                         check=True, capture_output=True, text=True).stdout
    for i in (0, 1):
        assert [int(t) for t in re.findall(rf"^\[{i}\] token (\d+)$", out, re.M)] == loom_run_tokens[i], out
        assert f"[{i}] finished: length, {MAX_NEW} tokens" in out

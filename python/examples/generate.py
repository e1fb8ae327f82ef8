"""Generation from a serving bundle, printed token by token as it is produced.

    loomc compile models/gpt-tiny.mlir --serve --max-batch 4 -o gpt.serve
    python generate.py gpt.serve 1 2 3                # a prompt of token ids
    python generate.py llama.serve "Once upon a time" # text (a bundle with a tokenizer)

Several prompts separated by "--" run at once, each from its own thread,
batched together by the server: python generate.py gpt.serve 1 2 -- 7 8 9
"""

import sys
import threading

import loom

_print = threading.Lock()  # one thread's line at a time


def say(line: str) -> None:
    """Prints a line whole, even while other threads print theirs."""
    with _print:
        print(line, flush=True)


def stream(server: loom.Server, prompt: list[str], label: str) -> None:
    """Prints one generation as it arrives: text where the prompt is text, else ids."""
    if all(word.isdigit() for word in prompt):
        with server.generate([int(word) for word in prompt], max_new_tokens=16) as g:
            for token in g:
                say(f"{label}token {token}")
    else:
        with server.generate(" ".join(prompt), max_new_tokens=64, temperature=0.8, top_p=0.95, seed=1) as g:
            if label:  # several prompts at once: each text whole, when it ends
                say(label + "".join(g.text()))
            else:
                for piece in g.text():
                    print(piece, end="", flush=True)
                print()
    say(f"{label}finished: {g.finish_reason}, {len(g.tokens)} tokens")


def main() -> None:
    bundle, args = sys.argv[1], sys.argv[2:]
    prompts: list[list[str]] = [[]]
    for word in args:
        if word == "--":
            prompts.append([])
        else:
            prompts[-1].append(word)
    with loom.Server(bundle) as server:
        if len(prompts) == 1:
            stream(server, prompts[0], "")
            return
        threads = [threading.Thread(target=stream, args=(server, p, f"[{i}] ")) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


if __name__ == "__main__":
    main()

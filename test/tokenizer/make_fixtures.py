#!/usr/bin/env python3
"""Writes the tokenizer fixtures that TokenizerTest checks Loom against:
a small byte-level BPE (GPT-2's pre-tokenizer and decoder) trained with the
tokenizers library, a small SentencePiece model, and cases.json with each
reference tokenizer's ids and decoded text for every case.

Needs `pip install tokenizers sentencepiece`; CI does not run it (the files it
writes are committed)."""
import json
import os
import sys

import sentencepiece as spm
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

here = os.path.dirname(os.path.abspath(__file__))

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a dog's life, isn't it?",
    "Loom compiles neural networks: GPT-2 and Llama checkpoints import with their tokenizers.",
    "Numbers like 12345, 3.14159 and 2026-11-27 appear in text; so do emails like a@b.cd.",
    "Tabs\tand\nnewlines\n\n  and   runs of spaces   matter to a byte-level tokenizer.",
    "Unicode: naïve café, Straße, 日本語のテキスト, Ελληνικά, русский текст, emoji 🎉🚀.",
    "Contractions: I'm, you're, we've, they'll, he'd, she's, don't, WON'T.",
    "def forward(self, x):\n    return self.proj(x) + x  # residual\n",
] * 20

CASES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing spaces   ",
    "tabs\tand\nnewlines\n\nhere",
    "I'm sure they'll say it's fine, we've seen THEY'RE wrong",
    "numbers 1234567 and 3.14 and ½ ² ٣",
    "naïve café Straße",
    "日本語のテキスト",
    "emoji 🎉🚀 mixed with text",
    "Ελληνικά and русский",
    "code: x = f(y) + 2*z; // done",
    "<|endoftext|>after a special token<|endoftext|>",
    "unseen words: zyzzyva quixotic xylophone",
    "",
    " ",
    "a  b   c",
    "'' 's 'S",
]


def bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path = os.path.join(here, "bpe.tokenizer.json")
    tok.save(path)
    tok = Tokenizer.from_file(path)
    return [{"ids": tok.encode(t).ids,
             "decoded": tok.decode(tok.encode(t).ids, skip_special_tokens=False)} for t in CASES]


def sentencepiece():
    corpus = os.path.join(here, "spm-corpus.txt.tmp")
    with open(corpus, "w") as f:
        f.write("\n".join(CORPUS) + "\n")
    prefix = os.path.join(here, "spm")
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=500,
                                   model_type="bpe", byte_fallback=True,
                                   character_coverage=0.9995, minloglevel=2,
                                   # as Llama: no normalisation, spaces kept
                                   normalization_rule_name="identity",
                                   remove_extra_whitespaces=False)
    os.remove(corpus)
    os.remove(prefix + ".vocab")
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    return [{"ids": sp.encode(t), "decoded": sp.decode(sp.encode(t))} for t in CASES]


def main():
    cases = {"texts": CASES, "bpe": bpe(), "spm": sentencepiece()}
    with open(os.path.join(here, "cases.json"), "w") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())

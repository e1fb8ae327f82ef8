//===- TokenizerImpl.h - Tokenizers behind Tokenizer::load -------*- C++ -*-===//
#ifndef LOOM_RUNTIME_TOKENIZERIMPL_H
#define LOOM_RUNTIME_TOKENIZERIMPL_H

#include "loom/rt/Tokenizer.h"

#include <vector>

namespace loom::rt {

/// GPT-2's byte-level BPE from the bytes of a tokenizers tokenizer.json
/// (BpeTokenizer.cpp); `path` names it in errors.
std::unique_ptr<Tokenizer> parseBpeTokenizer(const std::vector<char> &bytes, const std::string &path);

} // namespace loom::rt

#endif

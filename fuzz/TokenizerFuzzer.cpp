//===- TokenizerFuzzer.cpp - Fuzz the tokenizer.json reader and BPE --------===//
//
// The input is a tokenizer.json; one that loads encodes texts that reach
// every branch of the pre-tokenizer (contractions, letters, numbers, symbols,
// runs of spaces, added tokens, bytes that are not UTF-8) and decodes every
// id, whole and one at a time.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Error.h"
#include "runtime/src/TokenizerImpl.h"

#include <cstdint>

using namespace loom::rt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  try {
    auto tok = parseBpeTokenizer(std::vector<char>(data, data + size), "fuzz.json");
    for (const char *text : {"Hello world, it's 2026!", "  \t\n  x  ", "<|endoftext|>a<|endoftext|>",
                             "\xff\xfe caf\xc3\xa9 \xe6\x97\xa5\xf0\x9f\x8e", ""}) {
      std::vector<int32_t> ids = tok->encode(text);
      tok->decode(ids);
    }
    std::vector<int32_t> all;
    for (int32_t id = -1; id <= tok->vocabSize() && id < 4096; ++id)
      all.push_back(id);
    tok->decode(all);
    Tokenizer::StreamDecoder stream(*tok);
    for (int32_t id : all)
      stream.push(id);
    stream.finish();
  } catch (const Error &) {
  }
  return 0;
}

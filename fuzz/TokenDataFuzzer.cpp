//===- TokenDataFuzzer.cpp - Fuzz the token file reader -------------------===//
//
// The first 5 bytes choose what loom-run would take from its options and the
// bundle (id width, batch, sequence length, vocabulary); the rest is the
// token file. Accepted data is then cut into the windows of a few steps,
// the first and one far along.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Error.h"
#include "runtime/src/TokenData.h"

#include <cstdint>

using namespace loom::rt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 5)
    return 0;
  std::string dtype = data[0] & 1 ? "uint32" : "uint16";
  int64_t batch = data[1] % 8 + 1, seq = data[2] % 64 + 1;
  int64_t vocab = (int64_t(data[3]) << 8 | data[4]) % 1024; // 0: unchecked
  try {
    TokenData tokens(std::vector<char>(data + 5, data + size), "fuzz.bin", dtype, batch, seq, vocab);
    std::vector<int32_t> in(batch * seq), target(batch * seq);
    for (int64_t step : {int64_t(1), int64_t(2), int64_t(3), int64_t(INT32_MAX)})
      tokens.fill(step, in, target);
  } catch (const Error &) {
  }
  return 0;
}

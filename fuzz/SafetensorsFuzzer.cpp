//===- SafetensorsFuzzer.cpp - Fuzz the safetensors reader ----------------===//
//
// The bytes are a whole .safetensors file. What the reader accepts is read
// back in full, tensor by tensor, so an offset or size it let through that
// points outside the data is an AddressSanitizer report.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"

#include <cstdint>

using namespace loom::rt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  try {
    SafetensorsFile file = parseSafetensors(std::vector<char>(data, data + size), "fuzz.safetensors");
    uint64_t h = 0;
    for (const auto &[name, entry] : file.tensors)
      h = fnv1a64(file.bytesOf(name), entry.bytes, h);
    volatile uint64_t sink = h;
    (void)sink;
  } catch (const Error &) {
  }
  return 0;
}

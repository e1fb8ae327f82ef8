//===- ManifestFuzzer.cpp - Fuzz the bundle manifest reader ---------------===//
//
// The bytes are a manifest.json: parsed, validated (parseManifest) and, for
// every rank whose arena is small enough to allocate here, checked the way a
// session prepares its programs (CpuProgram, validating only). Errors are
// loom::rt::Error; anything else that escapes, and any sanitizer report, is a
// finding.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Bundle.h"
#include "loom/rt/Error.h"
#include "runtime/src/ThreadPool.h"
#include "runtime/src/cpu/CpuBackend.h"

#include <cstdint>
#include <cstdlib>
#include <memory>

using namespace loom::rt;

/// Larger arenas are valid but would only measure this machine's memory.
constexpr int64_t kMaxFuzzArena = int64_t(64) << 20;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  nlohmann::json doc = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded())
    return 0;
  static ThreadPool pool(1);
  try {
    Manifest m = parseManifest(doc, "fuzz/manifest.json");
    for (const RankProgram &r : m.ranks) {
      if (r.arenaBytes > kMaxFuzzArena)
        continue;
      std::unique_ptr<char, decltype(&std::free)> arena(
          static_cast<char *>(std::calloc(1, std::max<int64_t>(r.arenaBytes, 64))), &std::free);
      for (const auto &[name, instrs] : r.programs)
        CpuProgram(r, instrs, arena.get(), pool, name, /*allocate=*/false);
    }
  } catch (const Error &) {
  }
  return 0;
}

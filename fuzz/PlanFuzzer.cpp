//===- PlanFuzzer.cpp - Fuzz the plan file reader -------------------------===//
//
// The bytes are a plan file given to `loomc compile --plan`. The reader
// reports problems through its error string; an exception that escapes it,
// or a sanitizer report, is a finding. An accepted plan is read the way
// compile reads it: the degrees, the schedule, and the chunks' layer units.
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/PlanFile.h"

#include <cstdint>

using namespace loom::planner;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  nlohmann::json plan;
  std::string error;
  if (!parsePlanFile(std::string(reinterpret_cast<const char *>(data), size), "fuzz.json", plan,
                     error))
    return 0;
  for (const char *key : {"devices", "batch", "dp", "tp", "pp", "vpp", "microbatches", "zero"})
    (void)plan.value(key, int64_t(1));
  (void)plan.value("schedule", std::string("1f1b"));
  (void)plan.value("recompute", std::string("none"));
  (void)planChunkUnits(plan);
  return 0;
}

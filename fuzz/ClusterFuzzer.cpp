//===- ClusterFuzzer.cpp - Fuzz the cluster file reader -------------------===//
//
// The bytes are a --cluster JSON file. The reader reports problems through
// its error string; an exception that escapes it, or a sanitizer report, is
// a finding. An accepted cluster is used as the planner would use it.
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/Cluster.h"

#include <cstdint>

using namespace loom::planner;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  Cluster cluster;
  std::string error;
  if (!parseClusterJson(std::string(reinterpret_cast<const char *>(data), size), "fuzz.json",
                        cluster, error))
    return 0;
  volatile double sink = double(cluster.numDevices()) + cluster.peakFlops("bf16");
  (void)sink;
  (void)cluster.describe();
  return 0;
}

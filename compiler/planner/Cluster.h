//===- Cluster.h - The machines a model is planned for ----------*- C++ -*-===//
//
// Plain C++ (no MLIR): the planner's view of a cluster, read from a preset
// such as "h100:8x4" or from a JSON file with the schema of
// models/clusters.json (documented in docs/clusters.md).
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_CLUSTER_H
#define LOOM_COMPILER_PLANNER_CLUSTER_H

#include <cstdint>
#include <map>
#include <string>

namespace loom::planner {

struct DeviceSpec {
  std::string name;
  std::string description;
  std::map<std::string, double> peakFlops; // per dtype, FLOP/s
  double memoryBytes = 0;
  double memoryBandwidth = 0;    // bytes/s
  double intraNodeBandwidth = 0; // bytes/s per device, one direction
  double intraNodeLatency = 0;   // s
  double interNodeBandwidth = 0;
  double interNodeLatency = 0;
};

struct Cluster {
  DeviceSpec device;
  int64_t devicesPerNode = 0;
  int64_t nodes = 0;

  int64_t numDevices() const { return devicesPerNode * nodes; }
  /// Peak FLOP/s for a dtype, falling back to f32 when the dtype is not listed.
  double peakFlops(const std::string &dtype) const;
  std::string describe() const;
};

/// Parses `spec`: a preset `NAME:N` (N devices on one node, or spread over
/// nodes of the preset's size when N is larger), `NAME:GxK` (K nodes of G),
/// or the path of a JSON cluster file. Returns false with a message naming
/// the fault and the fix.
bool parseCluster(const std::string &spec, Cluster &out, std::string &error);
/// Parses the text of a JSON cluster file; `where` names it in the error.
bool parseClusterJson(const std::string &text, const std::string &where, Cluster &out,
                      std::string &error);

/// The names of the built-in device presets, comma separated.
std::string presetNames();

} // namespace loom::planner

#endif

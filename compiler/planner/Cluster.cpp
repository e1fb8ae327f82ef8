//===- Cluster.cpp - The machines a model is planned for ------------------===//

#include "compiler/planner/Cluster.h"
#include "compiler/planner/ClusterPresets.inc"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

using json = nlohmann::json;

namespace loom::planner {
namespace {

bool readNumber(const json &obj, const char *key, double &out, std::string &error,
                const std::string &where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_number()) {
    error = where + ": field '" + key + "' is missing or not a number";
    return false;
  }
  out = it->get<double>();
  if (out <= 0) {
    error = where + ": field '" + key + "' must be positive";
    return false;
  }
  return true;
}

/// The most devices per node, and nodes, a cluster may have: what the nine
/// digits of a preset's NAME:GxK allow, so G x K fits in int64.
constexpr int64_t kMaxCount = 999999999;

/// A count of devices or nodes: a whole number from 1 to kMaxCount.
bool readCount(const json &obj, const char *key, int64_t &out, std::string &error,
               const std::string &where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_number() || it->get<double>() < 1 ||
      it->get<double>() > double(kMaxCount) || it->get<double>() != std::floor(it->get<double>())) {
    error = where + ": field '" + key + "' must be a whole number from 1 to " +
            std::to_string(kMaxCount) + ", got " + (it == obj.end() ? "nothing" : it->dump());
    return false;
  }
  out = static_cast<int64_t>(it->get<double>());
  return true;
}

/// An optional string field, `fallback` where it is absent.
bool readString(const json &obj, const char *key, const char *fallback, std::string &out,
                std::string &error, const std::string &where) {
  auto it = obj.find(key);
  if (it != obj.end() && !it->is_string()) {
    error = where + ": field '" + key + "' must be a string";
    return false;
  }
  out = it == obj.end() ? fallback : it->get<std::string>();
  return true;
}

bool readDevice(const std::string &name, const json &obj, DeviceSpec &dev, int64_t &perNode,
                std::string &error, const std::string &where) {
  if (!obj.is_object()) {
    error = where + ": device '" + name + "' must be an object";
    return false;
  }
  dev.name = name;
  if (!readString(obj, "description", "", dev.description, error, where))
    return false;
  auto flops = obj.find("peak_flops");
  if (flops == obj.end() || !flops->is_object() || flops->empty()) {
    error = where + ": device '" + name + "' needs 'peak_flops' per dtype, e.g. {\"bf16\": 9.89e14}";
    return false;
  }
  for (auto &[dtype, value] : flops->items()) {
    if (!value.is_number() || value.get<double>() <= 0) {
      error = where + ": peak_flops." + dtype + " must be a positive number";
      return false;
    }
    dev.peakFlops[dtype] = value.get<double>();
  }
  return readNumber(obj, "memory_bytes", dev.memoryBytes, error, where) &&
         readNumber(obj, "memory_bandwidth", dev.memoryBandwidth, error, where) &&
         readNumber(obj, "intra_node_bandwidth", dev.intraNodeBandwidth, error, where) &&
         readNumber(obj, "intra_node_latency", dev.intraNodeLatency, error, where) &&
         readNumber(obj, "inter_node_bandwidth", dev.interNodeBandwidth, error, where) &&
         readNumber(obj, "inter_node_latency", dev.interNodeLatency, error, where) &&
         readCount(obj, "gpus_per_node", perNode, error, where);
}

const json &presets() {
  static const json parsed = json::parse(kClusterPresetsJson);
  return parsed;
}

bool parsePositive(const std::string &text, int64_t &out) {
  if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos)
    return false;
  out = std::stoll(text);
  return out > 0;
}

} // namespace

double Cluster::peakFlops(const std::string &dtype) const {
  auto it = device.peakFlops.find(dtype);
  if (it != device.peakFlops.end())
    return it->second;
  it = device.peakFlops.find("f32");
  return it != device.peakFlops.end() ? it->second : device.peakFlops.begin()->second;
}

std::string Cluster::describe() const {
  std::ostringstream os;
  os << numDevices() << " x " << device.name;
  if (nodes > 1)
    os << " (" << nodes << " nodes of " << devicesPerNode << ")";
  return os.str();
}

std::string presetNames() {
  std::string names;
  for (auto &[name, _] : presets()["devices"].items())
    names += (names.empty() ? "" : ", ") + name;
  return names;
}

bool parseClusterJson(const std::string &text, const std::string &where, Cluster &out,
                      std::string &error) {
  // {"device": {...} or "preset name", "devices_per_node": G, "nodes": K}.
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    error = where + ": not valid JSON (expected an object with 'device', 'devices_per_node', 'nodes')";
    return false;
  }
  auto dev = doc.find("device");
  if (dev == doc.end()) {
    error = where + ": field 'device' is missing (a preset name or a device object)";
    return false;
  }
  int64_t perNodeDefault = 0;
  if (dev->is_string()) {
    auto &devices = presets()["devices"];
    if (!devices.contains(dev->get<std::string>())) {
      error = where + ": unknown device '" + dev->get<std::string>() + "'; presets are " +
              presetNames();
      return false;
    }
    if (!readDevice(dev->get<std::string>(), devices[dev->get<std::string>()], out.device,
                    perNodeDefault, error, "built-in presets"))
      return false;
  } else {
    std::string name;
    if (!readString(doc, "name", "custom", name, error, where) ||
        !readDevice(name, *dev, out.device, perNodeDefault, error, where))
      return false;
  }
  return readCount(doc, "devices_per_node", out.devicesPerNode, error, where) &&
         readCount(doc, "nodes", out.nodes, error, where);
}

bool parseCluster(const std::string &spec, Cluster &out, std::string &error) {
  size_t colon = spec.find(':');
  if (colon == std::string::npos) {
    // A JSON file.
    std::error_code ec;
    if (std::filesystem::is_directory(spec, ec)) {
      error = "cluster '" + spec + "' is a directory, not a preset or a JSON file";
      return false;
    }
    std::ifstream in(spec);
    if (!in) {
      error = "cluster '" + spec + "' is neither a preset (NAME:N or NAME:GxK with NAME one of " +
              presetNames() + ") nor a readable JSON file";
      return false;
    }
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return parseClusterJson(text, spec, out, error);
  }

  std::string name = spec.substr(0, colon), count = spec.substr(colon + 1);
  auto &devices = presets()["devices"];
  if (!devices.contains(name)) {
    error = "unknown device '" + name + "' in cluster '" + spec + "'; presets are " +
            presetNames();
    return false;
  }
  int64_t perNodeMax = 0;
  if (!readDevice(name, devices[name], out.device, perNodeMax, error, "built-in presets"))
    return false;
  size_t x = count.find('x');
  int64_t perNode = 0, nodes = 1;
  if (x != std::string::npos) {
    if (!parsePositive(count.substr(0, x), perNode) || !parsePositive(count.substr(x + 1), nodes)) {
      error = "cluster '" + spec + "': expected NAME:GxK with G devices per node and K nodes, "
              "both positive integers";
      return false;
    }
    if (perNode > perNodeMax) {
      error = "cluster '" + spec + "': a " + name + " node holds at most " +
              std::to_string(perNodeMax) + " devices";
      return false;
    }
  } else {
    int64_t total = 0;
    if (!parsePositive(count, total)) {
      error = "cluster '" + spec + "': expected NAME:N with N a positive number of devices "
              "(or NAME:GxK)";
      return false;
    }
    perNode = std::min(total, perNodeMax);
    if (total % perNode != 0) {
      error = "cluster '" + spec + "': " + std::to_string(total) + " devices do not fill nodes of " +
              std::to_string(perNodeMax) + "; write NAME:GxK";
      return false;
    }
    nodes = total / perNode;
  }
  out.devicesPerNode = perNode;
  out.nodes = nodes;
  return true;
}

} // namespace loom::planner

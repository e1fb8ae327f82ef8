//===- ServePlanner.cpp - How far to split a decoder for serving ----------===//

#include "compiler/planner/ServePlanner.h"

#include "compiler/planner/CostModel.h"

#include <cstdio>
#include <sstream>

namespace loom::planner {

ServePlan planServing(const ModelSpec &spec, const Cluster &cluster, int64_t maxBatch, int64_t maxSeq,
                      const std::string &objective, const CostOptions &options) {
  ServePlan plan;
  plan.objective = objective;
  if (objective != "latency" && objective != "throughput") {
    plan.error = "--objective must be latency or throughput, got '" + objective + "'";
    return plan;
  }
  if (maxBatch < 1 || maxSeq < 1) {
    plan.error = "serving needs --max-batch and --max-seq of at least 1";
    return plan;
  }
  const DeviceSpec &dev = cluster.device;
  Link link{dev.intraNodeBandwidth * options.linkEfficiency, dev.intraNodeLatency};
  double memRate = dev.memoryBandwidth * options.memoryEfficiency;
  for (int64_t t = 1; t <= 8 && t <= cluster.devicesPerNode; t *= 2) {
    if (cluster.numDevices() % t)
      continue;
    ServeCandidate c;
    c.tp = t;
    double weights = 0, cachePerToken = 0, launches = 0, allReduces = 0, hidden = 0;
    for (const LayerSpec &l : spec.layers) {
      if (t > 1 && l.tpAllReduces > 0 && l.tpDivisor % t) {
        c.why = "tp " + std::to_string(t) + " does not divide layer '" + l.name + "' (" +
                std::to_string(l.tpDivisor) + " heads)";
        break;
      }
      // bf16 weights, the split part over t.
      weights += 2.0 * (l.params - l.shardedParams + l.shardedParams / double(t));
      if (l.isTransformer) // a key and a value row per token (the key/value heads' width), bf16, split by heads
        cachePerToken += 2.0 * 2.0 * (l.kvWidth > 0 ? l.kvWidth : l.hidden) / double(t);
      launches += l.instructions;
      if (t > 1)
        allReduces += l.tpAllReduces;
      hidden = std::max(hidden, l.hidden);
    }
    if (!c.why.empty()) {
      plan.candidates.push_back(c);
      continue;
    }
    double cache = cachePerToken * double(maxBatch) * double(maxSeq);
    c.memoryBytes = weights + cache;
    double usable = dev.memoryBytes - options.runtimeBytes - (t > 1 ? options.communicatorBytes : 0.0);
    if (c.memoryBytes > usable) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "needs %.1f GiB a GPU (weights %.1f, cache %.1f); a %s has %.1f", c.memoryBytes / 1073741824.0,
                    weights / 1073741824.0, cache / 1073741824.0, dev.name.c_str(), usable / 1073741824.0);
      c.why = buf;
      plan.candidates.push_back(c);
      continue;
    }
    c.fits = true;
    c.launches = launches;
    // A step at batch b: the weights once, the cached rows of b sequences
    // at half their length on average, the launches, and each all-reduce of
    // b rows of the hidden width in bf16 (its measured cost in a graph and
    // a ring's bytes over the link).
    auto step = [&](double b) {
      double reads = weights + cachePerToken * b * double(maxSeq) / 2;
      double bytes = 2.0 * b * hidden;
      double comm = t > 1 ? allReduces * (kGraphAllReduceSeconds + 2.0 * (t - 1) / t * bytes / link.bandwidth) : 0;
      return reads / memRate + launches * kGraphLaunchSeconds + comm;
    };
    c.latencySeconds = step(1);
    c.batchStepSeconds = step(double(maxBatch));
    c.tokensPerSecondPerGpu = double(maxBatch) / c.batchStepSeconds / double(t);
    plan.candidates.push_back(c);
  }
  const ServeCandidate *best = nullptr;
  for (const ServeCandidate &c : plan.candidates) {
    if (!c.fits)
      continue;
    if (!best || (objective == "latency" ? c.latencySeconds < best->latencySeconds
                                         : c.tokensPerSecondPerGpu > best->tokensPerSecondPerGpu))
      best = &c;
  }
  if (!best) {
    std::string why;
    for (const ServeCandidate &c : plan.candidates)
      why += "\n  tp " + std::to_string(c.tp) + ": " + c.why;
    plan.error = "no tensor-parallel degree of " + cluster.describe() + " serves this model:" + why;
    return plan;
  }
  plan.found = true;
  plan.tp = best->tp;
  return plan;
}

std::string describeServePlan(const ServePlan &plan, const Cluster &cluster) {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "serving plan (--objective %s): tp %lld", plan.objective.c_str(),
                (long long)plan.tp);
  os << line;
  if (cluster.numDevices() > plan.tp)
    os << ", " << cluster.numDevices() / plan.tp << " replicas (one loom-serve per "
       << (plan.tp == 1 ? std::string("GPU") : std::to_string(plan.tp) + " GPUs") << ")";
  os << "\n  tp  memory/GPU  step at batch 1  step at max batch  tokens/s per GPU\n";
  for (const ServeCandidate &c : plan.candidates) {
    if (!c.fits) {
      std::snprintf(line, sizeof line, "  %-3lld %s\n", (long long)c.tp, c.why.c_str());
    } else {
      std::snprintf(line, sizeof line, "  %-3lld %7.2f GiB  %12.3f ms  %14.3f ms  %16.0f%s\n", (long long)c.tp,
                    c.memoryBytes / 1073741824.0, c.latencySeconds * 1e3, c.batchStepSeconds * 1e3,
                    c.tokensPerSecondPerGpu, c.tp == plan.tp ? "  <- chosen" : "");
    }
    os << line;
  }
  os << "  (predicted: weights and cache read once a step at the device's memory bandwidth, "
        "measured per-launch costs, ring all-reduces of each layer's output)";
  return os.str();
}

} // namespace loom::planner

//===- PlanText.cpp - A plan as text and JSON; constraints and profiles --===//
//
// What the planner reads and writes as text: `--force` constraints, the
// plan's short name, its explanation and JSON form, and the calibration
// profile `loomc plan --profile` reads. The search and the cost model are
// Planner.cpp's.
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/PlanText.h"
#include "compiler/planner/Planner.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace loom::planner {

using json = nlohmann::json;

std::string gib(double bytes) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed << bytes / kGiB << " GiB";
  return os.str();
}

std::string ms(double seconds) {
  std::ostringstream os;
  os.precision(seconds < 0.01 ? 2 : 1);
  os << std::fixed << seconds * 1e3 << " ms";
  return os.str();
}

std::string StagePlan::layerRanges() const {
  std::string out;
  for (auto [first, count] : chunks)
    out += (out.empty() ? "" : ", ") + std::to_string(first) +
           (count > 1 ? "-" + std::to_string(first + count - 1) : "");
  return out;
}

std::string Plan::shortName() const {
  std::ostringstream os;
  os << "dp" << dp << " tp" << tp << " pp" << pp;
  if (schedule == Schedule::Interleaved)
    os << " vpp" << vpp;
  os << " mbs" << microbatchSize << " mb" << microbatches << " " << scheduleName(schedule)
     << " recompute=" << recomputeName(recompute) << " zero" << zero;
  if (sequenceParallel)
    os << " sp";
  return os.str();
}

bool parseConstraints(const std::string &text, Constraints &out, std::string &error) {
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty())
      continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos) {
      error = "--force item '" + item + "' is not key=value";
      return false;
    }
    std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    auto number = [&](std::optional<int64_t> &field) {
      if (value.empty() || value.size() > 9 ||
          value.find_first_not_of("0123456789") != std::string::npos || std::stoll(value) < 1) {
        error = "--force " + key + " needs a positive integer, got '" + value + "'";
        return false;
      }
      field = std::stoll(value);
      return true;
    };
    if (key == "dp" || key == "tp" || key == "pp" || key == "vpp" || key == "mb" ||
        key == "mbs") {
      std::optional<int64_t> &field = key == "dp"    ? out.dp
                                      : key == "tp"  ? out.tp
                                      : key == "pp"  ? out.pp
                                      : key == "vpp" ? out.vpp
                                      : key == "mb"  ? out.microbatches
                                                     : out.microbatchSize;
      if (!number(field))
        return false;
    } else if (key == "schedule") {
      Schedule s;
      if (!parseSchedule(value, s)) {
        error = std::string("--force schedule must be ") + scheduleChoices() + ", got '" + value + "'";
        return false;
      }
      out.schedule = s;
    } else if (key == "recompute") {
      Recompute r;
      if (!parseRecompute(value, r)) {
        error = "--force recompute must be none, selective or full, got '" + value + "'";
        return false;
      }
      out.recompute = r;
    } else if (key == "zero") {
      if (value != "0" && value != "1" && value != "2" && value != "3") {
        error = "--force zero must be 0, 1, 2 or 3 (the ZeRO stage), got '" + value + "'";
        return false;
      }
      out.zero = value[0] - '0';
    } else if (key == "sp") {
      if (value != "0" && value != "1") {
        error = "--force sp (sequence parallelism) must be 0 or 1, got '" + value + "'";
        return false;
      }
      out.sp = value == "1";
    } else {
      error = "--force has no key '" + key +
              "'; use dp, tp, pp, vpp, mb, mbs, schedule, recompute, zero or sp";
      return false;
    }
  }
  if (out.vpp && *out.vpp > 1 && !out.schedule)
    out.schedule = Schedule::Interleaved;
  return true;
}

std::string describeConstraints(const Constraints &c) {
  std::ostringstream os;
  auto put = [&](const char *k, const auto &v) {
    if (v)
      os << (os.tellp() ? "," : "") << k << "=" << *v;
  };
  put("dp", c.dp), put("tp", c.tp), put("pp", c.pp), put("vpp", c.vpp);
  put("mb", c.microbatches), put("mbs", c.microbatchSize);
  if (c.schedule)
    os << (os.tellp() ? "," : "") << "schedule=" << scheduleName(*c.schedule);
  if (c.recompute)
    os << (os.tellp() ? "," : "") << "recompute=" << recomputeName(*c.recompute);
  put("zero", c.zero);
  if (c.sp)
    os << (os.tellp() ? "," : "") << "sp=" << (*c.sp ? 1 : 0);
  return os.str();
}

json planToJson(const Plan &plan, const ModelSpec &model, const Cluster &cluster, int64_t batch) {
  auto msList = [](const std::vector<double> &seconds) {
    json out = json::array();
    for (double x : seconds)
      out.push_back(x * 1e3);
    return out;
  };
  json stages = json::array();
  for (size_t i = 0; i < plan.stages.size(); ++i) {
    const StagePlan &s = plan.stages[i];
    stages.push_back({{"stage", i},
                      {"first_layer", s.firstLayer},
                      {"num_layers", s.numLayers},
                      {"layer_chunks", s.chunks},
                      {"forward_ms", s.forwardTime * 1e3},
                      {"backward_ms", s.backwardTime * 1e3},
                      {"weight_grad_ms", s.weightGradTime * 1e3},
                      {"memory_gib", s.memoryBytes / kGiB},
                      {"weight_gib", s.weightBytes / kGiB},
                      {"activation_gib", s.activationBytes / kGiB}});
    if (!s.chunkForwardTimes.empty()) { // interleaved: each chunk's own times
      stages.back()["chunk_forward_ms"] = msList(s.chunkForwardTimes);
      stages.back()["chunk_backward_ms"] = msList(s.chunkBackwardTimes);
      stages.back()["chunk_weight_grad_ms"] = msList(s.chunkWeightGradTimes);
    }
  }
  json out = {{"format", "loom-plan"},
          {"version", kPlanVersion},
          {"model", model.name},
          {"cluster", cluster.describe()},
          {"devices", cluster.numDevices()},
          {"devices_per_node", cluster.devicesPerNode},
          {"device_memory_gib", cluster.device.memoryBytes / kGiB},
          {"batch", batch},
          {"dp", plan.dp},
          {"tp", plan.tp},
          {"pp", plan.pp},
          {"vpp", plan.vpp},
          {"microbatch_size", plan.microbatchSize},
          {"microbatches", plan.microbatches},
          {"schedule", scheduleName(plan.schedule)},
          {"recompute", recomputeName(plan.recompute)},
          {"zero", plan.zero},
          {"stages", stages},
          {"predicted",
           {{"step_ms", plan.stepTime * 1e3},
            {"compute_ms", plan.computeTime * 1e3},
            {"communication_ms", plan.communicationTime * 1e3},
            {"tp_comm_ms", plan.tpCommTime * 1e3},
            {"pp_comm_ms", plan.ppCommTime * 1e3},
            {"pp_transfer_ms", plan.ppTransferTime * 1e3},
            {"dp_comm_ms", plan.dpCommTime * 1e3},
            {"bubble_ms", plan.bubbleTime * 1e3},
            {"optimizer_ms", plan.optimizerTime * 1e3},
            {"tokens_per_s", plan.tokensPerSecond},
            {"tflops_per_device", plan.tflopsPerDevice},
            {"mfu", plan.mfu},
            {"peak_memory_gib", plan.peakMemoryBytes / kGiB}}}};
  if (plan.sequenceParallel) // recorded only when set: other plans' files stay as they were
    out["sequence_parallel"] = true;
  return out;
}

std::string explainPlan(const PlanResult &r, const ModelSpec &model, const Cluster &cluster,
                        int64_t batch) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed;
  const Plan &p = r.best;
  os << "plan for " << model.name << " on " << cluster.describe() << ", batch " << batch
     << " (" << r.evaluated << " plans evaluated in " << r.searchSeconds * 1e3 << " ms)\n\n";
  os << "  data parallel    " << p.dp
     << (p.zero == 3   ? " (ZeRO-3: optimizer state, gradients and parameters sharded)"
         : p.zero == 2 ? " (ZeRO-2: optimizer state and gradients sharded)"
         : p.zero    ? " (ZeRO-1: optimizer state sharded)"
                     : "")
     << "\n  tensor parallel  " << p.tp << (p.sequenceParallel ? " (sequence parallel: the tokens between its layers split too)" : "")
     << "\n  pipeline         " << p.pp << " stages";
  if (p.schedule == Schedule::Interleaved)
    os << " x " << p.vpp << " virtual";
  os << ", " << scheduleName(p.schedule) << ", " << p.microbatches << " microbatches of "
     << p.microbatchSize << "\n  recomputation    " << recomputeName(p.recompute) << "\n\n";
  os << "  stage  layers of " << model.layers.size()
     << "        forward    backward   memory (weights + activations)\n";
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const StagePlan &s = p.stages[i];
    std::string ranges = s.layerRanges();
    os << "  " << i << std::string(i < 10 ? 6 : 5, ' ') << ranges
       << std::string(std::max<int>(1, 20 - int(ranges.size())), ' ') << ms(s.forwardTime)
       << "   " << ms(s.backwardTime) << "   " << gib(s.memoryBytes) << " ("
       << gib(s.weightBytes) << " + " << gib(s.activationBytes) << ")\n";
    if (p.stages.size() > 12 && i == 5) {
      os << "  ...\n";
      i = p.stages.size() - 4;
    }
  }
  os << "\n  predicted step   " << ms(p.stepTime) << " = compute " << ms(p.computeTime)
     << " + communication " << ms(p.communicationTime) << " (tp " << ms(p.tpCommTime) << ", pp "
     << ms(p.ppCommTime) << ", dp " << ms(p.dpCommTime) << ") + bubble " << ms(p.bubbleTime)
     << " + optimizer " << ms(p.optimizerTime) << "\n";
  os.precision(0);
  os << "  throughput       " << p.tokensPerSecond << " tokens/s, ";
  os.precision(1);
  os << p.tflopsPerDevice << " TFLOP/s per device, MFU " << p.mfu * 100 << "%\n";
  os << "  peak memory      " << gib(p.peakMemoryBytes) << " of " << gib(cluster.device.memoryBytes)
     << "\n";
  if (!r.alternatives.empty()) {
    os << "\n  rejected:\n";
    for (const Plan &a : r.alternatives)
      os << "    " << a.shortName() << ": " << (a.feasible ? a.reason : "infeasible, " + a.reason)
         << "\n";
  }
  return os.str();
}

bool loadProfile(const std::string &path, CostOptions &options, const Cluster &cluster,
                 std::string &error) {
  std::error_code ec;
  std::ifstream in(path);
  if (!in || std::filesystem::is_directory(path, ec)) {
    error = "cannot read profile '" + path + "'" + (in ? ": it is a directory" : "");
    return false;
  }
  json doc = json::parse(in, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) {
    error = path + ": not a JSON object";
    return false;
  }
  for (auto [key, field] : {std::pair{"matmul_efficiency", &options.matmulEfficiency},
                            {"memory_efficiency", &options.memoryEfficiency},
                            {"link_efficiency", &options.linkEfficiency},
                            {"comm_hidden_share", &options.commHiddenShare},
                            {"tp_link_efficiency", &options.tpLinkEfficiency}}) {
    if (!doc.contains(key))
      continue;
    if (!doc[key].is_number() || doc[key].get<double>() <= 0 || doc[key].get<double>() > 1) {
      error = path + ": '" + key + "' must be a number in (0, 1]";
      return false;
    }
    *field = doc[key].get<double>();
  }
  if (doc.contains("link_half_bytes")) {
    if (!doc["link_half_bytes"].is_number() || doc["link_half_bytes"].get<double>() < 0) {
      error = path + ": 'link_half_bytes' must be a number of bytes, 0 or more";
      return false;
    }
    options.linkHalfBytes = doc["link_half_bytes"].get<double>();
  }
  // A runtime profile (loom-run --profile): achieved matrix FLOP/s against this
  // cluster's peak for the dtype it ran in.
  if (doc.contains("matmul_flops_per_s")) {
    if (!doc["matmul_flops_per_s"].is_number() || doc["matmul_flops_per_s"].get<double>() <= 0) {
      error = path + ": 'matmul_flops_per_s' must be a positive number";
      return false;
    }
    std::string dtype = doc.value("matmul_dtype", "bf16");
    options.matmulEfficiency =
        std::min(1.0, doc["matmul_flops_per_s"].get<double>() / cluster.peakFlops(dtype));
    options.matmulDtype = dtype; // the rate is the achieved one, in the dtype it ran in
    // The products' mean size in that run (loom-run --profile: FLOPs and count by op).
    const json &mm = doc.value("ops", json::object()).value("matmul", json::object());
    if (mm.is_object() && mm.value("count", 0.0) > 0 && mm.value("flops", 0.0) > 0)
      options.profileGemmFlops = mm["flops"].get<double>() / mm["count"].get<double>();
    if (doc.contains("matmul_half_rate_flops")) {
      if (!doc["matmul_half_rate_flops"].is_number() || doc["matmul_half_rate_flops"].get<double>() <= 0) {
        error = path + ": 'matmul_half_rate_flops' must be a positive number";
        return false;
      }
      options.matmulHalfRateFlops = doc["matmul_half_rate_flops"].get<double>();
    }
    if (dtype == "tf32" || dtype == "f32")
      options.activationBytes = 4; // the run kept activations in f32
    // A runtime whose collectives run in stream order exposes them all.
    options.overlapCollectives = doc.value("overlaps_collectives", false);
  }
  // A training step timed without events, for the model and batch profiled.
  if (doc.contains("step_seconds")) {
    if (!doc["step_seconds"].is_number() || doc["step_seconds"].get<double>() <= 0 ||
        !doc.value("model", json()).is_string() || !doc.value("batch", json()).is_number_integer() ||
        !doc.value("ranks", json()).is_number_integer()) {
      error = path + ": 'step_seconds' must be a positive number, with the 'model' (a string), 'batch' and "
                     "'ranks' (integers) it was measured for";
      return false;
    }
    options.profileStepSeconds = doc["step_seconds"].get<double>();
    options.profileModel = doc["model"].get<std::string>();
    options.profileBatch = doc["batch"].get<int64_t>();
    options.profileRanks = doc["ranks"].get<int64_t>();
  }
  // Launches replayed from CUDA graphs (one device) cost the host nothing per
  // instruction; what remains (kernel gaps) the step calibration absorbs.
  options.graphsOnOneDevice = doc.value("cuda_graphs", false) == true;
  if (doc.contains("launch_seconds")) {
    if (!doc["launch_seconds"].is_number() || doc["launch_seconds"].get<double>() < 0) {
      error = path + ": 'launch_seconds' must be a non-negative number";
      return false;
    }
    options.launchSeconds = doc["launch_seconds"].get<double>();
  }
  options.profile = path;
  return true;
}

} // namespace loom::planner

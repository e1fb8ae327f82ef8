//===- PlanFile.cpp - Reading the plan file loomc plan --json writes ------===//

#include "compiler/planner/PlanFile.h"
#include "loom/rt/Checked.h"

namespace loom::planner {

using json = nlohmann::json;
using ::loom::rt::checkedMul;

namespace {

/// The type of every field compile reads, checked before any is used.
std::string checkPlanFields(const json &plan, const std::string &path) {
  auto bad = [&](const std::string &field, const std::string &what, const json &got) {
    return path + ": field '" + field + "' must be " + what + ", got " + got.dump();
  };
  auto isInteger = [](const json &v, int64_t min) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
      return false;
    return v.is_number_integer() && v.get<int64_t>() >= min;
  };
  for (const char *key : {"devices", "batch", "dp", "tp", "pp", "vpp", "microbatches", "zero"}) {
    int64_t min = std::string(key) == "zero" ? 0 : 1;
    if (plan.contains(key) && !isInteger(plan[key], min))
      return bad(key, "an integer of at least " + std::to_string(min), plan[key]);
  }
  for (const char *key : {"schedule", "recompute"})
    if (plan.contains(key) && !plan[key].is_string())
      return bad(key, "a string", plan[key]);
  if (!plan.contains("stages"))
    return "";
  const json &stages = plan["stages"];
  if (!stages.is_array())
    return bad("stages", "a list", stages);
  for (size_t i = 0; i < stages.size(); ++i) {
    std::string at = "stages[" + std::to_string(i) + "]";
    const json &stage = stages[i];
    if (!stage.is_object())
      return bad(at, "an object", stage);
    if (stage.contains("stage") && !isInteger(stage["stage"], 0))
      return bad(at + ".stage", "a non-negative integer", stage["stage"]);
    if (!stage.contains("layer_chunks"))
      continue;
    const json &chunks = stage["layer_chunks"];
    if (!chunks.is_array())
      return bad(at + ".layer_chunks", "a list", chunks);
    for (size_t c = 0; c < chunks.size(); ++c)
      if (!chunks[c].is_array() || chunks[c].size() != 2 || !isInteger(chunks[c][0], 0) ||
          !isInteger(chunks[c][1], 0))
        return bad(at + ".layer_chunks[" + std::to_string(c) + "]",
                   "a pair of non-negative integers", chunks[c]);
  }
  return "";
}

/// The degrees must describe the plan's devices, and its pipeline chunks
/// (pp x vpp, which compile allocates) be few enough to hold a layer each.
std::string checkPlanDegrees(const json &plan, const std::string &path) {
  int64_t dp = plan.value("dp", int64_t(1)), tp = plan.value("tp", int64_t(1)),
          pp = plan.value("pp", int64_t(1)), vpp = plan.value("vpp", int64_t(1));
  std::optional<int64_t> ranks = checkedMul(dp, tp);
  ranks = ranks ? checkedMul(*ranks, pp) : std::nullopt;
  if (plan.contains("devices") && ranks != plan["devices"].get<int64_t>())
    return path + ": fields 'dp' x 'tp' x 'pp' must equal 'devices' (" +
           plan["devices"].dump() + "), got " + std::to_string(dp) + " x " + std::to_string(tp) +
           " x " + std::to_string(pp);
  std::optional<int64_t> chunks = checkedMul(pp, vpp);
  if (!chunks || *chunks > kMaxPipelineChunks)
    return path + ": fields 'pp' x 'vpp' (the pipeline's chunks) must be at most " +
           std::to_string(kMaxPipelineChunks) + ", got " + std::to_string(pp) + " x " +
           std::to_string(vpp);
  return "";
}

} // namespace

bool isPlanDocument(const json &plan) {
  if (!plan.is_object())
    return false;
  auto format = plan.find("format");
  return format != plan.end() && format->is_string() && *format == "loom-plan";
}

bool parsePlanFile(const std::string &text, const std::string &where, json &plan,
                   std::string &error) {
  plan = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (plan.is_discarded() || !isPlanDocument(plan)) {
    error = where + ": not a plan written by loomc plan --json";
    return false;
  }
  error = checkPlanFields(plan, where);
  if (error.empty())
    error = checkPlanDegrees(plan, where);
  return error.empty();
}

std::vector<int64_t> planChunkUnits(const json &plan) {
  if (!plan.contains("stages"))
    return {};
  int64_t pp = plan.value("pp", int64_t(1)), vpp = plan.value("vpp", int64_t(1));
  std::vector<int64_t> units(static_cast<size_t>(pp * vpp), 0);
  for (const auto &stage : plan["stages"]) {
    int64_t s = stage.value("stage", int64_t(0));
    if (!stage.contains("layer_chunks"))
      continue;
    for (size_t v = 0; v < stage["layer_chunks"].size(); ++v)
      if (size_t c = v * pp + s; c < units.size())
        units[c] = stage["layer_chunks"][v][1].get<int64_t>();
  }
  return units;
}

} // namespace loom::planner

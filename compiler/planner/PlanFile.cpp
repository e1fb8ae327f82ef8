//===- PlanFile.cpp - Read a plan file for the model it is applied to -----===//

#include "compiler/planner/PlanFile.h"
#include "loom/rt/Checked.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>

namespace loom::planner {
using json = nlohmann::json;
using ::loom::rt::checkedMul;

namespace {

bool isInteger(const json &v, int64_t min, int64_t max = INT64_MAX) {
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
    return false;
  return v.is_number_integer() && v.get<int64_t>() >= min && v.get<int64_t>() <= max;
}

/// The checks, each returning "" or the problem; `error` gets the first.
class PlanChecker {
public:
  PlanChecker(const std::string &path, const json &plan, const ModelSpec &model)
      : path(path), plan(plan), model(model) {}

  std::string check() const {
    if (std::string e = checkVersion(); !e.empty())
      return e;
    if (std::string e = checkFields(); !e.empty())
      return e;
    if (std::string e = checkDegrees(); !e.empty())
      return e;
    if (std::string e = checkModel(); !e.empty())
      return e;
    return checkStages();
  }

private:
  std::string bad(const std::string &field, const std::string &what, const json &got) const {
    return path + ": field '" + field + "' must be " + what + ", got " + got.dump();
  }
  int64_t integer(const char *key) const { return plan[key].get<int64_t>(); }

  std::string checkVersion() const {
    if (!plan.contains("version"))
      return path + ": field 'version' is missing";
    if (!isInteger(plan["version"], 0) || plan["version"].get<int64_t>() != kPlanVersion)
      return path + ": field 'version' is " + plan["version"].dump() + " but this loomc reads " +
             "plan version " + std::to_string(kPlanVersion) +
             " (write the plan again with loomc plan --json)";
    return "";
  }

  std::string checkFields() const {
    for (const char *key : {"model", "devices", "batch", "dp", "tp", "pp", "vpp", "microbatches",
                            "microbatch_size", "schedule", "recompute", "zero", "stages"})
      if (!plan.contains(key))
        return path + ": field '" + key + "' is missing";
    for (const char *key :
         {"devices", "batch", "dp", "tp", "pp", "vpp", "microbatches", "microbatch_size"})
      if (!isInteger(plan[key], 1))
        return bad(key, "an integer of at least 1", plan[key]);
    if (!isInteger(plan["zero"], 0, 3))
      return bad("zero", "0, 1, 2 or 3 (ZeRO stage)", plan["zero"]);
    if (plan.contains("sequence_parallel") && !plan["sequence_parallel"].is_boolean())
      return bad("sequence_parallel", "true or false", plan["sequence_parallel"]);
    if (plan.value("sequence_parallel", false) && isInteger(plan["tp"], 1) && plan["tp"].get<int64_t>() < 2)
      return bad("sequence_parallel", "false where tp is 1 (it splits the tokens over tp)",
                 plan["sequence_parallel"]);
    Schedule schedule;
    if (!plan["schedule"].is_string() || !parseSchedule(plan["schedule"].get<std::string>(), schedule))
      return bad("schedule", scheduleChoices(), plan["schedule"]);
    Recompute recompute;
    if (!plan["recompute"].is_string() ||
        !parseRecompute(plan["recompute"].get<std::string>(), recompute))
      return bad("recompute", "none, selective or full", plan["recompute"]);
    if (!plan["model"].is_string())
      return bad("model", "a string", plan["model"]);
    if (!plan["stages"].is_array())
      return bad("stages", "a list", plan["stages"]);
    return "";
  }

  /// dp x tp x pp = devices and dp x microbatches x microbatch_size = batch,
  /// by division (the product of three int64 fields can overflow).
  std::string checkDegrees() const {
    int64_t devices = integer("devices"), dp = integer("dp"), tp = integer("tp"), pp = integer("pp");
    if (devices % dp || (devices / dp) % tp || devices / dp / tp != pp)
      return path + ": fields 'dp' x 'tp' x 'pp' (" + std::to_string(dp) + " x " +
             std::to_string(tp) + " x " + std::to_string(pp) + ") must multiply to 'devices' (" +
             std::to_string(devices) + ")";
    int64_t batch = integer("batch"), m = integer("microbatches"), mbs = integer("microbatch_size");
    if (batch % dp || (batch / dp) % m || batch / dp / m != mbs)
      return path + ": fields 'dp' x 'microbatches' x 'microbatch_size' (" + std::to_string(dp) +
             " x " + std::to_string(m) + " x " + std::to_string(mbs) + ") must multiply to 'batch' (" +
             std::to_string(batch) + ")";
    return "";
  }

  std::string checkModel() const {
    std::string name = plan["model"].get<std::string>();
    if (name != model.name)
      return path + ": field 'model' is '" + name + "' but the model compiled is '" + model.name +
             "' (write a plan for it with loomc plan --json)";
    if (plan.contains("model_parameters")) {
      const json &params = plan["model_parameters"];
      if (!isInteger(params, 0))
        return bad("model_parameters", "a non-negative integer", params);
      if (double(params.get<int64_t>()) != model.totalParams)
        return path + ": field 'model_parameters' is " + params.dump() + " but " + model.name +
               " has " + std::to_string(int64_t(model.totalParams)) +
               " parameters: the plan is for another size of the model";
    }
    return "";
  }

  /// pp stages in order, each with vpp chunks [first, count]; chunk v of stage
  /// s is virtual stage v x pp + s, and the virtual stages cover the model's
  /// layers in order.
  std::string checkStages() const {
    const json &stages = plan["stages"];
    int64_t pp = integer("pp"), vpp = integer("vpp");
    int64_t layers = static_cast<int64_t>(model.layers.size());
    if (static_cast<int64_t>(stages.size()) != pp)
      return path + ": field 'stages' lists " + std::to_string(stages.size()) +
             " stages but 'pp' is " + std::to_string(pp);
    if (pp > layers || vpp > layers / pp)
      return path + ": fields 'pp' x 'vpp' (" + std::to_string(pp) + " x " + std::to_string(vpp) +
             ") exceed the " + std::to_string(layers) + " layers of " + model.name;
    std::vector<std::pair<int64_t, int64_t>> chunks(static_cast<size_t>(pp * vpp));
    for (int64_t s = 0; s < pp; ++s) {
      std::string at = "stages[" + std::to_string(s) + "]";
      const json &stage = stages[s];
      if (!stage.is_object())
        return bad(at, "an object", stage);
      if (!stage.contains("stage") || !isInteger(stage["stage"], s, s))
        return bad(at + ".stage", std::to_string(s), stage.value("stage", json()));
      if (!stage.contains("layer_chunks") || !stage["layer_chunks"].is_array() ||
          static_cast<int64_t>(stage["layer_chunks"].size()) != vpp)
        return bad(at + ".layer_chunks", "a list of 'vpp' (" + std::to_string(vpp) + ") chunks",
                   stage.value("layer_chunks", json()));
      for (int64_t v = 0; v < vpp; ++v) {
        const json &chunk = stage["layer_chunks"][v];
        if (!chunk.is_array() || chunk.size() != 2 || !isInteger(chunk[0], 0, layers) ||
            !isInteger(chunk[1], 1, layers))
          return bad(at + ".layer_chunks[" + std::to_string(v) + "]",
                     "a pair [first layer, layer count] within the " + std::to_string(layers) +
                         " layers of " + model.name,
                     chunk);
        chunks[v * pp + s] = {chunk[0].get<int64_t>(), chunk[1].get<int64_t>()};
      }
    }
    int64_t next = 0;
    for (size_t c = 0; c < chunks.size(); ++c) {
      std::string at = "stages[" + std::to_string(c % pp) + "].layer_chunks[" +
                       std::to_string(c / pp) + "]";
      if (chunks[c].first != next)
        return path + ": field '" + at + "' starts at layer " + std::to_string(chunks[c].first) +
               " but virtual stage " + std::to_string(c) + " must start at layer " +
               std::to_string(next);
      next += chunks[c].second;
    }
    if (next != layers)
      return path + ": field 'stages' covers " + std::to_string(next) + " layers but " +
             model.name + " has " + std::to_string(layers);
    return "";
  }

  const std::string &path;
  const json &plan;
  const ModelSpec &model;
};
} // namespace

bool readPlanFile(const std::string &path, const ModelSpec &model, json &plan, std::string &error) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    error = path + ": is a directory, not a plan written by loomc plan --json";
    return false;
  }
  std::ifstream in(path);
  plan = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!in || plan.is_discarded() || !plan.is_object() || !plan.contains("format") ||
      plan["format"] != "loom-plan") {
    error = path + ": not a plan written by loomc plan --json";
    return false;
  }
  error = PlanChecker(path, plan, model).check();
  return error.empty();
}


//===----------------------------------------------------------------------===//
// A plan's own consistency, from its text
//===----------------------------------------------------------------------===//



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
  if (plan.contains("sequence_parallel") && !plan["sequence_parallel"].is_boolean())
    return bad("sequence_parallel", "true or false", plan["sequence_parallel"]);
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

//===- PlanFile.h - Read a plan file for the model it is applied to -*- C++ -*-===//
//
// `loomc plan --json` writes a plan; `loomc compile --plan` reads it back for
// a model. A plan written for another model, by another version of Loom or
// edited by hand must be refused naming the file and the field, before any of
// it reaches the compiler (where it would be blamed on the model).
// parsePlanFile checks a plan's own consistency from its text (what `loomc
// inspect` and the plan fuzz target read); readPlanFile checks it against the
// model it is applied to as well.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_PLANFILE_H
#define LOOM_COMPILER_PLANNER_PLANFILE_H

#include "compiler/planner/Planner.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::planner {

/// The most pipeline chunks (pp x vpp) a plan may have: each holds at least
/// one layer, and a loom.repeat at most 16384 (RepeatOp::kMaxCount).
constexpr int64_t kMaxPipelineChunks = 16384;

/// Whether `plan` is an object with "format": "loom-plan".
bool isPlanDocument(const nlohmann::json &plan);

/// Parses the text of a plan file (`where` names it in errors) and checks
/// its fields' types and that its degrees describe its devices. Returns
/// false with a message naming the file and field.
bool parsePlanFile(const std::string &text, const std::string &where, nlohmann::json &plan,
                   std::string &error);

/// Reads the plan at `path` for compiling `model`. Every field compile uses
/// (model, devices, batch, dp, tp, pp, vpp, microbatches, microbatch_size,
/// schedule, recompute, zero, stages) must be there with its type and range,
/// and agree with the others (dp x tp x pp = devices, dp x microbatches x
/// microbatch_size = batch) and with `model`: its name, its parameter count
/// (where the plan records one, as `loomc plan --json` does) and its layers,
/// which the stages' chunks must cover in order. False, with `error` naming
/// the file and the field, otherwise.
bool readPlanFile(const std::string &path, const ModelSpec &model, nlohmann::json &plan,
                  std::string &error);

/// The layer units of each pipeline chunk (chunk c = virtual stage c / pp of
/// stage c % pp) from a checked plan's `stages[i].layer_chunks`; empty where
/// the plan lists no stages.
std::vector<int64_t> planChunkUnits(const nlohmann::json &plan);

} // namespace loom::planner

#endif

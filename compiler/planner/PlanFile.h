//===- PlanFile.h - Reading the plan file loomc plan --json writes -*- C++ -*-===//
//
// `loomc compile --plan PLAN.json` takes the parallel layout from a plan file.
// Plain C++ (no MLIR): every field it uses is type-checked here, before use,
// so a hand-edited or damaged plan is an error naming the field.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_PLANFILE_H
#define LOOM_COMPILER_PLANNER_PLANFILE_H

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
/// its fields. Returns false with a message naming the file and field.
bool parsePlanFile(const std::string &text, const std::string &where, nlohmann::json &plan,
                   std::string &error);

/// The layer units of each pipeline chunk (chunk c = virtual stage c / pp of
/// stage c % pp) from a checked plan's `stages[i].layer_chunks`; empty where
/// the plan lists no stages.
std::vector<int64_t> planChunkUnits(const nlohmann::json &plan);

} // namespace loom::planner

#endif

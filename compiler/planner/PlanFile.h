//===- PlanFile.h - Read a plan file for the model it is applied to -*- C++ -*-===//
//
// `loomc plan --json` writes a plan; `loomc compile --plan` reads it back for
// a model. A plan written for another model, by another version of Loom or
// edited by hand must be refused naming the file and the field, before any of
// it reaches the compiler (where it would be blamed on the model).
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_PLANFILE_H
#define LOOM_COMPILER_PLANNER_PLANFILE_H

#include "compiler/planner/Planner.h"

#include <nlohmann/json.hpp>

#include <string>

namespace loom::planner {

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

} // namespace loom::planner

#endif

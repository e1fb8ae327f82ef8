//===- PlannerModel.h - The planner's view of a model -----------*- C++ -*-===//
//
// Builds the planner's ModelSpec from IR: the training graph in program
// order, one LayerSpec per layer (each loom.repeat contributes its count),
// with parameters, FLOPs and memory traffic per example, and what tensor
// parallelism may split, found by propagating shardings with Megatron's
// rules: a linear on a replicated input is column-parallel, a linear on a
// column-split input is row-parallel and ends in an all-reduce, attention
// splits by heads, the embedding and the LM head split the vocabulary.
// Ops with no rule (convolutions, say) leave their layer replicated. What a
// layer keeps for its backward is what its ops' gradient rules read
// (compiler/BackwardReads.h).
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNERMODEL_H
#define LOOM_COMPILER_PLANNERMODEL_H

#include "compiler/planner/Planner.h"
#include "mlir/IR/BuiltinOps.h"

namespace mlir::loom {

FailureOr<::loom::planner::ModelSpec> buildModelSpec(ModuleOp module, StringRef name);

} // namespace mlir::loom

#endif

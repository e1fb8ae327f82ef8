//===- TensorParallel.h - What a tensor-parallel rule says ------*- C++ -*-===//
//
// Megatron-LM's rules, stated once per op (TensorParallelOpInterface): given
// how the op's operands are laid out over the tensor-parallel ranks, how its
// results are, which parameters it splits and which collectives it needs.
// loom-partition-tp rewrites by these rules, and the planner's model view
// (compiler/PlannerModel.cpp) prices the same decisions.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_DIALECTS_LOOM_IR_TENSORPARALLEL_H
#define LOOM_DIALECTS_LOOM_IR_TENSORPARALLEL_H

#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Operation.h"
#include "mlir/Support/LLVM.h"

namespace mlir::loom {

/// A value is whole on every rank, or split along its last dimension
/// (viewed as `blocks` equal blocks, each cut into tp parts: a fused q|k|v
/// projection has 3).
struct TpState {
  bool split = false;
  int64_t blocks = 1;
};

/// A parameter the rule splits: the one operand `operand` reads directly,
/// along dimension `axis`, in `blocks` blocks.
struct TpShard {
  unsigned operand = 0;
  int64_t axis = 0, blocks = 1;
};

struct TpRule {
  SmallVector<TpState, 1> results;
  SmallVector<TpShard, 1> shards;
  /// Counts tp must divide (heads); parameter extents are implied by shards.
  SmallVector<int64_t, 2> mustDivide;
  bool readsWhole = false;    // no rule: the op reads its operands whole
  bool entersRegion = false;  // column-parallel: its replicated input's gradient is summed
  bool reduceAfter = false;   // row-parallel, vocabulary-parallel embedding: results are partial sums
  bool splitsHeads = false;   // attention, rotary: each rank takes num_heads / tp
  bool vocabParallel = false; // embedding, cross-entropy over a split vocabulary
  bool slicesBlocks = false;  // a slice of whole blocks of a split value
};

struct TpQuery {
  ArrayRef<TpState> operands;
  /// The type of the parameter an operand reads directly (loom.get), or null.
  function_ref<RankedTensorType(Value)> paramType;
  /// The degree, for divisibility errors; 0 when any degree is asked about.
  int64_t tp = 0;
  /// Emit a diagnostic at the op when there is no rule (the partitioner);
  /// the planner only learns that there is none.
  bool emitErrors = false;
};

/// The rule of `op`: its TensorParallelOpInterface, or for other ops
/// "replicated" (operands whole; failure if one is split).
FailureOr<TpRule> tensorParallelRule(Operation *op, const TpQuery &query);

} // namespace mlir::loom

#endif

//===- TensorParallelRules.cpp - Megatron's rules, one per op -------------===//
//
// TensorParallelOpInterface: column- then row-parallel linears, bias adds
// that follow a split, heads split for attention and rotary embeddings,
// vocabulary-parallel embedding and loss. What is not here takes its
// operands whole.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/LoomOps.h"

using namespace mlir;
using namespace mlir::loom;

namespace {

int64_t lastDim(Value v) { return cast<RankedTensorType>(v.getType()).getShape().back(); }

/// How many equal blocks the columns of a column-parallel result fall
/// into: a fused projection read through equal slices (q|k|v) has one
/// block per slice, so each rank keeps its heads of every block.
int64_t columnBlocks(Value result, const TpQuery &q) {
  int64_t n = lastDim(result);
  Value v = result;
  if (v.hasOneUse())
    if (auto add = dyn_cast<AddOp>(*v.getUsers().begin()))
      if (q.paramType(add.getLhs() == v ? add.getRhs() : add.getLhs()))
        v = add.getResult();
  int64_t size = 0;
  for (Operation *user : v.getUsers()) {
    auto slice = dyn_cast<SliceOp>(user);
    int64_t rank = cast<RankedTensorType>(v.getType()).getRank();
    if (!slice || slice.getAxis() != rank - 1 || (size && slice.getSize() != size))
      return 1;
    size = slice.getSize();
  }
  return size > 0 && size < n && n % size == 0 ? n / size : 1;
}

/// No rule: every operand must be whole, and so are the results.
FailureOr<TpRule> replicated(Operation *op, const TpQuery &q) {
  for (auto [v, state] : llvm::zip(op->getOperands(), q.operands))
    if (state.split) {
      if (q.emitErrors)
        return op->emitError() << "has no tensor-parallel rule for an input split over tp ("
                               << v.getType() << " holds 1/" << q.tp
                               << " of its last dimension); use tp = 1 for this model";
      return failure();
    }
  TpRule rule;
  rule.readsWhole = true;
  rule.results.assign(op->getNumResults(), TpState{});
  return rule;
}

FailureOr<TpRule> refuse(Operation *op, const TpQuery &q, const Twine &message) {
  if (q.emitErrors)
    return op->emitError() << message;
  return failure();
}

TpRule resultsLike(TpState state) {
  TpRule rule;
  rule.results.push_back(state);
  return rule;
}

/// add, sub, mul, div: split operands combine with split operands of the
/// same layout, or with a bias parameter split the same way.
FailureOr<TpRule> binaryRule(Operation *op, const TpQuery &q) {
  Value a = op->getOperand(0), b = op->getOperand(1);
  TpState sa = q.operands[0], sb = q.operands[1];
  if (!sa.split && !sb.split)
    return replicated(op, q);
  if (sa.split && sb.split && sa.blocks == sb.blocks && a.getType() == b.getType())
    return resultsLike(sa);
  bool firstSplit = sa.split;
  Value s = firstSplit ? a : b, other = firstSplit ? b : a;
  TpState state = firstSplit ? sa : sb;
  RankedTensorType bias = q.paramType(other);
  if (bias && bias.getRank() == 1 && bias.getDimSize(0) == lastDim(s)) {
    TpRule rule = resultsLike(state);
    rule.shards.push_back({firstSplit ? 1u : 0u, 0, state.blocks});
    return rule;
  }
  if (q.emitErrors)
    return op->emitError() << "combines an input split over tp with a replicated one ("
                           << other.getType() << "); tensor parallelism has no rule for this";
  return failure();
}

} // namespace

FailureOr<TpRule> mlir::loom::tensorParallelRule(Operation *op, const TpQuery &query) {
  if (auto rule = dyn_cast<TensorParallelOpInterface>(op))
    return rule.tensorParallelRule(query);
  return replicated(op, query);
}

FailureOr<TpRule> AddOp::tensorParallelRule(const TpQuery &q) { return binaryRule(*this, q); }
FailureOr<TpRule> SubOp::tensorParallelRule(const TpQuery &q) { return binaryRule(*this, q); }
FailureOr<TpRule> MulOp::tensorParallelRule(const TpQuery &q) { return binaryRule(*this, q); }
FailureOr<TpRule> DivOp::tensorParallelRule(const TpQuery &q) { return binaryRule(*this, q); }

// Elementwise functions of one tensor keep its layout.
FailureOr<TpRule> GeluOp::tensorParallelRule(const TpQuery &q) { return resultsLike(q.operands[0]); }
FailureOr<TpRule> ReluOp::tensorParallelRule(const TpQuery &q) { return resultsLike(q.operands[0]); }
FailureOr<TpRule> SiluOp::tensorParallelRule(const TpQuery &q) { return resultsLike(q.operands[0]); }
FailureOr<TpRule> ExpOp::tensorParallelRule(const TpQuery &q) { return resultsLike(q.operands[0]); }
FailureOr<TpRule> TanhOp::tensorParallelRule(const TpQuery &q) { return resultsLike(q.operands[0]); }
FailureOr<TpRule> RsqrtOp::tensorParallelRule(const TpQuery &q) { return resultsLike(q.operands[0]); }
FailureOr<TpRule> NegOp::tensorParallelRule(const TpQuery &q) { return resultsLike(q.operands[0]); }
FailureOr<TpRule> ScaleOp::tensorParallelRule(const TpQuery &q) { return resultsLike(q.operands[0]); }
FailureOr<TpRule> CastOp::tensorParallelRule(const TpQuery &q) { return resultsLike(q.operands[0]); }

/// A linear layer whose weight is a parameter: column-parallel on a whole
/// input (the result's columns split, in the blocks its slices take), then
/// row-parallel on a split one (partial sums, all-reduced).
FailureOr<TpRule> MatmulOp::tensorParallelRule(const TpQuery &q) {
  RankedTensorType w = q.paramType(getRhs());
  if (!w || w.getRank() != 2 || q.paramType(getLhs()) || getTransposeA())
    return replicated(*this, q);
  bool tb = getTransposeB();
  TpState x = q.operands[0];
  if (!x.split) {
    int64_t blocks = columnBlocks(getResult(), q);
    TpRule rule = resultsLike({true, blocks});
    rule.shards.push_back({1, tb ? 0 : 1, blocks});
    rule.entersRegion = true;
    return rule;
  }
  TpRule rule = resultsLike({});
  rule.shards.push_back({1, tb ? 1 : 0, x.blocks});
  rule.reduceAfter = true;
  return rule;
}

/// Slicing the split dimension takes whole blocks (q, k or v of a fused
/// projection); any other slice keeps the layout.
FailureOr<TpRule> SliceOp::tensorParallelRule(const TpQuery &q) {
  TpState x = q.operands[0];
  int64_t rank = cast<RankedTensorType>(getX().getType()).getRank();
  if (!x.split || (getAxis() != rank - 1 && getAxis() != -1))
    return resultsLike(x);
  int64_t block = lastDim(getX()) / x.blocks;
  if (getSize() != block || getStart() % block != 0)
    return refuse(*this, q,
                  "slices [" + Twine(getStart()) + ", " + Twine(getStart() + getSize()) +
                      ") of a tensor split over tp in blocks of " + Twine(block) +
                      "; only whole blocks can be taken");
  TpRule rule = resultsLike({true, 1});
  rule.slicesBlocks = true;
  return rule;
}

/// Heads split over the ranks: q, k and v all split, or all whole.
FailureOr<TpRule> AttentionOp::tensorParallelRule(const TpQuery &q) {
  bool sq = q.operands[0].split, sk = q.operands[1].split, sv = q.operands[2].split;
  if (!sq && !sk && !sv)
    return replicated(*this, q);
  if (!(sq && sk && sv))
    return refuse(*this, q, "needs q, k and v all split by heads or all replicated");
  if (q.tp > 0 && (getNumHeads() % q.tp || getKvHeads() % q.tp))
    return refuse(*this, q,
                  "has " + Twine(getNumHeads()) + " heads and " + Twine(getKvHeads()) +
                      " key/value heads; tp = " + Twine(q.tp) + " must divide both");
  TpRule rule = resultsLike({true, 1});
  rule.mustDivide = {int64_t(getNumHeads()), int64_t(getKvHeads())};
  rule.splitsHeads = true;
  return rule;
}

FailureOr<TpRule> RotaryOp::tensorParallelRule(const TpQuery &q) {
  if (!q.operands[0].split)
    return replicated(*this, q);
  if (q.tp > 0 && getNumHeads() % q.tp)
    return refuse(*this, q,
                  "has " + Twine(getNumHeads()) + " heads; tp = " + Twine(q.tp) +
                      " must divide them");
  TpRule rule = resultsLike(q.operands[0]);
  rule.mustDivide = {int64_t(getNumHeads())};
  rule.splitsHeads = true;
  return rule;
}

/// Vocabulary-parallel: each rank looks up its rows of the table, and the
/// partial lookups are summed.
FailureOr<TpRule> EmbeddingOp::tensorParallelRule(const TpQuery &q) {
  if (!q.paramType(getTable()) || q.operands[1].split)
    return replicated(*this, q);
  TpRule rule = resultsLike({});
  rule.shards.push_back({0, 0, 1});
  rule.vocabParallel = true;
  rule.reduceAfter = true;
  return rule;
}

/// The loss over logits split by vocabulary: its reductions span the ranks.
FailureOr<TpRule> CrossEntropyOp::tensorParallelRule(const TpQuery &q) {
  TpState logits = q.operands[0];
  if (!logits.split)
    return replicated(*this, q);
  if (logits.blocks != 1)
    return refuse(*this, q,
                  "reads logits split in blocks; only a contiguous vocabulary split is supported");
  TpRule rule = resultsLike({});
  rule.vocabParallel = true;
  return rule;
}

//===- RowSplit.h - A product cut into row blocks by slice views -*- C++ -*-===//
//
// loom-overlap-tensor-gather and loom-split-tensor-reduce cut a product
// (matmul) into blocks of its rows: each operand with a row per row of the
// product (the left operand, the results, a residual, GELU's
// pre-activation) is viewed in parts along its leading axis (slice views,
// `view_offset`), the weight and the bias are read whole. Each row's
// product is computed from the same operands, so the values are the same.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_PASSES_ROWSPLIT_H
#define LOOM_PASSES_ROWSPLIT_H

#include "loom/rt/Bundle.h"
#include "loom/rt/Tensor.h"

#include <string>
#include <utility>
#include <vector>

namespace mlir::loom {

/// The epilogues whose extra operands are a bias (one per column) or have a
/// row per row of the product; the bias-gradient ones sum over the rows.
inline bool splittableEpilogue(const ::loom::rt::Instruction &ins) {
  std::string e = ins.attrs.is_object() ? ins.attrs.value("epilogue", std::string()) : "";
  return e.empty() || e == "bias" || e == "bias_gelu" || e == "dgelu" || e == "residual" || e == "bias_residual";
}

/// Positions of the product's operands with a row per row of the product:
/// (inputs, outputs).
inline std::pair<std::vector<size_t>, std::vector<size_t>> rowOperands(const ::loom::rt::Instruction &ins) {
  std::string e = ins.attrs.is_object() ? ins.attrs.value("epilogue", std::string()) : "";
  std::vector<size_t> in = {0}, out;
  if (e == "dgelu" && ins.in.size() == 3)
    in.push_back(2); // GELU's pre-activation
  if ((e == "residual" || e == "bias_residual") && ins.in.size() >= 3)
    in.push_back(ins.in.size() - 1);
  for (size_t i = 0; i < ins.out.size(); ++i)
    out.push_back(i);
  return {in, out};
}

class RowSplitter {
public:
  explicit RowSplitter(::loom::rt::RankProgram &r) : r(r) {}

  /// A view of rows [begin, end) of `parts` equal parts of buffer `id`'s
  /// leading axis (a reshape of the whole when that is all of it).
  int64_t slice(int64_t id, int64_t parts, int64_t begin, int64_t end) {
    ::loom::rt::Buffer whole = r.buffers[size_t(id)];
    ::loom::rt::Buffer v = whole;
    v.id = int64_t(r.buffers.size());
    v.name = whole.name + ".rows";
    v.viewOf = id;
    v.shape[0] = whole.shape[0] / parts * (end - begin);
    v.bytes = whole.bytes / parts * (end - begin);
    v.viewOffset = whole.bytes / parts * begin;
    r.buffers.push_back(v);
    return v.id;
  }

  /// `s` (one part) reshaped as `like`'s rows of one part.
  int64_t partView(int64_t s, int64_t like, int64_t parts) {
    ::loom::rt::Buffer v = r.buffers[size_t(like)];
    v.id = int64_t(r.buffers.size());
    v.name = r.buffers[size_t(s)].name + ".view";
    v.shape[0] /= parts;
    v.bytes /= parts;
    v.viewOf = s;
    v.viewOffset = 0;
    r.buffers.push_back(v);
    return v.id;
  }

  /// Whether every row operand of `ins` can be cut into `parts` parts at
  /// the same rows: the same row count, a leading axis that `parts` divides.
  bool cuttable(const ::loom::rt::Instruction &ins, int64_t parts) {
    auto [in, out] = rowOperands(ins);
    int64_t rows = -1;
    auto ok = [&](int64_t id) {
      const ::loom::rt::Buffer &b = r.buffers[size_t(id)];
      if (b.shape.size() < 2 || b.shape[0] % parts || b.bytes % parts || b.viewOffset != 0)
        return false;
      int64_t n = ::loom::rt::numElements(b.shape).value_or(0), cols = b.shape.back();
      if (cols <= 0 || n % cols)
        return false;
      if (rows < 0)
        rows = n / cols;
      return rows == n / cols;
    };
    for (size_t i : in)
      if (!ok(ins.in[i]))
        return false;
    for (size_t i : out)
      if (!ok(ins.out[i]))
        return false;
    return true;
  }

  /// The product over rows [begin, end) of `parts` parts, its left operand `a`.
  ::loom::rt::Instruction rows(const ::loom::rt::Instruction &ins, int64_t a, int64_t parts, int64_t begin, int64_t end) {
    ::loom::rt::Instruction part = ins;
    auto [in, out] = rowOperands(ins);
    for (size_t i : in)
      part.in[i] = i == 0 ? a : slice(ins.in[i], parts, begin, end);
    for (size_t i : out)
      part.out[i] = slice(ins.out[i], parts, begin, end);
    return part;
  }

private:
  ::loom::rt::RankProgram &r;
};

} // namespace mlir::loom

#endif // LOOM_PASSES_ROWSPLIT_H

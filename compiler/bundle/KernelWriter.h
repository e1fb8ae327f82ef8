//===- KernelWriter.h - MLIR gpu.func text for generated kernels -*- C++ -*-===//
//
// KernelWriter writes one generated kernel as a gpu.func in MLIR's textual
// form (arith, math, memref, vector, scf and gpu ops); fusedKernelsPtx
// (KernelGen.cpp) parses the module and lowers it to PTX. The kinds live in
// KernelGen.cpp (elementwise chains), KernelGenRows.cpp (norms, softmax,
// cross-entropy), KernelGenNormGrad.cpp (norm gradients), KernelGenVocabLoss.cpp
// (the vocabulary-parallel loss) and KernelGenAdam.cpp (AdamW).
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_BUNDLE_KERNELWRITER_H
#define LOOM_COMPILER_BUNDLE_KERNELWRITER_H

#include "loom/rt/Bundle.h"

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace mlir::loom::kernelgen {

namespace rt = ::loom::rt;
using json = nlohmann::json;

/// Writes one fused instruction as a gpu.func over flat memrefs. Each
/// thread handles V consecutive output elements (the launch's "vector"):
/// full-size tensors, and broadcast ones that keep the innermost axis, are
/// memrefs of vector<V x T> (one 16-byte load or store), a tensor constant
/// along rows is one scalar load, anything else a load per element. The
/// chain runs per element in f32 (bf16 widened on load, rounded once on
/// store), as the CPU backend evaluates it.
class KernelWriter {
public:
  KernelWriter(const rt::RankProgram &r, const rt::Instruction &ins) : r(r), ins(ins) {}

  /// A fused elementwise chain (KernelGen.cpp).
  std::string write();
  /// A norm or softmax over the last axis: a warp per row (KernelGenRows.cpp).
  std::string writeRows();
  /// The cross-entropy loss or its gradient: a block per row (KernelGenRows.cpp).
  std::string writeCrossEntropy();
  /// A norm's gradient: its rows, then its parameters' column sums (two
  /// kernels, the second named "<kernel>_sum"; KernelGenNormGrad.cpp).
  std::string writeNormGrad();
  /// The loss over a vocabulary split over ranks: three kernels around the
  /// runtime's all-reduces (KernelGenVocabLoss.cpp).
  std::string writeVocabLoss();
  /// A run of AdamW updates (`members`, this one first) in one kernel (KernelGenAdam.cpp).
  std::string writeAdam(const std::vector<const rt::Instruction *> &members);

protected:
  /// exp(old - big), 1 where old is big (both may be -inf: an empty share).
  std::string rescale(const std::string &old, const std::string &big) {
    std::string same = tmp(), t = tmp();
    line(same + " = arith.cmpf oeq, " + old + ", " + big + " : f32");
    line(t + " = arith.select " + same + ", " + constF(1) + ", " + op("math.exp", op("arith.subf", old, big)) + " : f32");
    return t;
  }
  std::string constI64(int64_t v) {
    std::string t = tmp();
    line(t + " = arith.constant " + std::to_string(v) + " : i64");
    return t;
  }
  /// The V lanes of one vector load, widened to f32.
  std::vector<std::string> loadLanes(const std::string &arg, int64_t id, const std::string &at,
                                     const std::string &type) {
    std::string vec = tmp(), ty = elem(id);
    line(vec + " = memref.load " + arg + "[" + at + "] : " + type);
    std::vector<std::string> lanes;
    for (int64_t l = 0; l < V; ++l) {
      std::string x = tmp();
      line(x + " = vector.extract " + vec + "[" + std::to_string(l) + "] : " + ty + " from vector<" +
           std::to_string(V) + "x" + ty + ">");
      lanes.push_back(widen(x, ty));
    }
    return lanes;
  }
  /// f32 values rounded to `ty` and packed into a vector of as many lanes.
  std::string packLanes(const std::vector<std::string> &values, const std::string &ty) {
    std::string vty = "vector<" + std::to_string(values.size()) + "x" + ty + ">", vec = tmp();
    line(vec + " = arith.constant dense<0.0> : " + vty);
    for (size_t l = 0; l < values.size(); ++l) {
      std::string x = values[l];
      if (ty == "bf16") {
        std::string t = tmp();
        line(t + " = arith.truncf " + x + " : f32 to bf16");
        x = t;
      }
      std::string next = tmp();
      line(next + " = vector.insert " + x + ", " + vec + "[" + std::to_string(l) + "] : " + ty + " into " + vty);
      vec = next;
    }
    return vec;
  }
  /// The type of a workgroup (shared) memory buffer of `n` elements of `type`.
  static std::string workgroup(int64_t n, const std::string &type) {
    return "memref<" + std::to_string(n) + "x" + type + ", #gpu.address_space<workgroup>>";
  }
  /// A cross-entropy kernel's bad target `t` (i64) for row %row: error code
  /// 2 into the runtime's 3-word record %err (the first raised wins).
  void raiseBadTarget(const std::string &t) {
    std::string old = tmp(), won = tmp(), rowI = tmp();
    line(old + " = memref.atomic_rmw maxs " + constI64(2) + ", %err[" + constIndex(0) +
         "] : (i64, memref<3xi64>) -> i64");
    line(won + " = arith.cmpi eq, " + old + ", " + constI64(0) + " : i64");
    line(rowI + " = arith.index_cast %row : index to i64");
    line("scf.if " + won + " {");
    line("memref.store " + rowI + ", %err[" + constIndex(1) + "] : memref<3xi64>");
    line("memref.store " + t + ", %err[" + constIndex(2) + "] : memref<3xi64>");
    line("}");
  }
  /// A cross-entropy kernel's gradient over row %row of `cols` columns (V a
  /// load, the block's 256 threads strided over them, %rowV the row's first
  /// vector): (exp(x - max) * inv - onehot(target)) * scale from %lv into
  /// %out (both of type `rowsType`, the output's elements of buffer `out`);
  /// `target` is the i64 column of the row's target in these columns.
  void softmaxMinusOnehot(int64_t cols, const std::string &rowsType, const std::string &max, const std::string &inv,
                          const std::string &target, const std::string &scale, int64_t out) {
    std::string j = tmp();
    line("scf.for " + j + " = %tid to " + constIndex(cols / V) + " step " + constIndex(256) + " {");
    std::string at = tmp();
    line(at + " = arith.addi %rowV, " + j + " : index");
    std::vector<std::string> x = loadLanes("%lv", ins.in[0], at, rowsType);
    std::string col0 = tmp(), col0i = tmp();
    line(col0 + " = arith.muli " + j + ", " + constIndex(V) + " : index");
    line(col0i + " = arith.index_cast " + col0 + " : index to i64");
    std::vector<std::string> y(V);
    for (int64_t l = 0; l < V; ++l) {
      std::string col = tmp(), hit = tmp(), one = tmp();
      line(col + " = arith.addi " + col0i + ", " + constI64(l) + " : i64");
      line(hit + " = arith.cmpi eq, " + col + ", " + target + " : i64");
      line(one + " = arith.select " + hit + ", " + constF(1) + ", " + constF(0) + " : f32");
      std::string p = op("arith.mulf", op("math.exp", op("arith.subf", x[l], max)), inv);
      y[l] = op("arith.mulf", op("arith.subf", p, one), scale);
    }
    line("memref.store " + packLanes(y, elem(out)) + ", %out[" + at + "] : " + rowsType);
    line("}");
  }
  /// `combine` over the 32 lanes of the warp (butterfly shuffles: every lane gets it).
  std::string warpReduce(std::string v, const char *combine) {
    std::string width = tmp();
    line(width + " = arith.constant 32 : i32");
    for (int offset : {16, 8, 4, 2, 1}) {
      std::string o = tmp(), got = tmp(), valid = tmp();
      line(o + " = arith.constant " + std::to_string(offset) + " : i32");
      line(got + ", " + valid + " = gpu.shuffle xor " + v + ", " + o + ", " + width + " : f32");
      v = op(combine, v, got);
    }
    return v;
  }
  int64_t count(int64_t id) const { return rt::numElements(r.buffers[id].shape).value_or(0); }
  std::string elem(int64_t id) const { return r.buffers[id].dtype == LOOM_BF16 ? "bf16" : "f32"; }
  std::string widen(const std::string &x, const std::string &ty) {
    if (ty == "f32")
      return x;
    std::string t = tmp();
    line(t + " = arith.extf " + x + " : " + ty + " to f32");
    return t;
  }
  void line(const std::string &s) { os << "      " << s << "\n"; }
  std::string tmp() { return "%t" + std::to_string(counter++); }
  std::string constIndex(int64_t v) {
    std::string t = tmp();
    line(t + " = arith.constant " + std::to_string(v) + " : index");
    return t;
  }
  std::string constF(double v) {
    std::string t = tmp();
    std::ostringstream s;
    s.precision(9);
    s << std::scientific << v;
    line(t + " = arith.constant " + (std::isinf(v) ? (v < 0 ? "0xFF800000" : "0x7F800000") : s.str()) + " : f32");
    return t;
  }
  std::string op(const std::string &name, const std::string &a, const std::string &b = "") {
    std::string t = tmp();
    line(t + " = " + name + " " + a + (b.empty() ? "" : ", " + b) + " : f32");
    return t;
  }
  /// The index into input `id` (broadcast to `shape`) of output element `e`.
  std::string inputIndex(int64_t id, const rt::Shape &shape, const std::string &e);
  /// One step of a fused chain over f32 values `a`.
  std::string emitStep(const json &step, const std::vector<std::string> &a);
  std::string tanh(const std::string &x) { return op("math.tanh", x); }
  std::string sigmoid(const std::string &x) {
    return op("arith.divf", constF(1), op("arith.addf", constF(1), op("math.exp", op("arith.negf", x))));
  }
  std::string geluTanhInner(const std::string &x) { // tanh(k (x + a x^3))
    std::string x3 = op("arith.mulf", op("arith.mulf", x, x), x);
    std::string inner = op("arith.addf", x, op("arith.mulf", constF(0.044715), x3));
    return tanh(op("arith.mulf", constF(0.79788456080286536), inner));
  }

  const rt::RankProgram &r;
  const rt::Instruction &ins;
  std::ostringstream os;
  int counter = 0;
  int64_t V = 1; // elements per thread
};

} // namespace mlir::loom::kernelgen

#endif

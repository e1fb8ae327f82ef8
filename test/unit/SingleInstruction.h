//===- SingleInstruction.h - One instruction over fresh buffers -*- C++ -*-===//
//
// What the instruction-level tests share (CudaConvTest.cpp runs one on the
// GPU against the CPU, CpuLayoutTest.cpp one layout against the other): a
// rank program of a single instruction whose inputs and outputs are fresh
// 256-byte-aligned buffers of one dtype.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_TEST_UNIT_SINGLEINSTRUCTION_H
#define LOOM_TEST_UNIT_SINGLEINSTRUCTION_H

#include "loom/rt/Bundle.h"
#include "loom/rt/Tensor.h"

#include <string>
#include <utility>
#include <vector>

namespace loom::rt::test {

struct Operands {
  std::vector<Shape> in, out;
};

/// `op` over fresh buffers (inputs, then outputs), as the program "forward";
/// `ins` receives the instruction.
inline RankProgram programFor(const std::string &op, const Operands &o, loom_dtype_t dt, Instruction &ins,
                              nlohmann::json attrs) {
  RankProgram r;
  int64_t offset = 0;
  auto add = [&](const Shape &s, const char *kind) {
    Buffer b;
    b.id = int64_t(r.buffers.size());
    b.name = std::string(kind) + std::to_string(b.id);
    b.dtype = dt;
    b.shape = s;
    b.bytes = numElements(s).value() * int64_t(dtypeSize(dt));
    b.offset = offset;
    offset += (b.bytes + 255) / 256 * 256;
    r.buffers.push_back(b);
    return b.id;
  };
  ins = Instruction{op, {}, {}, std::move(attrs)};
  for (const Shape &s : o.in)
    ins.in.push_back(add(s, "in"));
  for (const Shape &s : o.out)
    ins.out.push_back(add(s, "out"));
  r.arenaBytes = offset;
  r.programs["forward"] = {ins};
  return r;
}

} // namespace loom::rt::test

#endif

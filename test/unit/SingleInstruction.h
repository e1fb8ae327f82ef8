//===- SingleInstruction.h - One instruction over fresh buffers -*- C++ -*-===//
//
// What the instruction-level tests share (CudaConvTest.cpp and
// CudaServeTest.cpp run instructions on the GPU against the CPU,
// CpuLayoutTest.cpp one layout against the other): rank programs over fresh
// 256-byte-aligned buffers, of one instruction or a few.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_TEST_UNIT_SINGLEINSTRUCTION_H
#define LOOM_TEST_UNIT_SINGLEINSTRUCTION_H

#include "loom/rt/Bundle.h"
#include "loom/rt/Tensor.h"
#include "runtime/src/Backend.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace loom::rt::test {

struct Operands {
  std::vector<Shape> in, out;
};

/// Buffers laid out one after another in a fresh arena, each at a 256-byte
/// boundary (plus `skew` bytes, to test unaligned operands).
struct ProgramBuilder {
  RankProgram rank;
  int64_t offset = 0;
  int64_t add(const Shape &s, loom_dtype_t dt, const std::string &kind = "b", int64_t skew = 0) {
    Buffer b;
    b.id = int64_t(rank.buffers.size());
    b.name = kind + std::to_string(b.id);
    b.dtype = dt;
    b.shape = s;
    b.bytes = numElements(s).value() * int64_t(dtypeSize(dt));
    b.offset = offset + skew;
    offset = (b.offset + b.bytes + 255) / 256 * 256;
    rank.buffers.push_back(b);
    return b.id;
  }
  /// The program "forward" over the buffers added so far.
  RankProgram finish(std::vector<Instruction> program) {
    rank.arenaBytes = offset;
    rank.programs["forward"] = std::move(program);
    return rank;
  }
};

/// Buffer b's bytes (f32 or bf16) holding value(i) at each element i.
template <typename F> std::vector<char> floatBytes(const Buffer &b, F value) {
  int64_t n = numElements(b.shape).value();
  std::vector<char> bytes(size_t(b.bytes));
  for (int64_t i = 0; i < n; ++i) {
    float v = value(i);
    if (b.dtype == LOOM_BF16) {
      uint16_t h = floatToBf16(v);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    }
  }
  return bytes;
}

/// Buffer b's elements (f32 or bf16) as floats, downloaded from `backend`:
/// what floatBytes uploads, read back.
template <typename Backend> std::vector<float> downloadFloats(Backend &backend, const Buffer &b) {
  size_t n = size_t(numElements(b.shape).value());
  std::vector<float> v(n);
  if (b.dtype == LOOM_BF16) {
    std::vector<uint16_t> bits(n);
    backend.download(b, bits.data());
    for (size_t i = 0; i < n; ++i)
      v[i] = bf16ToFloat(bits[i]);
  } else {
    backend.download(b, v.data());
  }
  return v;
}

/// `op` over fresh buffers (inputs, then outputs) of the given shapes and
/// dtypes, as the program "forward"; `ins` receives the instruction.
inline RankProgram programFor(const std::string &op, const std::vector<std::pair<Shape, loom_dtype_t>> &in,
                              const std::vector<std::pair<Shape, loom_dtype_t>> &out, Instruction &ins,
                              nlohmann::json attrs) {
  ProgramBuilder p;
  ins = Instruction{op, {}, {}, std::move(attrs)};
  for (const auto &[s, dt] : in)
    ins.in.push_back(p.add(s, dt, "in"));
  for (const auto &[s, dt] : out)
    ins.out.push_back(p.add(s, dt, "out"));
  return p.finish({ins});
}

/// The same, every buffer of one dtype.
inline RankProgram programFor(const std::string &op, const Operands &o, loom_dtype_t dt, Instruction &ins,
                              nlohmann::json attrs) {
  std::vector<std::pair<Shape, loom_dtype_t>> in, out;
  for (const Shape &s : o.in)
    in.push_back({s, dt});
  for (const Shape &s : o.out)
    out.push_back({s, dt});
  return programFor(op, in, out, ins, std::move(attrs));
}

/// Runs `op` alone (f32 operands of the given shapes) on the CPU backend with
/// `threads` threads over `inputs`; returns its outputs.
inline std::vector<std::vector<float>> runOnCpu(const std::string &op, const Operands &o, const nlohmann::json &attrs,
                                                const std::vector<std::vector<float>> &inputs, int threads = 2) {
  Instruction ins;
  RankProgram r = programFor(op, o, LOOM_F32, ins, attrs);
  auto cpu = makeCpuBackend(r, threads);
  for (size_t i = 0; i < ins.in.size(); ++i)
    cpu->upload(r.buffers[ins.in[i]], inputs[i].data());
  cpu->prepare("forward", {ins});
  cpu->run("forward");
  std::vector<std::vector<float>> outs;
  for (int64_t id : ins.out)
    outs.push_back(downloadFloats(*cpu, r.buffers[id]));
  return outs;
}

} // namespace loom::rt::test

#endif

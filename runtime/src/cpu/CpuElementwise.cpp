//===- CpuElementwise.cpp - Elementwise kernels ---------------------------===//
//
// Binary operations (with broadcasting) and unary activations, one kernel per
// instruction. The scalar functions come from Elementwise.h, which the fused
// evaluator (CpuFused.cpp) shares, so a fused chain computes what the unfused
// chain computes.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"
#include "runtime/src/Elementwise.h"

#include <cmath>

namespace loom::rt::cpu {

namespace {

template <typename Op> Kernel binary(const Ctx &c, Op op) {
  c.arity(2, 1);
  const Buffer &a = c.in(0), &b = c.in(1), &o = c.out();
  c.needF32(a), c.needF32(b), c.needF32(o);
  auto sa = broadcastStrides(a.shape, o.shape), sb = broadcastStrides(b.shape, o.shape);
  if (!sa || !sb)
    c.bad(cat("cannot broadcast ", shapeStr(a.shape), " and ", shapeStr(b.shape), " to ",
              shapeStr(o.shape)));
  float *pa = c.f32(a), *pb = c.f32(b), *po = c.f32(o);
  Shape shape = o.shape;
  std::vector<int64_t> stA = *sa, stB = *sb;
  if (a.shape == o.shape && b.shape == o.shape) {
    int64_t n = count(shape);
    ThreadPool *pool = &c.pool;
    return [=] {
      pool->parallelFor(n, 1.0, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          po[i] = op(pa[i], pb[i]);
      });
    };
  }
  // One operand of the result's shape, the other its trailing dimensions (a
  // bias, a position table): rows over the threads.
  auto trailing = [&](const Shape &s) {
    size_t lead = 0;
    while (lead < s.size() && s[lead] == 1)
      ++lead;
    return s.size() - lead <= shape.size() && std::equal(s.begin() + lead, s.end(), shape.end() - (s.size() - lead));
  };
  int64_t n = count(shape);
  bool fullA = a.shape == o.shape, fullB = b.shape == o.shape;
  if ((fullA && trailing(b.shape)) || (fullB && trailing(a.shape))) {
    int64_t inner = fullA ? count(b.shape) : count(a.shape);
    if (inner > 0 && n % inner == 0) {
      ThreadPool *pool = &c.pool;
      return [=] {
        pool->parallelFor(n / inner, double(inner), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            const float *ra = fullA ? pa + r * inner : pa, *rb = fullA ? pb : pb + r * inner;
            float *ro = po + r * inner;
            for (int64_t j = 0; j < inner; ++j)
              ro[j] = op(ra[j], rb[j]);
          }
        });
      };
    }
  }
  return [=] { forEachBroadcast(shape, stA, stB, [&](int64_t i, int64_t ia, int64_t ib) { po[i] = op(pa[ia], pb[ib]); }); };
}

/// `cost`: the rough work of one element, in multiply-adds, for whether
/// threads pay off (a tanh or an exp costs tens).
template <typename Op> Kernel unary(const Ctx &c, Op op, double cost = 1.0) {
  c.arity(1, 1);
  c.needF32(c.in(0)), c.needF32(c.out());
  c.sameShape(c.in(0), c.out());
  float *x = c.f32(c.in(0)), *y = c.f32(c.out());
  int64_t n = count(c.out().shape);
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(n, cost, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        y[i] = op(x[i]);
    });
  };
}

using ew::geluErf;
using ew::geluTanh;

LOOM_AVX2_CLONES void geluTanhRange(const float *__restrict x, float *__restrict y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i)
    y[i] = geluTanh(x[i]);
}

Kernel buildAdd(const Ctx &c) { return binary(c, [](float a, float b) { return a + b; }); }
Kernel buildSub(const Ctx &c) { return binary(c, [](float a, float b) { return a - b; }); }
Kernel buildMul(const Ctx &c) { return binary(c, [](float a, float b) { return a * b; }); }
Kernel buildDiv(const Ctx &c) { return binary(c, [](float a, float b) { return a / b; }); }
Kernel buildGelu(const Ctx &c) {
  if (!c.attrFlag("approximate")) // a lambda, not a function pointer: the loop inlines it
    return unary(c, [](float x) { return geluErf(x); }, 20.0);
  c.arity(1, 1);
  c.needF32(c.in(0)), c.needF32(c.out());
  c.sameShape(c.in(0), c.out());
  const float *x = c.f32(c.in(0));
  float *y = c.f32(c.out());
  int64_t n = count(c.out().shape);
  ThreadPool *pool = &c.pool;
  return [=] { pool->parallelFor(n, 20.0, [&](int64_t begin, int64_t end) { geluTanhRange(x, y, begin, end); }); };
}
Kernel buildRelu(const Ctx &c) { return unary(c, ew::relu); }
Kernel buildSilu(const Ctx &c) { return unary(c, ew::silu, 20.0); }
Kernel buildExp(const Ctx &c) { return unary(c, [](float x) { return std::exp(x); }, 20.0); }
Kernel buildTanh(const Ctx &c) { return unary(c, [](float x) { return std::tanh(x); }, 20.0); }
Kernel buildRsqrt(const Ctx &c) { return unary(c, ew::rsqrt); }
Kernel buildNeg(const Ctx &c) { return unary(c, [](float x) { return -x; }); }
Kernel buildScale(const Ctx &c) {
  float f = static_cast<float>(c.attrFloat("factor"));
  return unary(c, [f](float x) { return x * f; });
}

} // namespace

void registerElementwiseBuilders(BuilderTable &table) {
  table.insert({
      {"add", buildAdd},
      {"sub", buildSub},
      {"mul", buildMul},
      {"div", buildDiv},
      {"gelu", buildGelu},
      {"relu", buildRelu},
      {"silu", buildSilu},
      {"exp", buildExp},
      {"tanh", buildTanh},
      {"rsqrt", buildRsqrt},
      {"neg", buildNeg},
      {"scale", buildScale},
  });
}

} // namespace loom::rt::cpu

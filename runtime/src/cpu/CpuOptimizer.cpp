//===- CpuOptimizer.cpp - Optimizer steps ---------------------------------===//
//
// The step counter, the global gradient norm that clipping reads (summed
// over the ranks of a split model), and the AdamW and SGD updates with their
// learning-rate schedule.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"

#include <algorithm>
#include <cmath>

namespace loom::rt::cpu {

namespace {

Kernel buildStepIncrement(const Ctx &c) {
  c.arity(1, 1);
  if (c.ins.in[0] != c.ins.out[0] || count(c.in(0).shape) != 1)
    c.bad("updates the scalar step counter in place");
  c.needF32(c.in(0));
  float *step = c.f32(c.in(0));
  return [=] { *step += 1; };
}

/// Elements per partial sum of the global norm: the partial sums, and so the
/// result, do not depend on the number of threads.
constexpr int64_t kNormBlock = 1 << 15;

/// The sum of squares of x[0, n), in double.
double sumOfSquares(const float *x, int64_t n) {
  return sumInterleaved(n, [&](int64_t i) { return double(x[i]) * x[i]; });
}

/// AdamW's update of [begin, end), in double; a loop the compiler vectorises.
LOOM_AVX2_CLONES void adamwRange(float *__restrict p, const float *__restrict g, float *__restrict m,
                                 float *__restrict v, int64_t begin, int64_t end, double scale, double b1,
                                 double b2, double c1, double c2, double eps, double wd, double rate) {
  for (int64_t i = begin; i < end; ++i) {
    double gi = g[i] * scale;
    m[i] = static_cast<float>(b1 * m[i] + (1 - b1) * gi);
    v[i] = static_cast<float>(b2 * v[i] + (1 - b2) * gi * gi);
    double update = (m[i] / c1) / (std::sqrt(v[i] / c2) + eps) + wd * p[i];
    p[i] = static_cast<float>(p[i] - rate * update);
  }
}

Kernel buildGlobalNorm(const Ctx &c) {
  if (c.ins.out.size() != 1 || count(c.out().shape) != 1)
    c.bad("writes one scalar");
  c.needF32(c.out());
  std::vector<std::pair<float *, int64_t>> grads;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    c.needF32(c.in(i));
    grads.push_back({c.f32(c.in(i)), count(c.in(i).shape)});
  }
  // A model split over ranks: each rank sums the squares of the gradients it
  // counts ("skip" lists inputs another rank counts, such as replicas), and
  // the sums are added over "group".
  std::vector<bool> counted(grads.size(), true);
  if (c.ins.attrs.contains("skip"))
    for (int64_t i : c.attrInts("skip")) {
      if (i < 0 || i >= int64_t(grads.size()))
        c.bad(cat("skip names input ", i, " of ", grads.size()));
      counted[i] = false;
    }
  std::string groupName = attrString(c, "group", "");
  Communicator *comm = groupName.empty() ? nullptr : needComm(c);
  std::vector<int> group = groupName.empty() ? std::vector<int>() : groupOf(c, groupName);
  int rank = int(c.rank.rank);
  float *out = c.f32(c.out());
  // Blocks of the counted gradients, summed over the threads, then in order.
  std::vector<std::pair<const float *, int64_t>> blocks;
  for (size_t k = 0; k < grads.size(); ++k)
    if (counted[k])
      for (int64_t i = 0; i < grads[k].second; i += kNormBlock)
        blocks.push_back({grads[k].first + i, std::min(kNormBlock, grads[k].second - i)});
  ThreadPool *pool = &c.pool;
  return [=] {
    std::vector<double> partial(blocks.size());
    pool->parallelFor(int64_t(blocks.size()), double(kNormBlock), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        partial[b] = sumOfSquares(blocks[b].first, blocks[b].second);
    });
    double sum = 0;
    for (double s : partial)
      sum += s;
    if (comm) {
      float total = static_cast<float>(sum);
      comm->allReduce(rank, group, &total, 1, Reduction::Sum);
      sum = total;
    }
    *out = static_cast<float>(std::sqrt(sum));
  };
}

/// Learning rate at 0-based step t: linear warm-up, then cosine decay to
/// min_lr over total_steps (constant when total_steps is 0).
double scheduledRate(double lr, double minLr, double warmup, double total, double t) {
  if (warmup > 0 && t < warmup)
    return lr * (t + 1) / warmup;
  if (total <= 0)
    return lr;
  double progress = std::min(1.0, (t - warmup) / std::max(1.0, total - warmup));
  return minLr + 0.5 * (lr - minLr) * (1 + std::cos(M_PI * progress));
}

Kernel buildOptimizer(const Ctx &c, bool adam) {
  // adamw: (param, grad, m, v, step, norm) -> (param, m, v[, copy]), in place.
  // sgd:   (param, grad, momentum, step, norm) -> (param, momentum[, copy]), in place.
  // copy: the updated parameter again, as bf16 (loom-update-copies).
  size_t outs = adam ? 3 : 2;
  c.arity(adam ? 6 : 5, c.ins.out.size() == outs + 1 ? outs + 1 : outs);
  for (size_t i = 0; i < c.ins.in.size(); ++i)
    c.needF32(c.in(i));
  if (c.ins.out[0] != c.ins.in[0] || c.ins.out[1] != c.ins.in[2] || (adam && c.ins.out[2] != c.ins.in[3]))
    c.bad("updates the parameter and its state in place");
  for (size_t i = 1; i < (adam ? 4u : 3u); ++i)
    c.sameShape(c.in(0), c.in(i));
  // Written as bf16 here (the backend does not widen it: CpuBackend.cpp's
  // nativeOut), with the cast's rounding, by the threads that update.
  uint16_t *copy = nullptr;
  if (c.ins.out.size() == outs + 1) {
    if (c.out(outs).dtype != LOOM_BF16)
      c.bad(cat("copy '", c.out(outs).name, "' must be bf16, got ", dtypeName(c.out(outs).dtype)));
    c.sameShape(c.in(0), c.out(outs));
    copy = c.ptr<uint16_t>(c.out(outs));
  }
  auto writeCopy = [copy](const float *p, int64_t begin, int64_t end) {
    if (copy)
      for (int64_t i = begin; i < end; ++i)
        copy[i] = floatToBf16(p[i]);
  };
  double lr = c.attrFloat("lr"), minLr = c.attrFloat("min_lr", 0), wd = c.attrFloat("weight_decay", 0);
  double clip = c.attrFloat("clip", 0), warmup = c.attrFloat("warmup", 0), total = c.attrFloat("total_steps", 0);
  double b1 = adam ? c.attrFloat("beta1") : 0, b2 = adam ? c.attrFloat("beta2") : 0;
  double eps = adam ? c.attrFloat("eps") : 0, momentum = adam ? 0 : c.attrFloat("momentum", 0);
  int64_t n = count(c.in(0).shape);
  float *p = c.f32(c.in(0)), *g = c.f32(c.in(1)), *m = c.f32(c.in(2));
  float *v = adam ? c.f32(c.in(3)) : nullptr, *step = c.f32(c.in(adam ? 4 : 3));
  float *norm = c.f32(c.in(adam ? 5 : 4));
  ThreadPool *pool = &c.pool;
  return [=] {
    double t = *step; // already counts this step (1-based)
    double rate = scheduledRate(lr, minLr, warmup, total, t - 1);
    double scale = clip > 0 && *norm > clip ? clip / *norm : 1.0;
    if (adam) {
      double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
      pool->parallelFor(n, 20.0, [&](int64_t begin, int64_t end) {
        adamwRange(p, g, m, v, begin, end, scale, b1, b2, c1, c2, eps, wd, rate);
        writeCopy(p, begin, end);
      });
    } else {
      pool->parallelFor(n, 4.0, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          double gi = g[i] * scale + wd * p[i];
          m[i] = static_cast<float>(momentum * m[i] + gi);
          p[i] = static_cast<float>(p[i] - rate * m[i]);
        }
        writeCopy(p, begin, end);
      });
    }
  };
}
Kernel buildAdamW(const Ctx &c) { return buildOptimizer(c, true); }
Kernel buildSGD(const Ctx &c) { return buildOptimizer(c, false); }

} // namespace

void registerOptimizerBuilders(BuilderTable &table) {
  table.insert({
      {"step_increment", buildStepIncrement},
      {"global_norm", buildGlobalNorm},
      {"adamw", buildAdamW},
      {"sgd", buildSGD},
  });
}

} // namespace loom::rt::cpu

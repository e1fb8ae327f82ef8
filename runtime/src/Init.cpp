//===- Init.cpp - Deterministic parameter initialisation ------------------===//

#include "loom/rt/Init.h"
#include "loom/rt/Error.h"
#include "runtime/src/ThreadPool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace loom::rt {

namespace {

/// splitmix64, counter-based: its k-th output (k from 0) of a stream
/// started at `state` is a function of state and k alone, so a parameter's
/// values can be computed in parallel chunks and still be exactly the
/// sequential stream's.
constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/// The k-th uniform in [0, 1).
double uniformAt(uint64_t state, uint64_t k) { return (mix(state + (k + 1) * kGamma) >> 11) * (1.0 / 9007199254740992.0); }

/// fn(begin, end) over [0, n), on this machine's threads where n is large
/// (a billion-parameter model initialises in seconds, not a minute).
template <typename F> void parallelChunks(int64_t n, F fn) {
  if (n < (int64_t(1) << 20)) { // a pool's start costs more than small tensors take
    fn(int64_t(0), n);
    return;
  }
  ThreadPool pool(0);
  pool.parallelFor(n, /*cost=*/20, [&](int64_t begin, int64_t end) { fn(begin, end); });
}

/// store(i, value) for each of the parameter's `count` initial values.
template <typename Store>
void generate(const ParamInit &init, int64_t count, uint64_t seed, const std::string &name, Store store) {
  uint64_t h = 1469598103934665603ull ^ seed; // FNV-1a of the name, mixed with the seed
  for (char c : name)
    h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  if (init.kind == "ones" || init.kind == "constant" || init.kind == "zeros") {
    float v = init.kind == "ones" ? 1.0f : init.kind == "zeros" ? 0.0f : static_cast<float>(init.scale);
    parallelChunks(count, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        store(i, v);
    });
  } else if (init.kind == "uniform") {
    parallelChunks(count, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        store(i, static_cast<float>((2 * uniformAt(h, uint64_t(i)) - 1) * init.scale));
    });
  } else if (init.kind == "normal") {
    parallelChunks((count + 1) / 2, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) { // Box-Muller, two values from draws 2j and 2j + 1
        double u1 = 1.0 - uniformAt(h, uint64_t(2 * j)), u2 = uniformAt(h, uint64_t(2 * j + 1));
        double r = std::sqrt(-2.0 * std::log(u1)) * init.scale;
        store(2 * j, static_cast<float>(r * std::cos(2 * M_PI * u2)));
        if (2 * j + 1 < count)
          store(2 * j + 1, static_cast<float>(r * std::sin(2 * M_PI * u2)));
      }
    });
  } else {
    fail(LOOM_INVALID_BUNDLE, "parameter '", name, "' has an unknown initializer '", init.kind, "'");
  }
}

} // namespace

std::vector<float> initialValues(const ParamInit &init, int64_t count, uint64_t seed,
                                 const std::string &name) {
  std::vector<float> out(static_cast<size_t>(std::max<int64_t>(count, 0)), 0.0f);
  generate(init, count, seed, name, [&](int64_t i, float v) { out[size_t(i)] = v; });
  return out;
}

void initialiseInto(const ParamInit &init, const Buffer &b, uint64_t seed, const std::string &name,
                    char *dst) {
  int64_t count = numElements(b.shape).value_or(0);
  switch (b.dtype) {
  case LOOM_F32:
    generate(init, count, seed, name, [&](int64_t i, float v) { reinterpret_cast<float *>(dst)[i] = v; });
    break;
  case LOOM_F64:
    generate(init, count, seed, name, [&](int64_t i, float v) { reinterpret_cast<double *>(dst)[i] = v; });
    break;
  case LOOM_BF16:
    generate(init, count, seed, name, [&](int64_t i, float v) { reinterpret_cast<uint16_t *>(dst)[i] = floatToBf16(v); });
    break;
  default:
    fail(LOOM_UNSUPPORTED, "cannot initialise parameter '", name, "' of type ", dtypeName(b.dtype));
  }
}

} // namespace loom::rt

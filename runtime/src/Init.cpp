//===- Init.cpp - Deterministic parameter initialisation ------------------===//

#include "loom/rt/Init.h"
#include "loom/rt/Error.h"

#include <algorithm>
#include <cmath>

namespace loom::rt {

namespace {
/// splitmix64: a small, well-mixed generator.
struct SplitMix {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); } // [0, 1)
};
} // namespace

std::vector<float> initialValues(const ParamInit &init, int64_t count, uint64_t seed,
                                 const std::string &name) {
  std::vector<float> out(static_cast<size_t>(count), 0.0f);
  uint64_t h = 1469598103934665603ull ^ seed; // FNV-1a of the name, mixed with the seed
  for (char c : name)
    h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  SplitMix rng{h};
  if (init.kind == "ones" || init.kind == "constant") {
    std::fill(out.begin(), out.end(), static_cast<float>(init.kind == "ones" ? 1.0 : init.scale));
  } else if (init.kind == "uniform") {
    for (float &v : out)
      v = static_cast<float>((2 * rng.uniform() - 1) * init.scale);
  } else if (init.kind == "normal") {
    for (size_t i = 0; i < out.size(); i += 2) { // Box-Muller, two values per draw
      double u1 = 1.0 - rng.uniform(), u2 = rng.uniform();
      double r = std::sqrt(-2.0 * std::log(u1)) * init.scale;
      out[i] = static_cast<float>(r * std::cos(2 * M_PI * u2));
      if (i + 1 < out.size())
        out[i + 1] = static_cast<float>(r * std::sin(2 * M_PI * u2));
    }
  } else if (init.kind != "zeros") {
    fail(LOOM_INVALID_BUNDLE, "parameter '", name, "' has an unknown initializer '", init.kind, "'");
  }
  return out;
}

void initialiseInto(const ParamInit &init, const Buffer &b, uint64_t seed, const std::string &name,
                    char *dst) {
  int64_t count = numElements(b.shape).value_or(0);
  std::vector<float> values = initialValues(init, count, seed, name);
  for (int64_t i = 0; i < count; ++i) {
    switch (b.dtype) {
    case LOOM_F32: reinterpret_cast<float *>(dst)[i] = values[i]; break;
    case LOOM_F64: reinterpret_cast<double *>(dst)[i] = values[i]; break;
    case LOOM_BF16: reinterpret_cast<uint16_t *>(dst)[i] = floatToBf16(values[i]); break;
    default:
      fail(LOOM_UNSUPPORTED, "cannot initialise parameter '", name, "' of type ", dtypeName(b.dtype));
    }
  }
}

} // namespace loom::rt

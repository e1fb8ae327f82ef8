//===- loom-compare.cpp - Compare two safetensors files -------------------===//
//
// usage: loom-compare A.safetensors B.safetensors [--tolerance T]
//
// For every tensor in both files, prints the relative error
// ||a - b||_2 / ||b||_2 and exits 1 if any exceeds the tolerance (default
// 1e-5), or if the files hold different tensors.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

using namespace loom::rt;

static double at(const SafetensorsFile &f, const SafetensorsEntry &e, int64_t i) {
  return loadAsDouble(e.dtype, f.data.data() + e.offset, i);
}

int main(int argc, char **argv) {
  if (argc < 3 || !std::strcmp(argv[1], "--help")) {
    std::fprintf(argc < 3 ? stderr : stdout,
                 "usage: loom-compare A.safetensors B.safetensors [--tolerance T]\n");
    return argc < 3 ? 1 : 0;
  }
  double tolerance = 1e-5;
  if (argc == 5 && !std::strcmp(argv[3], "--tolerance"))
    tolerance = std::atof(argv[4]);
  try {
    SafetensorsFile a = readSafetensors(argv[1]), b = readSafetensors(argv[2]);
    bool ok = a.tensors.size() == b.tensors.size();
    for (auto &[name, ea] : a.tensors) {
      auto it = b.tensors.find(name);
      if (it == b.tensors.end() || it->second.shape != ea.shape) {
        std::printf("%s: missing or differently shaped in %s\n", name.c_str(), argv[2]);
        ok = false;
        continue;
      }
      int64_t n = numElements(ea.shape).value_or(0);
      double diff = 0, ref = 0;
      for (int64_t i = 0; i < n; ++i) {
        double x = at(a, ea, i), y = at(b, it->second, i);
        diff += (x - y) * (x - y);
        ref += y * y;
      }
      double rel = std::sqrt(diff / std::max(ref, 1e-300));
      bool pass = rel <= tolerance;
      ok &= pass;
      std::printf("%s %s: relative error %.3g (tolerance %.3g)\n", pass ? "ok  " : "FAIL", name.c_str(),
                  rel, tolerance);
    }
    return ok ? 0 : 1;
  } catch (const std::bad_alloc &) {
    std::fprintf(stderr, "loom-compare: error: out of host memory\n");
    return 1;
  } catch (const std::exception &e) { // Error, and anything else: never std::terminate
    std::fprintf(stderr, "loom-compare: error: %s\n", e.what());
    return 1;
  }
}

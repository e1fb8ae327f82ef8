//===- loom-run.cpp - Run a bundle ----------------------------------------===//
//
// loom-run OUT.loom [--input F.safetensors] [--output F.safetensors]
//                   [--steps N] [--threads T] [--seed S]
//
// Binds inputs from a safetensors file (or synthetic ones: token ids drawn
// below each input's limit, floats from N(0, 1)), runs the forward pass
// --steps times after one warm-up, and prints each output's summary and the
// time per step.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/Error.h"
#include "runtime/src/Safetensors.h"
#include "runtime/src/Session.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

using namespace loom::rt;

namespace {
void usage(FILE *to) {
  std::fprintf(to,
               "usage: loom-run BUNDLE [options]\n\n"
               "Runs the forward pass of a bundle written by `loomc compile` and prints its\n"
               "outputs and timing.\n\n"
               "  --input F.safetensors   inputs by name (default: synthetic inputs)\n"
               "  --output F.safetensors  write the outputs there\n"
               "  --steps N               timed runs after one warm-up (default 1)\n"
               "  --threads T             CPU threads (default: all)\n"
               "  --seed S                seed for synthetic inputs (default 0)\n");
}

double valueAt(const Buffer &b, const char *p, int64_t i) {
  switch (b.dtype) {
  case LOOM_F32: return reinterpret_cast<const float *>(p)[i];
  case LOOM_F64: return reinterpret_cast<const double *>(p)[i];
  case LOOM_BF16: return bf16ToFloat(reinterpret_cast<const uint16_t *>(p)[i]);
  case LOOM_I32: return reinterpret_cast<const int32_t *>(p)[i];
  case LOOM_I64: return static_cast<double>(reinterpret_cast<const int64_t *>(p)[i]);
  default: return NAN;
  }
}

void fillSynthetic(Session &s, const NamedBuffer &nb, std::mt19937_64 &rng) {
  const Buffer &b = s.rank().buffers[nb.buffer];
  int64_t n = numElements(b.shape).value_or(0);
  std::vector<char> data(b.bytes);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < n; ++i) {
    switch (b.dtype) {
    case LOOM_F32: reinterpret_cast<float *>(data.data())[i] = normal(rng); break;
    case LOOM_I32: reinterpret_cast<int32_t *>(data.data())[i] = int32_t(rng() % uint64_t(nb.limit > 0 ? nb.limit : 2)); break;
    case LOOM_I64: reinterpret_cast<int64_t *>(data.data())[i] = int64_t(rng() % uint64_t(nb.limit > 0 ? nb.limit : 2)); break;
    default: fail(LOOM_UNSUPPORTED, "no synthetic data for ", dtypeName(b.dtype), " input '", nb.name, "'");
    }
  }
  s.bindInput(nb.name, data.data(), data.size());
}

int run(int argc, char **argv) {
  std::string bundle, input, output;
  int steps = 1, threads = 0;
  uint64_t seed = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc)
        fail(LOOM_INVALID_ARGUMENT, a, " needs a value");
      return argv[++i];
    };
    auto number = [&]() -> long long {
      std::string v = value();
      char *end = nullptr;
      long long n = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end || n < 0)
        fail(LOOM_INVALID_ARGUMENT, a, " needs a non-negative integer, got '", v, "'");
      return n;
    };
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else if (a == "--input") {
      input = value();
    } else if (a == "--output") {
      output = value();
    } else if (a == "--steps") {
      steps = static_cast<int>(number());
    } else if (a == "--threads") {
      threads = static_cast<int>(number());
    } else if (a == "--seed") {
      seed = static_cast<uint64_t>(number());
    } else if (!a.empty() && a[0] == '-') {
      fail(LOOM_INVALID_ARGUMENT, "unknown option '", a, "' (see --help)");
    } else if (bundle.empty()) {
      bundle = a;
    } else {
      fail(LOOM_INVALID_ARGUMENT, "more than one bundle given ('", bundle, "' and '", a, "')");
    }
  }
  if (bundle.empty()) {
    usage(stderr);
    return 1;
  }

  SessionOptions options;
  options.threads = threads;
  Session s(bundle, options);
  const RankProgram &r = s.rank();
  std::printf("%s: model %s, batch %lld, %zu parameter tensors, arena %.1f MiB (activations %.1f MiB)\n",
              bundle.c_str(), s.manifest().model.c_str(), (long long)s.manifest().batch, r.params.size(),
              r.arenaBytes / 1048576.0, r.peakActivationBytes / 1048576.0);

  if (!input.empty()) {
    SafetensorsFile in = readSafetensors(input);
    for (const NamedBuffer &nb : r.inputs) {
      auto it = in.tensors.find(nb.name);
      if (it == in.tensors.end())
        fail(LOOM_INVALID_ARGUMENT, input, ": has no tensor for input '", nb.name, "'");
      const Buffer &b = r.buffers[nb.buffer];
      if (it->second.dtype != b.dtype || it->second.shape != b.shape)
        fail(LOOM_INVALID_ARGUMENT, input, ": input '", nb.name, "' is ", dtypeName(it->second.dtype),
             shapeStr(it->second.shape), " but the bundle expects ", dtypeName(b.dtype), shapeStr(b.shape));
      s.bindInput(nb.name, in.data.data() + it->second.offset, it->second.bytes);
    }
  } else {
    std::mt19937_64 rng(seed);
    for (const NamedBuffer &nb : r.inputs)
      fillSynthetic(s, nb, rng);
  }

  s.runForward(); // warm-up
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i)
    s.runForward();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  std::vector<SafetensorsTensorRef> refs;
  for (const NamedBuffer &nb : r.outputs) {
    const Buffer &b = r.buffers[nb.buffer];
    const char *p = s.data(b);
    int64_t n = numElements(b.shape).value_or(0);
    double sum = 0, sq = 0, mn = INFINITY, mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
      double v = valueAt(b, p, i);
      sum += v, sq += v * v, mn = std::min(mn, v), mx = std::max(mx, v);
    }
    double mean = n ? sum / n : 0;
    std::printf("output %s: %s%s mean %.6g std %.6g min %.6g max %.6g first [", nb.name.c_str(),
                dtypeName(b.dtype), shapeStr(b.shape).c_str(), mean,
                std::sqrt(std::max(0.0, n ? sq / n - mean * mean : 0)), mn, mx);
    for (int64_t i = 0; i < std::min<int64_t>(n, 4); ++i)
      std::printf(i ? ", %.6g" : "%.6g", valueAt(b, p, i));
    std::printf("]\n");
    refs.push_back({nb.name, b.dtype, b.shape, p, static_cast<size_t>(b.bytes)});
  }
  if (steps > 0)
    std::printf("forward: %.3f ms per step over %d steps (after 1 warm-up)\n", ms / steps, steps);
  if (!output.empty()) {
    writeSafetensors(output, refs);
    std::printf("wrote %s\n", output.c_str());
  }
  return 0;
}
} // namespace

int main(int argc, char **argv) {
  try {
    return run(argc, argv);
  } catch (const Error &e) {
    std::fprintf(stderr, "loom-run: error: %s\n", e.what());
    return 1;
  } catch (const std::exception &e) {
    std::fprintf(stderr, "loom-run: internal error: %s\n", e.what());
    return 2;
  }
}

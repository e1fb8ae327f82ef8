//===- CudnnConv.cpp - cuDNN's convolutions and their gradients -----------===//
//
// cuDNN's convolution API (cudnnConvolutionForward, ...BackwardData,
// ...BackwardFilter) with descriptors made once per instruction and the
// algorithm chosen by timing (cudnnFind*AlgorithmEx's candidates, timed
// again by fastestCandidate) once per shape. f32
// tensors with TF32 off ask for FMA-only algorithms (CUDNN_FMA_MATH), so
// LOOM_CUDA_TF32=0 means full f32 products here as in the GEMMs.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudnnConv.h"

#include "loom/rt/Error.h"
#include "runtime/src/TuningCache.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#ifdef LOOM_HAVE_CUDNN
#include <cudnn.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#endif

namespace loom::rt::cudnn {

float timeRuns(const std::function<bool()> &launch, int rounds, int runs) {
  struct Events {
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Events() {
      if (start)
        cudaEventDestroy(start);
      if (stop)
        cudaEventDestroy(stop);
    }
  } ev;
  if (cudaEventCreate(&ev.start) != cudaSuccess || cudaEventCreate(&ev.stop) != cudaSuccess || !launch()) {
    cudaDeviceSynchronize(); // nothing of a failed candidate left running
    cudaGetLastError();
    return -1;
  }
  float best = -1;
  for (int r = 0; r < rounds; ++r) {
    bool ok = cudaEventRecord(ev.start, nullptr) == cudaSuccess;
    for (int i = 0; i < runs && ok; ++i)
      ok = launch();
    float ms = 0;
    ok = ok && cudaEventRecord(ev.stop, nullptr) == cudaSuccess && cudaEventSynchronize(ev.stop) == cudaSuccess &&
         cudaEventElapsedTime(&ms, ev.start, ev.stop) == cudaSuccess;
    if (!ok) {
      cudaDeviceSynchronize();
      cudaGetLastError();
      return -1;
    }
    if (best < 0 || ms / runs < best)
      best = ms / runs;
  }
  return best;
}

int fastestCandidate(int count, const std::function<bool(int)> &launch, float &ms) {
  std::vector<std::pair<float, int>> once; // (a run's time, candidate)
  for (int i = 0; i < count; ++i)
    if (float t = timeRuns([&] { return launch(i); }, 1, 2); t >= 0)
      once.push_back({t, i});
  if (once.empty())
    return -1;
  std::sort(once.begin(), once.end());
  constexpr size_t kFinalists = 6;
  int best = -1;
  for (size_t j = 0; j < once.size() && j < kFinalists && once[j].first <= 1.5f * once[0].first; ++j) {
    auto [t1, i] = once[j];
    int runs = t1 < 0.1f ? 5 : t1 < 1.0f ? 2 : 1; // a round of about half a millisecond or one run
    float t = timeRuns([&] { return launch(i); }, 3, runs);
    if (t >= 0 && (best < 0 || t < ms))
      best = i, ms = t;
  }
  return best;
}

#ifndef LOOM_HAVE_CUDNN

bool convolutionCompiledIn() { return false; }

std::unique_ptr<Convolution> buildConvolution(const ConvGeometry &, ConvPass, const void *, const void *,
                                              std::string &why) {
  why = "this runtime was built without cuDNN (cudnn.h and libcudnn were not found)";
  return nullptr;
}

cudnnContext *handleForCurrentDevice(std::string &why) {
  why = "this runtime was built without cuDNN";
  return nullptr;
}

#else

bool convolutionCompiledIn() { return true; }

cudnnHandle_t handleForCurrentDevice(std::string &why) {
  static std::mutex mutex;
  static std::map<int, cudnnHandle_t> handles;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    why = "no current CUDA device";
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mutex);
  auto it = handles.find(device);
  if (it != handles.end())
    return it->second;
  cudnnHandle_t h = nullptr;
  if (cudnnStatus_t s = cudnnCreate(&h); s != CUDNN_STATUS_SUCCESS) {
    why = std::string("cudnnCreate failed: ") + cudnnGetErrorString(s);
    return nullptr;
  }
  handles[device] = h;
  return h;
}

namespace {

std::string failed(const char *what, cudnnStatus_t s) { return std::string(what) + " failed: " + cudnnGetErrorString(s); }
#define LOOM_CUDNN_TRY(expr)                                                                                   \
  do {                                                                                                         \
    if (cudnnStatus_t s_ = (expr); s_ != CUDNN_STATUS_SUCCESS)                                                 \
      return failed(#expr, s_);                                                                                \
  } while (0)

/// The algorithm chosen for a shape and pass: the same for every
/// convolution of that shape on the device, so it is timed once.
struct Choice {
  int algo = 0;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t workspace = 0;
  float ms = 0; // as timed by timeRuns
};
using ChoiceKey = std::tuple<int, int, bool, bool, std::vector<int64_t>>;

/// A perf result usable here: it ran, and with TF32 off it used FMA only.
template <typename Perf> bool usable(const Perf &p, bool fmaOnly) {
  return p.status == CUDNN_STATUS_SUCCESS && (!fmaOnly || p.mathType == CUDNN_FMA_MATH);
}

class CudnnConvolution final : public Convolution {
public:
  CudnnConvolution(cudnnHandle_t handle, ConvPass pass) : handle(handle), pass(pass) {}
  ~CudnnConvolution() override {
    if (x)
      cudnnDestroyTensorDescriptor(x);
    if (y)
      cudnnDestroyTensorDescriptor(y);
    if (w)
      cudnnDestroyFilterDescriptor(w);
    if (conv)
      cudnnDestroyConvolutionDescriptor(conv);
  }

  /// Descriptors for `g`; "" or what failed.
  std::string describe(const ConvGeometry &g) {
    cudnnDataType_t type = g.bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
    LOOM_CUDNN_TRY(cudnnCreateTensorDescriptor(&x));
    LOOM_CUDNN_TRY(cudnnCreateTensorDescriptor(&y));
    LOOM_CUDNN_TRY(cudnnCreateFilterDescriptor(&w));
    LOOM_CUDNN_TRY(cudnnCreateConvolutionDescriptor(&conv));
    // Sizes are given as n, c, h, w whatever the format; NHWC filters are
    // [o, kh, kw, c / groups].
    cudnnTensorFormat_t format = g.nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
    LOOM_CUDNN_TRY(cudnnSetTensor4dDescriptor(x, format, type, int(g.n), int(g.c), int(g.h), int(g.w)));
    LOOM_CUDNN_TRY(cudnnSetTensor4dDescriptor(y, format, type, int(g.n), int(g.o), int(g.ho), int(g.wo)));
    LOOM_CUDNN_TRY(cudnnSetFilter4dDescriptor(w, type, format, int(g.o), int(g.c / g.groups), int(g.kh), int(g.kw)));
    // Products accumulate in f32 for both dtypes.
    LOOM_CUDNN_TRY(cudnnSetConvolution2dDescriptor(conv, int(g.pad), int(g.pad), int(g.stride), int(g.stride), 1, 1,
                                                   CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    LOOM_CUDNN_TRY(cudnnSetConvolutionGroupCount(conv, int(g.groups)));
    fmaOnly = !g.bf16 && !g.tf32;
    LOOM_CUDNN_TRY(cudnnSetConvolutionMathType(
        conv, fmaOnly ? CUDNN_FMA_MATH : g.bf16 ? CUDNN_TENSOR_OP_MATH : CUDNN_DEFAULT_MATH));
    return "";
  }

  /// Times cuDNN's algorithms on a and b, writing into a scratch result of
  /// `outBytes`, and keeps the fastest usable one; "" or what failed.
  std::string find(const void *a, const void *b, size_t outBytes) {
    void *out = nullptr, *scratch = nullptr;
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess)
      return "cudaMemGetInfo failed";
    // Algorithms that need more workspace than this are not tried.
    size_t scratchBytes = std::min<size_t>(size_t(1) << 30, free / 4);
    if (cudaMalloc(&out, std::max<size_t>(outBytes, 1)) != cudaSuccess ||
        cudaMalloc(&scratch, std::max<size_t>(scratchBytes, 1)) != cudaSuccess) {
      cudaFree(out);
      cudaGetLastError();
      return "out of device memory for timing cuDNN's convolution algorithms";
    }
    std::string error = findInto(a, b, out, scratch, scratchBytes);
    cudaFree(out);
    cudaFree(scratch);
    return error;
  }

  std::string apply(const Choice &c) {
    choice = c;
    LOOM_CUDNN_TRY(cudnnSetConvolutionMathType(conv, c.math));
    return "";
  }
  const Choice &chosen() const { return choice; }

  size_t workspaceBytes() const override { return choice.workspace; }

  std::string run(const void *a, const void *b, void *out, void *workspace, cudaStream_t stream) const override {
    const float one = 1, zero = 0;
    LOOM_CUDNN_TRY(cudnnSetStream(handle, stream));
    switch (pass) {
    case ConvPass::Forward:
      LOOM_CUDNN_TRY(cudnnConvolutionForward(handle, &one, x, a, w, b, conv, cudnnConvolutionFwdAlgo_t(choice.algo),
                                             workspace, choice.workspace, &zero, y, out));
      break;
    case ConvPass::GradInput:
      LOOM_CUDNN_TRY(cudnnConvolutionBackwardData(handle, &one, w, b, y, a, conv,
                                                  cudnnConvolutionBwdDataAlgo_t(choice.algo), workspace,
                                                  choice.workspace, &zero, x, out));
      break;
    case ConvPass::GradFilter:
      LOOM_CUDNN_TRY(cudnnConvolutionBackwardFilter(handle, &one, x, a, y, b, conv,
                                                    cudnnConvolutionBwdFilterAlgo_t(choice.algo), workspace,
                                                    choice.workspace, &zero, w, out));
      break;
    }
    return "";
  }

private:
  /// The fastest of cudnnFind's first usable candidates, timed again by
  /// fastestCandidate (cudnnFind's order is that of one run each).
  template <typename Perf>
  std::string pick(const Perf *perf, int count, const char *what, const void *a, const void *b, void *out,
                   void *scratch) {
    constexpr size_t kCandidates = 4;
    std::vector<Choice> candidates;
    for (int i = 0; i < count && candidates.size() < kCandidates; ++i)
      if (usable(perf[i], fmaOnly))
        candidates.push_back({int(perf[i].algo), perf[i].mathType, perf[i].memory, perf[i].time});
    float ms = 0;
    int best = fastestCandidate(int(candidates.size()), [&](int i) {
      return apply(candidates[size_t(i)]).empty() && run(a, b, out, scratch, nullptr).empty();
    }, ms);
    if (best >= 0) {
      candidates[size_t(best)].ms = ms;
      return apply(candidates[size_t(best)]);
    }
    return std::string("cuDNN has no ") + what + " algorithm for this shape" +
           (fmaOnly ? " without TF32 (LOOM_CUDA_TF32=0)" : "");
  }

  std::string findInto(const void *a, const void *b, void *out, void *scratch, size_t scratchBytes) {
    constexpr int kMax = 16;
    int count = 0;
    LOOM_CUDNN_TRY(cudnnSetStream(handle, nullptr));
    switch (pass) {
    case ConvPass::Forward: {
      cudnnConvolutionFwdAlgoPerf_t perf[kMax];
      LOOM_CUDNN_TRY(cudnnFindConvolutionForwardAlgorithmEx(handle, x, a, w, b, conv, y, out, kMax, &count, perf,
                                                            scratch, scratchBytes));
      return pick(perf, count, "convolution forward", a, b, out, scratch);
    }
    case ConvPass::GradInput: {
      cudnnConvolutionBwdDataAlgoPerf_t perf[kMax];
      LOOM_CUDNN_TRY(cudnnFindConvolutionBackwardDataAlgorithmEx(handle, w, b, y, a, conv, x, out, kMax, &count,
                                                                 perf, scratch, scratchBytes));
      return pick(perf, count, "convolution input-gradient", a, b, out, scratch);
    }
    case ConvPass::GradFilter: {
      cudnnConvolutionBwdFilterAlgoPerf_t perf[kMax];
      LOOM_CUDNN_TRY(cudnnFindConvolutionBackwardFilterAlgorithmEx(handle, x, a, y, b, conv, w, out, kMax, &count,
                                                                   perf, scratch, scratchBytes));
      return pick(perf, count, "convolution filter-gradient", a, b, out, scratch);
    }
    }
    return "unknown convolution pass";
  }

  cudnnHandle_t handle;
  ConvPass pass;
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  bool fmaOnly = false;
  Choice choice;
};

/// A convolution shared by every instruction of its shape (a frontend
/// graph holds no pointers).
class SharedConvolution final : public Convolution {
public:
  explicit SharedConvolution(std::shared_ptr<Convolution> impl) : impl(std::move(impl)) {}
  size_t workspaceBytes() const override { return impl->workspaceBytes(); }
  std::string run(const void *a, const void *b, void *out, void *workspace, cudaStream_t stream) const override {
    return impl->run(a, b, out, workspace, stream);
  }

private:
  std::shared_ptr<Convolution> impl;
};

/// What was chosen on one device. Each device has its own table and lock,
/// so ranks on different GPUs time their convolutions at the same time
/// (with one lock for all they took turns).
struct Table {
  std::mutex mutex;
  std::map<ChoiceKey, Choice> choices;
  // bf16: the frontend graph where it timed faster than the legacy choice
  // (null: the legacy one), shared by every convolution of the shape.
  std::map<ChoiceKey, std::shared_ptr<Convolution>> graphs;
  // Shapes neither way could run, with the reason: not timed again.
  std::map<ChoiceKey, std::string> failures;
  // What a kept choice (TuningCache) depends on besides the pass and the
  // shape: cuDNN's and its frontend's versions and the device's name; ""
  // when the device cannot be described (nothing is kept then).
  std::string keptDevice;
};

Table &tableOf(int device) {
  static std::mutex tablesMutex;
  static std::map<int, std::unique_ptr<Table>> tables;
  std::lock_guard<std::mutex> lock(tablesMutex);
  std::unique_ptr<Table> &t = tables[device];
  if (!t) {
    t = std::make_unique<Table>();
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess)
      t->keptDevice = loom::rt::cat("cudnn ", cudnnGetVersion(), " frontend ", frontendVersion(), " | ", prop.name,
                                    " sm", prop.major, prop.minor);
    else
      cudaGetLastError();
  }
  return *t;
}

/// The key of a kept choice: the device's part, the pass, the dtypes and
/// the geometry.
std::string keptChoiceKey(const std::string &device, const ConvGeometry &g, ConvPass pass) {
  static const char *passes[] = {"forward", "grad-input", "grad-filter"};
  return loom::rt::cat("conv2d ", passes[int(pass)], " | ", device, " | ",
                       g.bf16 ? "bf16" : g.tf32 ? "f32 tf32" : "f32", g.nhwc ? " nhwc" : " nchw", " | x ", g.n, "x",
                       g.c, "x", g.h, "x", g.w, " filter ", g.o, "x", g.c / g.groups, "x", g.kh, "x", g.kw, " y ",
                       g.ho, "x", g.wo, " stride ", g.stride, " pad ", g.pad, " groups ", g.groups);
}

/// `v[name]` as an integer in [lo, hi], else nullopt (a kept file is read
/// as untrusted: a value out of range is timed again, not used).
std::optional<int64_t> keptInt(const nlohmann::json &v, const char *name, int64_t lo, int64_t hi) {
  auto it = v.find(name);
  if (it == v.end() || !it->is_number_integer())
    return std::nullopt;
  int64_t x = it->get<int64_t>();
  return x >= lo && x <= hi ? std::optional<int64_t>(x) : std::nullopt;
}

/// The convolution an earlier process chose (`kept`, from the tuning
/// cache), where it is still valid here: a frontend graph's engine rebuilt
/// (bf16 with graphs wanted), or the legacy API's algorithm applied to
/// `conv`; recorded in `t` under `key`. Null when it is not usable (the
/// shape is then timed again).
std::unique_ptr<Convolution> useKept(Table &t, const ChoiceKey &key, const nlohmann::json &kept,
                                     const ConvGeometry &g, ConvPass pass, const void *a, const void *b,
                                     bool tryGraph, std::unique_ptr<CudnnConvolution> &conv) {
  if (!kept.is_object())
    return nullptr;
  auto api = kept.find("api");
  std::string which = api != kept.end() && api->is_string() ? api->get<std::string>() : "";
  if (which == "graph" && tryGraph) {
    auto engine = kept.find("engine");
    auto plan = keptInt(kept, "plan", 0, 1 << 20);
    if (!plan || engine == kept.end() || !engine->is_string())
      return nullptr;
    EngineChoice ec{*plan, engine->get<std::string>()};
    float ms = 0;
    std::string why;
    std::shared_ptr<Convolution> graph = buildGraphConvolution(g, pass, a, b, ms, why, ec);
    if (!graph)
      return nullptr;
    t.graphs[key] = graph;
    return std::make_unique<SharedConvolution>(graph);
  }
  if (which != "legacy")
    return nullptr;
  int algoCount = pass == ConvPass::Forward     ? int(CUDNN_CONVOLUTION_FWD_ALGO_COUNT)
                  : pass == ConvPass::GradInput ? int(CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT)
                                                : int(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT);
  auto algo = keptInt(kept, "algo", 0, algoCount - 1);
  auto math = keptInt(kept, "math", CUDNN_DEFAULT_MATH, CUDNN_FMA_MATH);
  auto bytes = keptInt(kept, "workspace", 0, int64_t(1) << 30);
  bool fmaOnly = !g.bf16 && !g.tf32;
  if (!algo || !math || !bytes || (fmaOnly && *math != CUDNN_FMA_MATH))
    return nullptr;
  Choice c{int(*algo), cudnnMathType_t(*math), size_t(*bytes), 0};
  if (!conv->apply(c).empty())
    return nullptr;
  t.choices[key] = c;
  if (tryGraph)
    t.graphs[key] = nullptr;
  return std::move(conv);
}

} // namespace

std::unique_ptr<Convolution> buildConvolution(const ConvGeometry &g, ConvPass pass, const void *a, const void *b,
                                              std::string &why) {
  cudnnHandle_t handle = handleForCurrentDevice(why);
  if (!handle)
    return nullptr;
  auto conv = std::make_unique<CudnnConvolution>(handle, pass);
  if (why = conv->describe(g); !why.empty())
    return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  ChoiceKey key{device, int(pass), g.bf16, g.tf32,
                {g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.ho, g.wo, g.stride, g.pad, g.groups, int64_t(g.nhwc)}};
  Table &table = tableOf(device);
  auto &[mutex, choices, graphs, failures, keptDevice] = table;
  std::lock_guard<std::mutex> lock(mutex);
  static const bool graphsWanted = [] {
    const char *e = std::getenv("LOOM_CUDNN_CONV_GRAPH");
    return !(e && std::string(e) == "0");
  }();
  bool tryGraph = g.bf16 && graphsWanted;
  if (auto it = failures.find(key); it != failures.end()) {
    why = it->second;
    return nullptr;
  }
  if (auto it = graphs.find(key); tryGraph && it != graphs.end() && it->second)
    return std::make_unique<SharedConvolution>(it->second);
  if (auto it = choices.find(key); it != choices.end()) {
    why = conv->apply(it->second);
  } else {
    // A choice an earlier process timed (LOOM_TUNING_CACHE), used where it
    // is still valid here; timed again otherwise.
    TuningCache &cache = TuningCache::process();
    std::string keptKey = keptDevice.empty() ? "" : keptChoiceKey(keptDevice, g, pass);
    if (std::optional<nlohmann::json> kept = keptKey.empty() ? std::nullopt : cache.lookup(keptKey))
      if (std::unique_ptr<Convolution> used = useKept(table, key, *kept, g, pass, a, b, tryGraph, conv))
        return used;
    int64_t outElements = pass == ConvPass::Forward     ? g.n * g.o * g.ho * g.wo
                          : pass == ConvPass::GradInput ? g.n * g.c * g.h * g.w
                                                        : g.o * (g.c / g.groups) * g.kh * g.kw;
    why = conv->find(a, b, size_t(outElements) * (g.bf16 ? 2 : 4));
    if (why.empty())
      choices[key] = conv->chosen();
    if (why.empty() && std::getenv("LOOM_CUDNN_VERBOSE")) { // which algorithm cuDNN chose, for measurements
      const Choice &c = conv->chosen();
      static const char *passes[] = {"forward", "input gradient", "filter gradient"};
      std::fprintf(stderr,
                   "cuDNN convolution %s (x %lldx%lldx%lldx%lld, filter %lldx%lldx%lldx%lld, stride %lld, pad %lld, "
                   "groups %lld, %s, %s): algorithm %d, math type %d, workspace %zu bytes, %.3f ms\n",
                   passes[int(pass)], (long long)g.n, (long long)g.c, (long long)g.h, (long long)g.w,
                   (long long)g.o, (long long)(g.c / g.groups), (long long)g.kh, (long long)g.kw,
                   (long long)g.stride, (long long)g.pad, (long long)g.groups,
                   g.bf16 ? "bf16" : g.tf32 ? "f32, TF32" : "f32", g.nhwc ? "NHWC" : "NCHW", c.algo, int(c.math),
                   c.workspace, c.ms);
    }
    if (tryGraph) {
      float graphMs = 0;
      std::string graphWhy;
      EngineChoice ec;
      std::shared_ptr<Convolution> graph = buildGraphConvolution(g, pass, a, b, graphMs, graphWhy, ec);
      bool faster = graph && (!why.empty() || graphMs < conv->chosen().ms);
      if (std::getenv("LOOM_CUDNN_VERBOSE"))
        std::fprintf(stderr, "  as a frontend graph: %s\n",
                     graph ? (std::to_string(graphMs) + " ms" + (faster ? ", kept" : "")).c_str() : graphWhy.c_str());
      graphs[key] = faster ? graph : nullptr;
      if (faster) {
        why.clear();
        if (!keptKey.empty())
          cache.store(keptKey, {{"api", "graph"}, {"plan", ec.plan}, {"engine", ec.engine}, {"ms", graphMs}});
        return std::make_unique<SharedConvolution>(graph);
      }
    }
    if (why.empty() && !keptKey.empty()) {
      const Choice &c = conv->chosen();
      cache.store(keptKey, {{"api", "legacy"}, {"algo", c.algo}, {"math", int(c.math)}, {"workspace", c.workspace},
                            {"ms", c.ms}});
    }
  }
  if (!why.empty()) {
    if (!choices.count(key))
      failures[key] = why;
    return nullptr;
  }
  return conv;
}

#endif

} // namespace loom::rt::cudnn

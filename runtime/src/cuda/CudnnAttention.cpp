//===- CudnnAttention.cpp - cuDNN's fused attention for bf16 SDPA ---------===//
//
// Host code only (the frontend is header-only C++ over cuDNN's backend
// API), compiled by the C++ compiler apart from the CUDA sources so that
// the frontend's headers cost one translation unit.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudnnAttention.h"
#include "runtime/src/cuda/CudnnConv.h" // the shared cuDNN handle

#ifdef LOOM_HAVE_CUDNN_FRONTEND
#include <cudnn_frontend.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>
#endif

namespace loom::rt::cudnn {

#ifndef LOOM_HAVE_CUDNN_FRONTEND

bool compiledIn() { return false; }

std::unique_ptr<Attention> build(const flash::Params &, bool, std::string &why, bool) {
  why = "this runtime was built without cuDNN's frontend headers (scripts/deps.sh fetches them)";
  return nullptr;
}

#else

namespace fe = cudnn_frontend;

namespace {

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

/// [B, heads, S, D] over rows of `ld` elements (a head's D columns side by side).
std::vector<int64_t> bhsd(int64_t b, int64_t heads, int64_t s, int64_t d) { return {b, heads, s, d}; }
std::vector<int64_t> strides(int64_t s, int64_t d, int64_t ld) { return {s * ld, d, ld, 1}; }

/// One of cuDNN's graphs for a shape and layout (it holds no pointers),
/// shared by every attention of that shape: built once per process and
/// device, or the reason it could not be (not tried again).
struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  size_t workspace = 0;
  std::string error;
};

/// Builds the forward or backward graph into `out`; "" or why not.
std::string make(const flash::Params &p, cudnnHandle_t handle, bool backward, bool deterministic, Built &out) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  int64_t B = p.batch, H = p.heads, KV = p.kvHeads, S = p.s, T = p.t, D = p.headDim;
  int64_t ldq = p.ldq ? p.ldq : H * D, ldk = p.ldk ? p.ldk : KV * D;
  auto tensor = [&](const char *name, Uid uid, std::vector<int64_t> dim, std::vector<int64_t> stride) {
    return g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
  };
  auto q = tensor("q", kQ, bhsd(B, H, S, D), strides(S, D, ldq));
  auto k = tensor("k", kK, bhsd(B, KV, T, D), strides(T, D, ldk));
  auto v = tensor("v", kV, bhsd(B, KV, T, D), strides(T, D, ldk));
  // Our convention: query i sees keys j <= i + (T - S), cuDNN's bottom-right diagonal.
  bool topLeft = S == T;
  if (!backward) {
    auto options = fe::graph::SDPA_attributes().set_name("loom_sdpa").set_generate_stats(true).set_attn_scale(p.scale);
    if (p.causal)
      topLeft ? options.set_causal_mask(true) : options.set_causal_mask_bottom_right(true);
    auto [o, stats] = g->sdpa(q, k, v, options);
    o->set_output(true).set_uid(kO).set_dim(bhsd(B, H, S, D)).set_stride(strides(S, D, H * D));
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
  } else {
    auto o = tensor("o", kO, bhsd(B, H, S, D), strides(S, D, H * D));
    auto dO = tensor("dO", kDO, bhsd(B, H, S, D), strides(S, D, H * D));
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(kStats)
                               .set_dim({B, H, S, 1})
                               .set_stride({H * S, S, 1, 1})
                               .set_data_type(fe::DataType_t::FLOAT));
    auto options = fe::graph::SDPA_backward_attributes().set_name("loom_sdpa_backward").set_attn_scale(p.scale);
    if (deterministic)
      options.set_deterministic_algorithm(true);
    if (p.causal)
      topLeft ? options.set_causal_mask(true) : options.set_causal_mask_bottom_right(true);
    auto [dQ, dK, dV] = g->sdpa_backward(q, k, v, o, dO, stats, options);
    int64_t lddq = p.lddq ? p.lddq : H * D, lddk = p.lddk ? p.lddk : KV * D;
    dQ->set_output(true).set_uid(kDQ).set_dim(bhsd(B, H, S, D)).set_stride(strides(S, D, lddq));
    dK->set_output(true).set_uid(kDK).set_dim(bhsd(B, KV, T, D)).set_stride(strides(T, D, lddk));
    dV->set_output(true).set_uid(kDV).set_dim(bhsd(B, KV, T, D)).set_stride(strides(T, D, lddk));
  }
  if (auto e = g->build(handle, {fe::HeurMode_t::A}); e.is_bad())
    return e.get_message();
  int64_t bytes = 0;
  if (auto e = g->get_workspace_size(bytes); e.is_bad())
    return e.get_message();
  out.workspace = size_t(bytes);
  if (std::getenv("LOOM_CUDNN_VERBOSE")) { // which engine cuDNN chose, for measurements
    std::string name;
    if (g->get_plan_name(name).is_bad())
      name = "(unnamed)";
    std::fprintf(stderr, "cuDNN attention %s (B=%lld H=%lld KV=%lld S=%lld T=%lld D=%lld%s): plan %s, workspace %lld bytes\n",
                 backward ? "backward" : "forward", (long long)B, (long long)H, (long long)KV, (long long)S,
                 (long long)T, (long long)D, p.causal ? ", causal" : "", name.c_str(), (long long)bytes);
  }
  out.graph = g;
  return "";
}

class CudnnAttention final : public Attention {
public:
  CudnnAttention(const flash::Params &p, cudnnHandle_t handle, std::shared_ptr<const Built> fwd,
                 std::shared_ptr<const Built> bwd)
      : p(p), handle(handle), fwd(std::move(fwd)), bwd(std::move(bwd)) {}

  size_t workspaceBytes() const override { return std::max(fwd->workspace, bwd ? bwd->workspace : 0); }

  std::string forward(void *o, float *stats, void *ws, cudaStream_t stream) override {
    std::unordered_map<int64_t, void *> pack = {{kQ, const_cast<void *>(p.q)},
                                                {kK, const_cast<void *>(p.k)},
                                                {kV, const_cast<void *>(p.v)},
                                                {kO, o},
                                                {kStats, stats}};
    return run(*fwd->graph, pack, ws, stream);
  }

  std::string backward(const void *o, const float *stats, const void *dO, void *dQ, void *dK, void *dV, void *ws,
                       cudaStream_t stream) override {
    if (!bwd)
      return "built for the forward only";
    std::unordered_map<int64_t, void *> pack = {
        {kQ, const_cast<void *>(p.q)},   {kK, const_cast<void *>(p.k)},       {kV, const_cast<void *>(p.v)},
        {kO, const_cast<void *>(o)},     {kStats, const_cast<float *>(stats)}, {kDO, const_cast<void *>(dO)},
        {kDQ, dQ},                       {kDK, dK},                            {kDV, dV}};
    return run(*bwd->graph, pack, ws, stream);
  }

private:
  std::string run(const fe::graph::Graph &g, std::unordered_map<int64_t, void *> &pack, void *ws,
                  cudaStream_t stream) {
    if (cudnnStatus_t s = cudnnSetStream(handle, stream); s != CUDNN_STATUS_SUCCESS)
      return std::string("cudnnSetStream failed: ") + cudnnGetErrorString(s);
    if (auto e = g.execute(handle, pack, ws); e.is_bad())
      return e.get_message();
    return "";
  }

  flash::Params p;
  cudnnHandle_t handle;
  std::shared_ptr<const Built> fwd, bwd;
};

} // namespace

bool compiledIn() { return true; }

std::unique_ptr<Attention> build(const flash::Params &p, bool backward, std::string &why, bool deterministic) {
  if (cudnnGetVersion() < 90000) {
    why = "cuDNN " + std::to_string(cudnnGetVersion()) + " is older than 9";
    return nullptr;
  }
  cudnnHandle_t handle = handleForCurrentDevice(why);
  if (!handle)
    return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  // Everything a graph depends on (not the pointers); the forward's not the
  // gradients' layouts, so a forward and its backward share the forward.
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, float, int64_t, int64_t,
                         int64_t, int64_t, bool, bool>;
  auto keyOf = [&](bool bwd) {
    return Key(device, p.batch, p.s, p.t, p.heads, p.kvHeads, p.headDim, p.causal, p.scale, p.ldq, p.ldk,
               bwd ? p.lddq : 0, bwd ? p.lddk : 0, bwd, bwd && deterministic);
  };
  static std::mutex mutex;
  static std::map<Key, std::shared_ptr<Built>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto ensure = [&](bool bwd) {
    std::shared_ptr<Built> &built = cache[keyOf(bwd)];
    if (!built) {
      built = std::make_shared<Built>();
      try {
        if (std::string e = make(p, handle, bwd, deterministic, *built); !e.empty())
          built->error = std::string("cuDNN has no ") + (bwd ? "backward" : "forward") + " engine: " + e;
      } catch (const std::exception &e) {
        built->error = std::string("cuDNN's frontend failed: ") + e.what();
      }
    }
    return built;
  };
  std::shared_ptr<Built> fwd = ensure(false), bwd = backward ? ensure(true) : nullptr;
  for (const auto &b : {fwd, bwd})
    if (b && !b->error.empty()) {
      why = b->error;
      return nullptr;
    }
  return std::make_unique<CudnnAttention>(p, handle, fwd, bwd);
}

#endif

} // namespace loom::rt::cudnn

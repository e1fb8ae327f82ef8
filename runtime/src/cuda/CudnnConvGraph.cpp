//===- CudnnConvGraph.cpp - Convolutions as cuDNN frontend graphs ---------===//
//
// cuDNN's convolution API (CudnnConv.cpp) reaches only its legacy
// algorithms; the engines cuDNN has for channels-last bf16 on Hopper are
// behind its graph API. On an H200 (ResNet-50, batch 32, 2026-11-27) the
// legacy API's fastest NHWC bf16 choices were two to three times slower
// than its NCHW ones for most shapes, some of them without tensor cores.
// Here each convolution pass is a one-node graph (conv_fprop, conv_dgrad or
// conv_wgrad), its engines from heuristics A and the fallback list built and
// timed on the real operands (fastestCandidate: the frontend's autotune
// times a plan by one or two single runs), the fastest kept.
// Host code only, compiled with the frontend's headers apart from the rest.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudnnConv.h"

#ifdef LOOM_HAVE_CUDNN_FRONTEND
#include <cudnn_frontend.h>

#include <cstdio>
#include <cstdlib>
#include <unordered_map>
#include <vector>
#endif

namespace loom::rt::cudnn {

#ifndef LOOM_HAVE_CUDNN_FRONTEND

std::unique_ptr<Convolution> buildGraphConvolution(const ConvGeometry &, ConvPass, const void *, const void *,
                                                   float &, std::string &why, EngineChoice &) {
  why = "this runtime was built without cuDNN's frontend headers";
  return nullptr;
}

int frontendVersion() { return 0; }

#else

namespace fe = cudnn_frontend;

namespace {

enum Uid : int64_t { kA = 1, kB, kOut };

/// Dims [n, c, h, w] with strides for NCHW or NHWC storage.
std::vector<int64_t> stridesOf(int64_t c, int64_t h, int64_t w, bool nhwc) {
  return nhwc ? std::vector<int64_t>{h * w * c, 1, w * c, c} : std::vector<int64_t>{c * h * w, h * w, w, 1};
}

class GraphConvolution final : public Convolution {
public:
  GraphConvolution(cudnnHandle_t handle, std::shared_ptr<fe::graph::Graph> graph, int64_t plan, size_t workspace)
      : handle(handle), graph(std::move(graph)), plan(plan), workspace(workspace) {}

  size_t workspaceBytes() const override { return workspace; }

  std::string run(const void *a, const void *b, void *out, void *ws, cudaStream_t stream) const override {
    std::unordered_map<int64_t, void *> pack = {{kA, const_cast<void *>(a)}, {kB, const_cast<void *>(b)}, {kOut, out}};
    if (cudnnStatus_t s = cudnnSetStream(handle, stream); s != CUDNN_STATUS_SUCCESS)
      return std::string("cudnnSetStream failed: ") + cudnnGetErrorString(s);
    if (auto e = graph->execute_plan_at_index(handle, pack, ws, plan); e.is_bad())
      return e.get_message();
    return "";
  }

private:
  cudnnHandle_t handle;
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t plan; // the index of the engine chosen
  size_t workspace;
};

#define LOOM_FE_TRY(expr)                                                                                       \
  do {                                                                                                          \
    if (auto e_ = (expr); e_.is_bad())                                                                          \
      return std::string(#expr) + ": " + e_.get_message();                                                     \
  } while (0)

/// Builds the graph of `g` and `pass` and times each of its engines on a
/// and b (results into a scratch buffer), choosing the fastest, or builds
/// only the engine `choice` names when its plan is >= 0; "" or why not.
std::string make(const ConvGeometry &g, ConvPass pass, const void *a, const void *b, cudnnHandle_t handle,
                 std::shared_ptr<fe::graph::Graph> &out, EngineChoice &choice, size_t &workspace, float &ms) {
  auto graph = std::make_shared<fe::graph::Graph>();
  fe::DataType_t io = g.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::FLOAT;
  graph->set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(
      fe::DataType_t::FLOAT);
  // The convolution's three tensors; each pass reads two (a, b) and writes
  // the third (ConvPass: x, filter -> y; dy, filter -> dx; x, dy -> dfilter).
  struct Layout {
    const char *name;
    std::vector<int64_t> dim, stride;
    size_t elements() const { return size_t(dim[0] * dim[1] * dim[2] * dim[3]); }
  };
  int64_t cg = g.c / g.groups;
  Layout x{"x", {g.n, g.c, g.h, g.w}, stridesOf(g.c, g.h, g.w, g.nhwc)},
      y{"y", {g.n, g.o, g.ho, g.wo}, stridesOf(g.o, g.ho, g.wo, g.nhwc)},
      w{"w", {g.o, cg, g.kh, g.kw}, stridesOf(cg, g.kh, g.kw, g.nhwc)};
  const Layout &la = pass == ConvPass::GradInput ? y : x, &lb = pass == ConvPass::GradFilter ? y : w,
               &lo = pass == ConvPass::Forward ? y : pass == ConvPass::GradInput ? x : w;
  auto tensor = [&](const Layout &l, Uid uid) {
    return graph->tensor(
        fe::graph::Tensor_attributes().set_name(l.name).set_uid(uid).set_dim(l.dim).set_stride(l.stride));
  };
  auto ta = tensor(la, kA), tb = tensor(lb, kB);
  std::vector<int64_t> pad{g.pad, g.pad}, stride{g.stride, g.stride}, dilation{1, 1};
  std::shared_ptr<fe::graph::Tensor_attributes> result =
      pass == ConvPass::Forward
          ? graph->conv_fprop(ta, tb, fe::graph::Conv_fprop_attributes().set_padding(pad).set_stride(stride).set_dilation(dilation))
      : pass == ConvPass::GradInput
          ? graph->conv_dgrad(ta, tb, fe::graph::Conv_dgrad_attributes().set_padding(pad).set_stride(stride).set_dilation(dilation))
          : graph->conv_wgrad(tb, ta, fe::graph::Conv_wgrad_attributes().set_padding(pad).set_stride(stride).set_dilation(dilation));
  result->set_dim(lo.dim).set_stride(lo.stride);
  size_t outElements = lo.elements();
  result->set_output(true).set_uid(kOut).set_data_type(io);
  LOOM_FE_TRY(graph->validate());
  LOOM_FE_TRY(graph->build_operation_graph(handle));
  LOOM_FE_TRY(graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}));
  LOOM_FE_TRY(graph->check_support(handle));
  if (choice.plan >= 0) { // kept from an earlier process (TuningCache)
    std::string name;
    if (choice.plan >= graph->get_execution_plan_count() ||
        graph->get_plan_name_at_index(choice.plan, name).is_bad() || name != choice.engine)
      return "the kept engine " + choice.engine + " is not this cuDNN's plan " + std::to_string(choice.plan);
    LOOM_FE_TRY(graph->build_plan_at_index(handle, choice.plan));
    int64_t bytes = 0;
    LOOM_FE_TRY(graph->get_workspace_size_plan_at_index(choice.plan, bytes));
    out = graph;
    workspace = size_t(bytes);
    return "";
  }
  LOOM_FE_TRY(graph->build_plans(handle, fe::BuildPlanPolicy_t::ALL));
  // Timed on the real operands into a scratch result. Device memory is
  // released whatever fails (the frontend may also throw).
  struct Device {
    void *p = nullptr;
    ~Device() { cudaFree(p); }
  } scratch, ws;
  size_t tuneBytes = size_t(std::max<int64_t>(graph->get_autotune_workspace_size(), 1));
  size_t outBytes = outElements * (g.bf16 ? 2 : 4);
  if (cudaMalloc(&scratch.p, std::max<size_t>(outBytes, 1)) != cudaSuccess ||
      cudaMalloc(&ws.p, tuneBytes) != cudaSuccess) {
    cudaGetLastError();
    return "out of device memory for timing cuDNN's convolution engines";
  }
  std::unordered_map<int64_t, void *> pack = {
      {kA, const_cast<void *>(a)}, {kB, const_cast<void *>(b)}, {kOut, scratch.p}};
  if (cudnnStatus_t st = cudnnSetStream(handle, nullptr); st != CUDNN_STATUS_SUCCESS)
    return std::string("cudnnSetStream failed: ") + cudnnGetErrorString(st);
  std::vector<int64_t> plans, needs; // the engines built, and their workspaces
  for (int64_t i = 0; i < graph->get_execution_plan_count(); ++i)
    if (int64_t need = 0; graph->get_workspace_size_plan_at_index(i, need).is_good() && size_t(need) <= tuneBytes)
      plans.push_back(i), needs.push_back(need);
  int best = fastestCandidate(int(plans.size()), [&](int i) {
    return graph->execute_plan_at_index(handle, pack, ws.p, plans[size_t(i)]).is_good();
  }, ms);
  if (best < 0)
    return "none of the frontend's engines ran";
  choice.plan = plans[size_t(best)];
  int64_t bytes = needs[size_t(best)];
  if (graph->get_plan_name_at_index(choice.plan, choice.engine).is_bad())
    choice.engine.clear();
  if (std::getenv("LOOM_CUDNN_VERBOSE")) // which engine, for measurements
    std::fprintf(stderr, "  frontend engine %s of %lld: %.4f ms\n", choice.engine.c_str(),
                 (long long)graph->get_execution_plan_count(), ms);
  out = graph;
  workspace = size_t(bytes);
  return "";
}

} // namespace

int frontendVersion() { return CUDNN_FRONTEND_VERSION; }

std::unique_ptr<Convolution> buildGraphConvolution(const ConvGeometry &g, ConvPass pass, const void *a,
                                                   const void *b, float &ms, std::string &why,
                                                   EngineChoice &choice) {
  if (g.groups != 1) {
    why = "grouped convolutions take the legacy API";
    return nullptr;
  }
  cudnnHandle_t handle = handleForCurrentDevice(why);
  if (!handle)
    return nullptr;
  std::shared_ptr<fe::graph::Graph> graph;
  size_t workspace = 0;
  try {
    why = make(g, pass, a, b, handle, graph, choice, workspace, ms);
  } catch (const std::exception &e) {
    why = std::string("cuDNN's frontend failed: ") + e.what();
  }
  if (!why.empty())
    return nullptr;
  return std::make_unique<GraphConvolution>(handle, graph, choice.plan, workspace);
}

#endif

} // namespace loom::rt::cudnn

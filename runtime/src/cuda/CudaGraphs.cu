//===- CudaGraphs.cu - Launching programs, eagerly or as CUDA graphs -------===//
//
// A program's steps launch one by one (timed per step under --profile)
// until its second run, which captures them into a CUDA graph that later
// runs replay in one launch; a program whose capture fails stays eager.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <cstdio>
#include <cstdlib>

namespace loom::rt::cuda {

void CudaBackendImpl::dropGraphs() {
  for (auto &[name, g] : graphs)
    if (g.exec)
      cudaGraphExecDestroy(g.exec), g.exec = nullptr;
}

bool CudaBackendImpl::graphsWanted() {
  static const bool on = [] {
    return !envIs("LOOM_CUDA_GRAPHS", "0");
  }();
  return on;
}

bool CudaBackendImpl::traceGraphs() {
  static const bool on = [] {
    return envIs("LOOM_CUDA_TRACE_GRAPHS", "1");
  }();
  return on;
}

void CudaBackendImpl::recordTraceEvent(cudaEvent_t &event, cudaStream_t s, bool capturing) {
  if (!event)
    LOOM_CUDA_CHECK(cudaEventCreate(&event));
  // Inside a capture an external event becomes a node that each replay records.
  LOOM_CUDA_CHECK(capturing ? cudaEventRecordWithFlags(event, s, cudaEventRecordExternal) : cudaEventRecord(event, s));
}

void CudaBackendImpl::launchEager(std::vector<Step> &steps) {
  bool timed = profiling || tracing;
  for (Step &step : steps) {
    if (timed)
      recordTraceEvent(step.start, stream, false);
    step.launch(stream);
    cudaError_t e = cudaPeekAtLastError();
    if (e != cudaSuccess)
      fail(LOOM_INTERNAL, step.what, ": kernel launch failed: ", cudaGetErrorString(e));
    // A trace ends work handed to another stream where that stream finishes
    // it (its start is when the compute stream had its inputs ready); the
    // profile keeps timing the compute stream's part.
    if (timed)
      recordTraceEvent(step.end, tracing && step.traceStream ? step.traceStream : stream, false);
    if (step.communicated)
      LOOM_CUDA_CHECK(cudaEventRecord(step.communicated, step.traceStream ? step.traceStream : stream));
  }
}

bool CudaBackendImpl::captureAndLaunch(const std::string &program, std::vector<Step> &steps, Graph &g) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    g.disabled = true;
    return false;
  }
  bool launched = true;
  try {
    for (Step &step : steps) {
      if (tracing) // LOOM_CUDA_TRACE_GRAPHS=1
        recordTraceEvent(step.start, stream, true);
      step.launch(stream);
      if (tracing)
        recordTraceEvent(step.end, step.traceStream ? step.traceStream : stream, true);
    }
  } catch (const Error &) {
    launched = false;
  }
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamEndCapture(stream, &graph);
  if (launched && e == cudaSuccess && graph && cudaGraphInstantiate(&g.exec, graph, 0) == cudaSuccess &&
      cudaGraphLaunch(g.exec, stream) == cudaSuccess) {
    cudaGraphDestroy(graph);
    return true;
  }
  if (graph)
    cudaGraphDestroy(graph);
  if (g.exec)
    cudaGraphExecDestroy(g.exec), g.exec = nullptr;
  cudaError_t why = cudaGetLastError(); // the failed capture's error is not the program's
  // Said once a program: it stays eager, slower but correct.
  std::fprintf(stderr, "loom: warning: rank %lld: capturing program '%s' as a CUDA graph failed (%s); it runs "
               "without one\n", (long long)rank.rank, program.c_str(),
               cudaGetErrorString(why != cudaSuccess ? why : e != cudaSuccess ? e : cudaErrorUnknown));
  g.disabled = true;
  return false;
}

} // namespace loom::rt::cuda

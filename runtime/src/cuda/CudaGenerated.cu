//===- CudaGenerated.cu - Launching the compiler's generated kernels -------===//
//
// The bundle's kernels.ptx (JIT-compiled by the driver when the backend is
// made): fused elementwise chains, and the norms, their gradients, softmaxes
// and cross-entropy the compiler wrote a kernel for, each checked against the
// launch shape and alignment it was compiled for.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <cstdlib>

namespace loom::rt::cuda {

bool generatedKernelsOn() {
  static const bool on = [] {
    return !envIs("LOOM_CUDA_GENERATED", "0");
  }();
  return on;
}

void launchGenerated(cudaKernel_t fn, unsigned grid, unsigned block, std::vector<void *> pointers,
                            cudaStream_t s) {
  std::vector<void *> args;
  for (void *&p : pointers)
    args.push_back(&p);
  LOOM_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void *>(fn), dim3(grid), dim3(block), args.data(), 0, s));
}

/// The generated kernel an instruction names (attrs "kernel") in kernels.ptx,
/// or the one named that plus `suffix` (an instruction of several kernels).
cudaKernel_t CudaBackendImpl::generatedKernel(const Instruction &ins, const char *suffix) {
  std::string name = ins.attrs.value("kernel", std::string()) + suffix;
  if (!kernelsLibrary)
    fail(LOOM_INVALID_BUNDLE, where, ": the bundle has no kernels.ptx for kernel '", name, "'");
  cudaKernel_t fn = nullptr;
  if (cudaError_t e = cudaLibraryGetKernel(&fn, kernelsLibrary, name.c_str()); e != cudaSuccess)
    fail(LOOM_INVALID_BUNDLE, where, ": kernels.ptx has no kernel '", name, "' (", cudaGetErrorName(e), ")");
  return fn;
}

/// Vector loads and stores need 16-byte aligned tensors (the compiler places
/// every buffer at a multiple of 64 bytes); a bundle that does not is refused.
void CudaBackendImpl::requireVectorAligned(std::initializer_list<const std::vector<int64_t> *> lists, int64_t vector) {
  if (vector > 1)
    for (const std::vector<int64_t> *ids : lists)
      for (int64_t id : *ids)
        if (buf(id).offset % 16)
          fail(LOOM_INVALID_BUNDLE, where, ": buffer '", buf(id).name, "' at offset ", buf(id).offset,
               " is not 16-byte aligned, which the kernel's vector loads need");
}

/// A norm or softmax over rows of the last axis, by the compiler's kernel:
/// a warp per row, `vector` elements per load (parameters: the inputs, then
/// the output).
Launch CudaBackendImpl::buildRowKernel(const Instruction &ins) {
  cudaKernel_t fn = generatedKernel(ins);
  const Buffer &x = buf(ins.in[0]);
  if (x.shape.empty() || ins.out.size() != 1)
    fail(LOOM_INVALID_BUNDLE, where, ": a row kernel needs an input of rank >= 1 and one output");
  int64_t h = x.shape.back(), rows = count(x.shape) / std::max<int64_t>(h, 1);
  const nlohmann::json launch = ins.attrs.value("launch", nlohmann::json::object());
  unsigned block = launch.value("block", 0u), grid = launch.value("grid", 0u);
  int64_t vector = launch.value("vector", int64_t(1));
  if (block != 256 || uint64_t(grid) * 8 < uint64_t(rows) || vector < 1 || h % (32 * vector))
    fail(LOOM_INVALID_BUNDLE, where, ": row kernel launch ", grid, " x ", block, " (vector ", vector,
         ") does not give each of ", rows, " rows of ", h, " a warp");
  requireVectorAligned({&ins.in, &ins.out}, vector);
  std::vector<void *> pointers;
  for (const std::vector<int64_t> *ids : {&ins.in, &ins.out})
    for (int64_t id : *ids)
      pointers.push_back(ptr(buf(id)));
  return [=](cudaStream_t s) { launchGenerated(fn, grid, block, pointers, s); };
}

/// A norm's gradient by the compiler's two kernels (KernelGenNormGrad.cpp):
/// the rows (dx, and each block's column sums of dy * x-hat and dy into its
/// row of a partial table in the workspace), then the parameters' gradients
/// as the column sums of that table.
Launch CudaBackendImpl::buildNormGradKernel(const Instruction &ins) {
  cudaKernel_t rowsFn = generatedKernel(ins);
  bool rms = ins.op == "rmsnorm_grad";
  const Buffer &x = buf(ins.in[0]);
  if (x.shape.empty() || (ins.in.size() != 3 && ins.in.size() != 4) || ins.out.size() != (rms ? 2u : 3u))
    fail(LOOM_INVALID_BUNDLE, where, ": a norm gradient takes x, gamma, dy (and the residual's gradient) and writes dx ",
         "and gamma's", rms ? "" : " and beta's", " gradients");
  int64_t h = x.shape.back(), rows = count(x.shape) / std::max<int64_t>(h, 1);
  const nlohmann::json launch = ins.attrs.value("launch", nlohmann::json::object());
  unsigned block = launch.value("block", 0u), grid = launch.value("grid", 0u);
  int64_t vector = launch.value("vector", int64_t(1)), perBlock = launch.value("rows", int64_t(0));
  if (block == 0 || block % 32 || block > 256 || grid == 0 || perBlock < int64_t(block / 32) ||
      uint64_t(grid) * uint64_t(perBlock) < uint64_t(rows) || vector < 1 || h % (32 * vector))
    fail(LOOM_INVALID_BUNDLE, where, ": norm gradient launch ", grid, " x ", block, " (", perBlock,
         " rows a block, vector ", vector, ") does not cover ", rows, " rows of ", h);
  std::vector<int64_t> rowsOf = {ins.in[0], ins.in[2], ins.out[0]};
  if (ins.in.size() == 4)
    rowsOf.push_back(ins.in[3]);
  requireVectorAligned({&rowsOf}, vector);
  cudaKernel_t sumFn = generatedKernel(ins, "_sum");
  int64_t width = (rms ? 1 : 2) * h;
  reserve(size_t(grid) * size_t(width) * sizeof(float));
  std::vector<void *> pointers;
  for (int64_t id : ins.in)
    pointers.push_back(ptr(buf(id)));
  pointers.push_back(ptr(buf(ins.out[0])));
  void *dg = ptr(buf(ins.out[1])), *db = rms ? nullptr : ptr(buf(ins.out[2]));
  unsigned sumGrid = unsigned((width + 31) / 32);
  return [=](cudaStream_t s) {
    std::vector<void *> args = pointers;
    args.push_back(workspace);
    launchGenerated(rowsFn, grid, block, args, s);
    if (db)
      launchGenerated(sumFn, sumGrid, 1024, {workspace, dg, db}, s);
    else
      launchGenerated(sumFn, sumGrid, 1024, {workspace, dg}, s);
  };
}

/// The cross-entropy loss or its gradient by the compiler's kernel (a block
/// per row). The loss kernel writes each row's loss to the workspace, which
/// our mean kernel averages; a bad target raises the error word as ours do.
Launch CudaBackendImpl::buildCrossEntropyKernel(const Instruction &ins) {
  cudaKernel_t fn = generatedKernel(ins);
  bool grad = ins.op == "cross_entropy_grad";
  const Buffer &logits = buf(ins.in[0]);
  if (logits.shape.empty() || ins.in.size() != (grad ? 3u : 2u) || ins.out.size() != 1)
    fail(LOOM_INVALID_BUNDLE, where, ": takes logits, targets", grad ? ", dloss" : "", " and writes one tensor");
  int64_t vocab = logits.shape.back(), rows = count(buf(ins.in[1]).shape);
  const nlohmann::json launch = ins.attrs.value("launch", nlohmann::json::object());
  unsigned block = launch.value("block", 0u), grid = launch.value("grid", 0u);
  int64_t vector = launch.value("vector", int64_t(1));
  if (block != 256 || int64_t(grid) != rows || vector < 1 || vocab % vector || rows * vocab != count(logits.shape))
    fail(LOOM_INVALID_BUNDLE, where, ": cross-entropy kernel launch ", grid, " x ", block, " (vector ", vector,
         ") does not match ", rows, " rows of ", vocab);
  std::vector<int64_t> vectors = {ins.in[0], ins.out[0]}; // logits and their gradient
  requireVectorAligned({&vectors}, vector);
  void *pl = ptr(logits), *pt = ptr(buf(ins.in[1])), *po = ptr(buf(ins.out[0]));
  if (grad) {
    void *pd = ptr(buf(ins.in[2]));
    return [=](cudaStream_t s) { launchGenerated(fn, grid, 256, {pl, pt, pd, po}, s); };
  }
  reserve(rows * sizeof(float));
  long long *err = errorWord;
  float *out = f(ins.out[0]);
  return [=](cudaStream_t s) {
    float *rowLoss = reinterpret_cast<float *>(workspace);
    launchGenerated(fn, grid, 256, {pl, pl, pt, rowLoss, err}, s);
    meanKernel<<<1, 1024, 0, s>>>(rowLoss, rows, out);
  };
}

/// A generated elementwise chain: a thread per `vector` output elements, its
/// parameters the input buffers then the output buffers.
Launch CudaBackendImpl::buildFused(const Instruction &ins) {
  cudaKernel_t fn = generatedKernel(ins);
  std::vector<void *> pointers;
  for (int64_t id : ins.in)
    pointers.push_back(ptr(buf(id)));
  for (int64_t id : ins.out)
    pointers.push_back(ptr(buf(id)));
  // The launch shape the compiler chose: a thread per `vector` output
  // elements (1 in bundles before vectorised kernels).
  int64_t n = count(buf(ins.out[0]).shape), vector = 1;
  unsigned block = kThreads, grid = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  if (auto launch = ins.attrs.find("launch"); launch != ins.attrs.end() && launch->is_object()) {
    block = launch->value("block", unsigned(kThreads));
    grid = launch->value("grid", grid);
    vector = launch->value("vector", int64_t(1));
    if (vector < 1 || vector > 8 || n % vector)
      fail(LOOM_INVALID_BUNDLE, where, ": launch vector ", vector, " does not divide ", n, " elements");
    if (block == 0 || uint64_t(block) * grid * uint64_t(vector) < uint64_t(n))
      fail(LOOM_INVALID_BUNDLE, where, ": launch ", grid, " x ", block, " x ", vector, " does not cover ", n,
           " elements");
  }
  requireVectorAligned({&ins.in, &ins.out}, vector);
  return [=](cudaStream_t s) { launchGenerated(fn, grid, block, pointers, s); };
}

void CudaBackendImpl::addGeneratedBuilders(BuilderTable &table) { table["fused"] = &CudaBackendImpl::buildFused; }

} // namespace loom::rt::cuda

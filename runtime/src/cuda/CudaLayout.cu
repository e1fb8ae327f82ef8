//===- CudaLayout.cu - Copies, gathers and embedding lookups ---------------===//
//
// Instructions that move data rather than compute it: slices and
// concatenations (2-D copies of blocks of rows), transposes and broadcasts
// (a gather over strided offsets), and embedding lookups and their
// gradient (rows of a table by token id, vocabulary-parallel or whole).
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <cub/device/device_radix_sort.cuh>

namespace loom::rt::cuda {
namespace {

/// out[i] = in[base + offset(i)]: slices, transposes, broadcasts (E: an
/// unsigned integer as wide as an element).
template <typename E> __global__ void gatherKernel(const E *in, E *out, int64_t n, int64_t base, Strided s) {
  GRID_LOOP(i, n) {
    int64_t oa, ob;
    offsets(s, i, oa, ob);
    out[i] = in[base + oa];
  }
}

/// Rows [start, start + vocab) of a vocabulary of `full` ids live here (the
/// whole table unless tensor parallelism splits it): other ids give zeros.
__global__ void embeddingKernel(DPtr table, const void *ids, bool wide, DPtr y, int64_t n,
                                int64_t h, int64_t vocab, long long *err, int64_t start, int64_t full) {
  GRID_LOOP(i, n * h) {
    int64_t t = i / h, id = readIndex(ids, wide, t);
    if (id < 0 || id >= full) {
      raise(err, 1, t, id);
      continue;
    }
    int64_t row = id - start;
    y.st(i, row >= 0 && row < vocab ? table[row * h + i % h] : 0.0f);
  }
}

__global__ void embeddingGradKernel(const void *ids, bool wide, DPtr dy, float *dt, int64_t n,
                                    int64_t h, int64_t vocab, long long *err, int64_t start, int64_t full,
                                    float scale) {
  GRID_LOOP(i, n * h) {
    int64_t t = i / h, id = readIndex(ids, wide, t);
    if (id < 0 || id >= full) {
      raise(err, 1, t, id);
      continue;
    }
    int64_t row = id - start;
    if (row >= 0 && row < vocab)
      atomicAdd(&dt[row * h + i % h], scale * dy[i]);
  }
}

/// The deterministic embedding gradient (LOOM_DETERMINISTIC=1): each token's
/// table row (`vocab` for ids another rank holds, or out of range) and its
/// position, sorted by row (a stable radix sort keeps positions in order),
/// then each run of one row summed in token order by one block.
__global__ void embeddingRowsKernel(const void *ids, bool wide, int *rows, int *positions, int64_t n,
                                    int64_t vocab, long long *err, int64_t start, int64_t full) {
  GRID_LOOP(t, n) {
    int64_t id = readIndex(ids, wide, t), row = id - start;
    if (id < 0 || id >= full)
      raise(err, 1, t, id);
    rows[t] = id >= 0 && id < full && row >= 0 && row < vocab ? int(row) : int(vocab);
    positions[t] = int(t);
  }
}

__global__ void embeddingRunsKernel(const int *rows, const int *positions, int64_t n, DPtr dy, float *dt, int64_t h,
                                    int64_t vocab, float scale, bool accumulate) {
  int64_t first = blockIdx.x;
  int row = rows[first];
  if (row >= vocab || (first > 0 && rows[first - 1] == row))
    return; // another rank's row, or not the run's first token
  int64_t end = first + 1;
  while (end < n && rows[end] == row)
    ++end;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    float sum = 0;
    for (int64_t q = first; q < end; ++q)
      sum += dy[int64_t(positions[q]) * h + j];
    float &to = dt[int64_t(row) * h + j];
    to = (accumulate ? to : 0.0f) + scale * sum;
  }
}

/// Slices of one tensor along one axis, in one launch: part p copies rows
/// of width[p] units from the source at column start[p] (units: sixteen
/// bytes where every width, start and row pitch allows, else two or one).
constexpr int kMaxSlices = 8;
struct SliceParts {
  int count = 0;
  int64_t rows = 0, pitch = 0; // source row pitch, in units
  int64_t start[kMaxSlices] = {}, width[kMaxSlices] = {}, first[kMaxSlices + 1] = {}; // first: prefix of widths
  void *out[kMaxSlices] = {};
};

template <typename E> __global__ void slicesKernel(const E *in, SliceParts parts) {
  int64_t total = parts.rows * parts.first[parts.count];
  GRID_LOOP(i, total) {
    int64_t row = i / parts.first[parts.count], col = i % parts.first[parts.count];
    int p = 0;
    while (col >= parts.first[p + 1])
      ++p;
    col -= parts.first[p];
    static_cast<E *>(parts.out[p])[row * parts.width[p] + col] = in[row * parts.pitch + parts.start[p] + col];
  }
}

} // namespace

bool CudaBackendImpl::slicesTogether(const Instruction &a, const Instruction &b) {
  return a.op == "slice" && b.op == "slice" && a.in == b.in && a.attrs.value("axis", 0) == b.attrs.value("axis", 0) &&
         buf(a.out[0]).dtype == buf(b.out[0]).dtype;
}

Launch CudaBackendImpl::buildSlices(const std::vector<Instruction> &instrs, size_t begin, size_t end) {
  if (end - begin > size_t(kMaxSlices) || end - begin < 2)
    fail(LOOM_INTERNAL, where, ": ", end - begin, " slices in one launch");
  const Buffer &x = buf(instrs[begin].in[0]);
  int64_t axis = axisOf(instrs[begin], "axis", x.shape.size(), 0);
  int64_t outer = 1, inner = dtypeSize(x.dtype);
  for (int64_t d = 0; d < axis; ++d)
    outer *= x.shape[d];
  for (size_t d = axis + 1; d < x.shape.size(); ++d)
    inner *= x.shape[d];
  int64_t pitch = x.shape[axis] * inner; // bytes
  SliceParts parts;
  parts.count = int(end - begin);
  parts.rows = outer;
  int64_t unit = 16;
  for (size_t i = begin; i < end; ++i) {
    const Buffer &o = buf(instrs[i].out[0]);
    int64_t start = static_cast<int64_t>(num(instrs[i], "start", 0)) * inner, width = o.shape[axis] * inner;
    if (start < 0 || start + width > pitch || count(o.shape) * int64_t(dtypeSize(o.dtype)) != width * outer)
      fail(LOOM_INVALID_BUNDLE, "instruction [", i, "] 'slice': out of its input's bounds");
    parts.start[i - begin] = start, parts.width[i - begin] = width, parts.out[i - begin] = ptr(o);
    for (int64_t v : {start, width, pitch, int64_t(reinterpret_cast<uintptr_t>(ptr(o)))})
      while (v % unit)
        unit /= 2;
  }
  if (reinterpret_cast<uintptr_t>(ptr(x)) % unit)
    unit = 1;
  unit = unit >= 16 ? 16 : unit >= 2 ? 2 : 1;
  parts.pitch = pitch / unit;
  for (int p = 0; p < parts.count; ++p) {
    parts.start[p] /= unit, parts.width[p] /= unit;
    parts.first[p + 1] = parts.first[p] + parts.width[p];
  }
  int64_t total = parts.rows * parts.first[parts.count];
  const char *pi = ptr(x);
  return [=](cudaStream_t s) {
    if (total == 0)
      return;
    if (unit == 16)
      slicesKernel<<<blocksFor(total), kThreads, 0, s>>>(reinterpret_cast<const uint4 *>(pi), parts);
    else if (unit == 2)
      slicesKernel<<<blocksFor(total), kThreads, 0, s>>>(reinterpret_cast<const uint16_t *>(pi), parts);
    else
      slicesKernel<<<blocksFor(total), kThreads, 0, s>>>(reinterpret_cast<const uint8_t *>(pi), parts);
  };
}

Launch CudaBackendImpl::buildSliceOrConcat(const Instruction &ins) {
  const std::string &op = ins.op;
  const Buffer &x = buf(ins.in[0]), &o = buf(ins.out[0]);
  const Buffer &whole = op == "slice" ? x : o;
  int64_t axis = axisOf(ins, "axis", whole.shape.size(), 0);
  int64_t outer = 1, inner = dtypeSize(whole.dtype);
  for (int64_t d = 0; d < axis; ++d)
    outer *= whole.shape[d];
  for (size_t d = axis + 1; d < whole.shape.size(); ++d)
    inner *= whole.shape[d];
  int64_t dim = whole.shape[axis], pitch = dim * inner;
  char *po = ptr(o);
  if (op == "slice") {
    int64_t start = static_cast<int64_t>(num(ins, "start", 0)), width = o.shape[axis] * inner;
    char *pi = ptr(x) + start * inner;
    return [=](cudaStream_t s) {
      LOOM_CUDA_CHECK(cudaMemcpy2DAsync(po, width, pi, pitch, width, outer, cudaMemcpyDeviceToDevice, s));
    };
  }
  std::vector<std::tuple<char *, int64_t, int64_t>> parts; // source, first byte of a row, width
  int64_t offset = op == "slice_grad" ? static_cast<int64_t>(num(ins, "start", 0)) : 0;
  for (int64_t id : ins.in) {
    const Buffer &part = buf(id);
    if (part.dtype != o.dtype)
      fail(LOOM_INVALID_BUNDLE, where, ": joins ", dtypeName(part.dtype), " into ", dtypeName(o.dtype));
    parts.push_back({ptr(part), offset * inner, part.shape[axis] * inner});
    offset += part.shape[axis];
  }
  // A slice's gradient is zero outside the slice: clear only that.
  int64_t start = std::get<1>(parts.front()), end = start + std::get<2>(parts.front());
  bool grad = op == "slice_grad";
  return [=](cudaStream_t s) {
    if (grad && start > 0)
      LOOM_CUDA_CHECK(cudaMemset2DAsync(po, pitch, 0, start, outer, s));
    if (grad && end < pitch)
      LOOM_CUDA_CHECK(cudaMemset2DAsync(po + end, pitch, 0, pitch - end, outer, s));
    for (auto [src, at, width] : parts)
      LOOM_CUDA_CHECK(cudaMemcpy2DAsync(po + at, pitch, src, width, width, outer, cudaMemcpyDeviceToDevice, s));
  };
}

Launch CudaBackendImpl::buildTransposeOrBroadcast(const Instruction &ins) {
  const std::string &op = ins.op;
  const Buffer &x = buf(ins.in[0]), &o = buf(ins.out[0]);
  std::vector<int64_t> st;
  int64_t base = 0;
  if (op == "transpose") {
    std::vector<int64_t> in = stridesOf(x.shape);
    for (auto &p : ins.attrs.at("permutation"))
      st.push_back(in[p.get<int64_t>()]);
  } else {
    st = broadcastTo(x.shape, o.shape);
  }
  Strided sd = strided(o.shape, st);
  char *pi = ptr(x), *po = ptr(o);
  int64_t cnt = count(o.shape);
  int64_t size = dtypeSize(x.dtype);
  return [=](cudaStream_t s) {
    if (size == 2)
      gatherKernel<<<blocksFor(cnt), kThreads, 0, s>>>(reinterpret_cast<uint16_t *>(pi), reinterpret_cast<uint16_t *>(po), cnt, base, sd);
    else if (size == 4)
      gatherKernel<<<blocksFor(cnt), kThreads, 0, s>>>(reinterpret_cast<uint32_t *>(pi), reinterpret_cast<uint32_t *>(po), cnt, base, sd);
    else
      gatherKernel<<<blocksFor(cnt), kThreads, 0, s>>>(reinterpret_cast<uint64_t *>(pi), reinterpret_cast<uint64_t *>(po), cnt, base, sd);
  };
}

Launch CudaBackendImpl::buildEmbedding(const Instruction &ins) {
  const std::string &op = ins.op;
  bool grad = op == "embedding_grad";
  const Buffer &table = grad ? buf(ins.out[0]) : buf(ins.in[0]), &ids = grad ? buf(ins.in[0]) : buf(ins.in[1]);
  int64_t vocab = table.shape[0], h = table.shape[1], cnt = count(ids.shape);
  bool wide = ids.dtype == LOOM_I64;
  void *pid = ptr(ids);
  long long *err = errorWord;
  int64_t parts = 1, start = startOf(ins, vocab, parts), full = vocab * parts;
  if (!grad) {
    DPtr pt = fp(ins.in[0]), y = fp(ins.out[0]);
    return [=](cudaStream_t s) { embeddingKernel<<<blocksFor(cnt * h), kThreads, 0, s>>>(pt, pid, wide, y, cnt, h, vocab, err, start, full); };
  }
  // Accumulates in f32 (in the workspace for a bf16 table), rounding once.
  // `accumulate` adds into the table's gradient instead of overwriting it
  // (an f32 one: loom-gather-embedding-rows adds the gathered rows of every
  // data-parallel rank into the reduced head's gradient), `scale` scales
  // each row first (1 / dp there: the mean over the replicas).
  DPtr dy = fp(ins.in[1]), dt = fp(ins.out[0]);
  bool accumulate = flag(ins, "accumulate");
  float scale = 1.0f;
  if (ins.attrs.is_object() && ins.attrs.contains("scale")) {
    if (!ins.attrs["scale"].is_number())
      fail(LOOM_INVALID_BUNDLE, where, ": embedding_grad's 'scale' must be a number");
    scale = ins.attrs["scale"].get<float>();
  }
  if (accumulate && dt.bf)
    fail(LOOM_INVALID_BUNDLE, where, ": embedding_grad accumulates into f32 tables only, not bf16 '",
         buf(ins.out[0]).name, "'");
  size_t accBytes = dt.bf ? (size_t(vocab * h) * sizeof(float) + 255) / 256 * 256 : 0;
  if (deterministic()) {
    if (cnt > INT32_MAX || vocab >= INT32_MAX)
      fail(LOOM_UNSUPPORTED, where, ": LOOM_DETERMINISTIC's embedding gradient takes at most 2^31 tokens and rows");
    // After the f32 sums: rows and positions, sorted, and the sort's scratch.
    int bits = 1;
    while (bits < 31 && (int64_t(1) << bits) <= vocab)
      ++bits;
    size_t sortBytes = 0;
    LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sortBytes, static_cast<const int *>(nullptr),
                                                    static_cast<int *>(nullptr), static_cast<const int *>(nullptr),
                                                    static_cast<int *>(nullptr), int(cnt), 0, bits));
    size_t list = (size_t(cnt) * sizeof(int) + 255) / 256 * 256;
    reserve(accBytes + 4 * list + sortBytes);
    return [=](cudaStream_t s) {
      char *w = static_cast<char *>(workspace);
      float *acc = dt.bf ? reinterpret_cast<float *>(w) : static_cast<float *>(dt.p);
      int *rows = reinterpret_cast<int *>(w + accBytes), *positions = reinterpret_cast<int *>(w + accBytes + list),
          *sortedRows = reinterpret_cast<int *>(w + accBytes + 2 * list),
          *sortedPositions = reinterpret_cast<int *>(w + accBytes + 3 * list);
      size_t scratch = sortBytes;
      if (!accumulate)
        LOOM_CUDA_CHECK(cudaMemsetAsync(acc, 0, vocab * h * sizeof(float), s));
      if (cnt > 0) {
        embeddingRowsKernel<<<blocksFor(cnt), kThreads, 0, s>>>(pid, wide, rows, positions, cnt, vocab, err, start,
                                                                full);
        LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(w + accBytes + 4 * list, scratch, rows, sortedRows,
                                                        positions, sortedPositions, int(cnt), 0, bits, s));
        embeddingRunsKernel<<<unsigned(cnt), 256, 0, s>>>(sortedRows, sortedPositions, cnt, dy, acc, h, vocab,
                                                            scale, accumulate);
      }
      if (dt.bf)
        castKernel<<<blocksFor(vocab * h), kThreads, 0, s>>>(DPtr{acc, false}, dt, vocab * h);
    };
  }
  if (dt.bf)
    reserve(accBytes);
  return [=](cudaStream_t s) {
    float *acc = dt.bf ? reinterpret_cast<float *>(workspace) : static_cast<float *>(dt.p);
    if (!accumulate)
      LOOM_CUDA_CHECK(cudaMemsetAsync(acc, 0, vocab * h * sizeof(float), s));
    embeddingGradKernel<<<blocksFor(cnt * h), kThreads, 0, s>>>(pid, wide, dy, acc, cnt, h, vocab, err, start, full,
                                                                scale);
    if (dt.bf)
      castKernel<<<blocksFor(vocab * h), kThreads, 0, s>>>(DPtr{acc, false}, dt, vocab * h);
  };
}

void CudaBackendImpl::addLayoutBuilders(BuilderTable &table) {
  for (const char *op : {"slice", "slice_grad", "concat"})
    table[op] = &CudaBackendImpl::buildSliceOrConcat;
  for (const char *op : {"transpose", "broadcast"})
    table[op] = &CudaBackendImpl::buildTransposeOrBroadcast;
  for (const char *op : {"embedding", "embedding_grad"})
    table[op] = &CudaBackendImpl::buildEmbedding;
}

} // namespace loom::rt::cuda

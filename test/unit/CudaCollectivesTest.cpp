//===- CudaCollectivesTest.cpp - A bucket's packed all-reduce on the GPU --===//
//
// A data-parallel bucket is all-reduced in f32: its small tensors packed
// end to end into one message (bf16 gradients widened on the way) and
// unpacked into the f32 outputs, its large ones widened into their outputs
// and reduced in place. Over a group of one rank the mean is
// the tensor itself, so the outputs must be exactly the inputs, widened:
// this checks the packing, the widening and the offsets of tensors of odd
// sizes, synchronously and on the communication stream, averaged as
// bf16 ("wire": "bf16"), and bf16 tensors reduced in place. (The reduction
// over two GPUs is checked by training dp2 bundles against the CPU:
// scripts/device-resnet.sh.)
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Bundle.h"
#include "loom/rt/Tensor.h"
#include "runtime/src/Backend.h"
#include "test/unit/SingleInstruction.h"

#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace loom::rt;
using loom::rt::test::downloadFloats;
using loom::rt::test::floatBytes;

namespace {

bool haveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void bucket(bool async, const char *packed, const char *wire = "f32", bool bf16InPlace = false) {
  setenv("LOOM_CUDA_BUCKET_PACKED", packed, 1);
  loom::rt::test::ProgramBuilder p;
  // (elements, input dtype): in place where f32, widened into a new f32 buffer where bf16.
  std::vector<std::pair<int64_t, loom_dtype_t>> tensors = {
      {1000, LOOM_F32},   {37, LOOM_BF16},     {70001, LOOM_BF16}, {5, LOOM_F32},
      {300001, LOOM_BF16}, {262147, LOOM_F32}, {1, LOOM_BF16}}; // the two over 1 MiB as f32 go unpacked
  Instruction reduce{"all_reduce", {}, {}, {{"reduction", "mean"}, {"group", "dp"}}};
  if (std::string(wire) != "f32")
    reduce.attrs["wire"] = wire;
  for (auto [n, dt] : tensors) {
    int64_t in = p.add({n}, dt, "g");
    reduce.in.push_back(in);
    reduce.out.push_back(dt == LOOM_F32 || bf16InPlace ? in : p.add({n}, LOOM_F32, "m"));
  }
  std::vector<Instruction> program = {reduce};
  if (async) {
    program[0].attrs["async"] = true, program[0].attrs["event"] = 0;
    program.push_back(Instruction{"event_wait", {}, {}, {{"event", 0}}});
  }
  RankProgram r = p.finish(program);
  r.groups["dp"] = {0};
  auto gpu = makeCudaBackend(r, 0);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<std::vector<char>> inputs;
  for (int64_t id : reduce.in) {
    const Buffer &b = r.buffers[id];
    inputs.push_back(floatBytes(b, [&](int64_t) { return dist(rng); }));
    gpu->upload(b, inputs.back().data());
  }
  gpu->prepare("forward", program);
  gpu->run("forward");
  for (size_t t = 0; t < tensors.size(); ++t) {
    const Buffer &in = r.buffers[reduce.in[t]], &out = r.buffers[reduce.out[t]];
    int64_t n = tensors[t].first;
    std::vector<float> got = downloadFloats(*gpu, out); // bf16 where reduced in place
    for (int64_t i = 0; i < n; ++i) {
      float want = in.dtype == LOOM_BF16 ? bf16ToFloat(reinterpret_cast<const uint16_t *>(inputs[t].data())[i])
                                         : reinterpret_cast<const float *>(inputs[t].data())[i];
      ASSERT_EQ(got[i], want) << "tensor " << t << " (" << out.name << ") [" << i << "]";
    }
  }
  unsetenv("LOOM_CUDA_BUCKET_PACKED");
}

/// `ins` alone, or on the communication stream (event 0) with its wait.
std::vector<Instruction> maybeAsync(Instruction ins, bool async) {
  std::vector<Instruction> program = {ins};
  if (async) {
    program[0].attrs["async"] = true, program[0].attrs["event"] = 0;
    program.push_back(Instruction{"event_wait", {}, {}, {{"event", 0}}});
  }
  return program;
}

/// Uploads random values in [-3, 3) into each of `ids`; returns them.
std::vector<std::vector<char>> uploadRandom(Backend &gpu, const RankProgram &r, const std::vector<int64_t> &ids,
                                            unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<std::vector<char>> values;
  for (int64_t id : ids) {
    values.push_back(floatBytes(r.buffers[id], [&](int64_t) { return dist(rng); }));
    gpu.upload(r.buffers[id], values.back().data());
  }
  return values;
}

/// ZeRO's packed all-gather of f32 slices into whole f32 or bf16 tensors,
/// as rank 0 of two measured alone (LOOM_MEASURE_ONE_RANK: its own part of
/// each whole is its slice, rounded where the whole is bf16; the other
/// rank's part is not there to check), by segments or element by element
/// (LOOM_CUDA_ZERO_SEGMENTS=0), synchronously and on the communication stream.
void gatherSlices(bool async, bool bf16, const char *segments) {
  setenv("LOOM_MEASURE_ONE_RANK", "0", 1);
  setenv("LOOM_CUDA_ZERO_SEGMENTS", segments, 1);
  loom::rt::test::ProgramBuilder p;
  std::vector<int64_t> sizes = {1000, 37, 70001, 5, 300001, 1};
  Instruction gather{"all_gather", {}, {}, {{"group", "dp"}}};
  for (int64_t n : sizes) {
    gather.in.push_back(p.add({(n + 1) / 2}, LOOM_F32, "slice"));
    gather.out.push_back(p.add({n}, bf16 ? LOOM_BF16 : LOOM_F32, "whole"));
  }
  std::vector<Instruction> program = maybeAsync(gather, async);
  RankProgram r = p.finish(program);
  r.groups["dp"] = {0, 1};
  auto gpu = makeCudaBackend(r, 0);
  std::vector<std::vector<char>> slices = uploadRandom(*gpu, r, gather.in, 7);
  gpu->prepare("forward", program);
  gpu->run("forward");
  for (size_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> got = downloadFloats(*gpu, r.buffers[gather.out[t]]);
    const float *slice = reinterpret_cast<const float *>(slices[t].data());
    for (int64_t i = 0; i < (sizes[t] + 1) / 2; ++i) {
      float want = bf16 ? bf16ToFloat(floatToBf16(slice[i])) : slice[i];
      ASSERT_EQ(got[size_t(i)], want) << "tensor " << t << " [" << i << "]";
    }
  }
  unsetenv("LOOM_CUDA_ZERO_SEGMENTS");
  unsetenv("LOOM_MEASURE_ONE_RANK");
}

/// loom-gather-embedding-rows' gathers of token ids along an axis, as rank
/// 0 of two measured alone (LOOM_MEASURE_ONE_RANK): every part is the
/// rank's own, so the ids stay ids of the table (the other rank's part was
/// left unwritten before, and the update then failed on an id out of range).
TEST(CudaCollectives, IdsGatheredAloneRepeatTheirOwnPart) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  setenv("LOOM_MEASURE_ONE_RANK", "0", 1);
  loom::rt::test::ProgramBuilder p;
  int64_t flat = p.add({5}, LOOM_I32, "ids"), flatAll = p.add({10}, LOOM_I32, "all"),
          rows = p.add({2, 3}, LOOM_I32, "rows"), rowsAll = p.add({2, 6}, LOOM_I32, "rowsAll");
  std::vector<Instruction> program = {
      Instruction{"all_gather", {flat}, {flatAll}, {{"axis", 0}, {"group", "dp"}}},
      Instruction{"all_gather", {rows}, {rowsAll}, {{"axis", 1}, {"group", "dp"}}}};
  RankProgram r = p.finish(program);
  r.groups["dp"] = {0, 1};
  auto gpu = makeCudaBackend(r, 0);
  std::vector<int32_t> ids = {3, 1, 4, 1, 5}, rowIds = {9, 2, 6, 5, 3, 5};
  gpu->upload(r.buffers[flat], ids.data());
  gpu->upload(r.buffers[rows], rowIds.data());
  gpu->prepare("forward", program);
  gpu->run("forward");
  std::vector<int32_t> all(10), gathered(12);
  gpu->download(r.buffers[flatAll], all.data());
  gpu->download(r.buffers[rowsAll], gathered.data());
  unsetenv("LOOM_MEASURE_ONE_RANK");
  EXPECT_EQ(all, (std::vector<int32_t>{3, 1, 4, 1, 5, 3, 1, 4, 1, 5}));
  EXPECT_EQ(gathered, (std::vector<int32_t>{9, 2, 6, 9, 2, 6, 5, 3, 5, 5, 3, 5}));
}

/// ZeRO's packed reduce-scatter of whole gradients (f32, and bf16 widened as
/// they are packed) into f32 slices, as rank 0 of two measured alone: its
/// slice of each is the first ceil(n / 2) elements, by segments or element
/// by element (LOOM_CUDA_PACK_SEGMENTS=0).
/// Unless `wideSums` is "0" (LOOM_CUDA_WIDE_SUMS) the bf16 gradients take the
/// bf16 wire and f32 sums (wideSumScatterRun), the f32 ones NCCL's f32 path.
void scatterGradients(bool async, const char *segments, bool allBf16 = false, const char *wideSums = "1") {
  setenv("LOOM_MEASURE_ONE_RANK", "0", 1);
  setenv("LOOM_CUDA_PACK_SEGMENTS", segments, 1);
  setenv("LOOM_CUDA_WIDE_SUMS", wideSums, 1);
  loom::rt::test::ProgramBuilder p;
  std::vector<std::pair<int64_t, loom_dtype_t>> tensors = {
      {1000, LOOM_F32}, {37, LOOM_BF16}, {70001, LOOM_BF16}, {5, LOOM_F32}, {300001, LOOM_F32}, {1, LOOM_BF16}};
  if (allBf16)
    for (auto &t : tensors)
      t.second = LOOM_BF16;
  Instruction scatter{"reduce_scatter", {}, {}, {{"reduction", "mean"}, {"group", "dp"}}};
  for (auto [n, dt] : tensors) {
    scatter.in.push_back(p.add({n}, dt, "grad"));
    scatter.out.push_back(p.add({(n + 1) / 2}, LOOM_F32, "slice"));
  }
  std::vector<Instruction> program = maybeAsync(scatter, async);
  RankProgram r = p.finish(program);
  r.groups["dp"] = {0, 1};
  auto gpu = makeCudaBackend(r, 0);
  std::vector<std::vector<char>> grads = uploadRandom(*gpu, r, scatter.in, 11);
  gpu->prepare("backward", program);
  gpu->run("backward");
  for (size_t t = 0; t < tensors.size(); ++t) {
    std::vector<float> got = downloadFloats(*gpu, r.buffers[scatter.out[t]]);
    for (int64_t i = 0; i < (tensors[t].first + 1) / 2; ++i) {
      float want = tensors[t].second == LOOM_BF16
                       ? bf16ToFloat(reinterpret_cast<const uint16_t *>(grads[t].data())[i])
                       : reinterpret_cast<const float *>(grads[t].data())[i];
      ASSERT_EQ(got[size_t(i)], want) << "tensor " << t << " [" << i << "]";
    }
  }
  unsetenv("LOOM_CUDA_PACK_SEGMENTS");
  unsetenv("LOOM_CUDA_WIDE_SUMS");
  unsetenv("LOOM_MEASURE_ONE_RANK");
}

/// A bundle of two ranks running `program`, both in group `group`.
Manifest twoRanks(loom::rt::test::ProgramBuilder &p, const std::vector<Instruction> &program, const char *group) {
  Manifest m;
  m.mode = "train";
  for (int k = 0; k < 2; ++k) {
    RankProgram r = p.finish(program);
    r.rank = k;
    r.groups[group] = {0, 1};
    m.ranks.push_back(r);
  }
  return m;
}

} // namespace

// loom-reduce-from-products' products: bf16 operands, the f32 weight
// gradient and the f32 bias gradient from one call (transpose_a, "bgrad"),
// as a bucket then reduces them in place. The CPU backend (which defines the
// instruction) against sums written out here, and the GPU (cuBLASLt) against
// the CPU where there is one.
TEST(CudaCollectives, Bf16ProductWritesF32GradientAndBias) {
  const int64_t T = 96, K = 64, N = 80;
  Instruction ins;
  RankProgram r = loom::rt::test::programFor("matmul", {{{T, K}, LOOM_BF16}, {{T, N}, LOOM_BF16}},
                                             {{{K, N}, LOOM_F32}, {{1, 1, N}, LOOM_F32}}, ins,
                                             {{"transpose_a", true}, {"epilogue", "bgrad"}});
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<char>> inputs;
  for (int64_t id : ins.in)
    inputs.push_back(floatBytes(r.buffers[id], [&](int64_t) { return dist(rng); }));
  auto cpu = makeCpuBackend(r, 2);
  for (size_t i = 0; i < ins.in.size(); ++i)
    cpu->upload(r.buffers[ins.in[i]], inputs[i].data());
  cpu->prepare("forward", {ins});
  cpu->run("forward");
  std::vector<float> a = downloadFloats(*cpu, r.buffers[ins.in[0]]), b = downloadFloats(*cpu, r.buffers[ins.in[1]]);
  std::vector<float> g = downloadFloats(*cpu, r.buffers[ins.out[0]]), bias = downloadFloats(*cpu, r.buffers[ins.out[1]]);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) {
      double want = 0;
      for (int64_t t = 0; t < T; ++t)
        want += double(a[size_t(t * K + k)]) * double(b[size_t(t * N + n)]);
      ASSERT_NEAR(g[size_t(k * N + n)], want, 1e-4 * (1 + std::abs(want))) << "g[" << k << "][" << n << "]";
    }
  for (int64_t n = 0; n < N; ++n) {
    double want = 0;
    for (int64_t t = 0; t < T; ++t)
      want += double(b[size_t(t * N + n)]);
    ASSERT_NEAR(bias[size_t(n)], want, 1e-4 * (1 + std::abs(want))) << "bias[" << n << "]";
  }
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device (the CPU backend checked)";
  auto gpu = makeCudaBackend(r, 0);
  for (size_t i = 0; i < ins.in.size(); ++i)
    gpu->upload(r.buffers[ins.in[i]], inputs[i].data());
  gpu->prepare("forward", {ins});
  gpu->run("forward");
  for (int64_t id : ins.out) {
    std::vector<float> got = downloadFloats(*gpu, r.buffers[id]), want = downloadFloats(*cpu, r.buffers[id]);
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i)
      num += double(got[i] - want[i]) * double(got[i] - want[i]), den += double(want[i]) * double(want[i]);
    EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 1e-5) << r.buffers[id].name;
  }
}

TEST(CudaCollectives, PackedBucket) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  bucket(/*async=*/false, "1");
}

TEST(CudaCollectives, PackedBucketOnTheCommunicationStream) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  bucket(/*async=*/true, "1");
}

// With packing off, a bucket that widens bf16 gradients widens each into
// its output and reduces it there.
TEST(CudaCollectives, WideningBucketWithPackingOff) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  bucket(/*async=*/true, "0");
}

// loomc compile --grad-reduce bf16: the bf16 gradients averaged as bf16
// (the small ones packed into a bf16 span, the large ones reduced into
// their places in it), then widened into their outputs; the f32 ones as
// before.
TEST(CudaCollectives, BucketAveragedInBf16) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  bucket(/*async=*/true, "1", "bf16");
}

// loomc compile --grad-reduce bf16 where only the update reads the means
// (loom-bf16-step-casts): the bf16 gradients averaged in place, as bf16,
// beside f32 ones in place, one NCCL call a tensor in one group.
TEST(CudaCollectives, Bf16GradientsAveragedInPlace) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  bucket(/*async=*/true, "1", "f32", /*bf16InPlace=*/true);
}

// A data-parallel step: the backward issues its bucket on the communication
// stream and the update waits for it. The backward ends by joining that
// stream, so both programs are captured as CUDA graphs from their second
// run; every run, eager, capturing and replaying, must see its own inputs.
TEST(CudaCollectives, BucketWaitedForByTheNextProgram) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  loom::rt::test::ProgramBuilder p;
  int64_t n = 4099;
  int64_t x = p.add({n}, LOOM_F32, "x"), g = p.add({n}, LOOM_BF16, "g"), m = p.add({n}, LOOM_F32, "m");
  int64_t small = p.add({3}, LOOM_F32, "s"), y = p.add({n}, LOOM_F32, "y");
  RankProgram r = p.finish({});
  r.programs.erase("forward");
  r.programs["backward"] = {
      Instruction{"cast", {x}, {g}, nlohmann::json::object()},
      Instruction{"all_reduce", {g, small}, {m, small},
                  {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 0}}}};
  r.programs["update"] = {Instruction{"event_wait", {}, {}, {{"event", 0}}},
                          Instruction{"add", {m, m}, {y}, nlohmann::json::object()}};
  r.groups["dp"] = {0};
  auto gpu = makeCudaBackend(r, 0);
  for (const char *name : {"backward", "update"})
    gpu->prepare(name, r.programs[name]);
  for (int round = 0; round < 4; ++round) {
    std::vector<float> in(n), got(n);
    for (int64_t i = 0; i < n; ++i)
      in[i] = float(round + 1) * 0.37f * float(i % 101 - 50);
    gpu->upload(r.buffers[x], in.data());
    gpu->run("backward");
    gpu->run("update");
    gpu->download(r.buffers[y], got.data());
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], 2.0f * bf16ToFloat(floatToBf16(in[i]))) << "round " << round << ", y[" << i << "]";
  }
}


// The buckets above with the packing kernels that search for each
// element's tensor (LOOM_CUDA_PACK_SEGMENTS=0), which the default's
// segment copies replaced.
TEST(CudaCollectives, PackedBucketsElementByElement) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  setenv("LOOM_CUDA_PACK_SEGMENTS", "0", 1);
  bucket(/*async=*/false, "1");
  bucket(/*async=*/true, "1");
  bucket(/*async=*/true, "1", "bf16");
  unsetenv("LOOM_CUDA_PACK_SEGMENTS");
}

TEST(CudaCollectives, ZeroScatterOfGradients) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  for (bool async : {false, true})
    for (const char *segments : {"1", "0"}) {
      SCOPED_TRACE(std::string(async ? "async " : "sync ") + "segments=" + segments);
      scatterGradients(async, segments);
      scatterGradients(async, segments, /*allBf16=*/false, "0");
    }
}

TEST(CudaCollectives, ZeroGatherOfSlices) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  for (bool async : {false, true})
    for (bool bf16 : {false, true})
      for (const char *segments : {"1", "0"}) {
        SCOPED_TRACE(std::string(async ? "async " : "sync ") + (bf16 ? "bf16 " : "f32 ") + "segments=" + segments);
        gatherSlices(async, bf16, segments);
      }
}

TEST(CudaCollectives, ZeroScatterOfBf16GradientsSummedInF32) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  for (bool async : {false, true})
    for (const char *wideSums : {"1", "0"}) {
      SCOPED_TRACE(std::string(async ? "async " : "sync ") + "LOOM_CUDA_WIDE_SUMS=" + wideSums);
      scatterGradients(async, "1", /*allBf16=*/true, wideSums);
    }
}

// Sequence parallelism's collectives along an axis, over two GPUs through
// NCCL: a reduce-scatter of [3, 8, 5] along axis 1 (three outer runs, so
// packed through a workspace first) and an all-gather of the parts back,
// each synchronous and async (on the communication stream, in its own
// workspace, beside a product on the compute stream that uses the shared
// one), in one program captured as a graph and replayed. Every rank's part
// must be exactly the sum of the two ranks' rows (small integers: exact in
// any order), and the gathered tensor both ranks' parts. Both with the
// arena and workspaces as symmetric NCCL windows of the tensor-parallel
// group (the default: NCCL's symmetric kernels) and without.
static void axisCollectivesOnTwoGpus(bool async, bool windows) {
  loom::rt::test::ProgramBuilder p;
  int64_t x = p.add({3, 8, 5}, LOOM_F32, "x"), part = p.add({3, 4, 5}, LOOM_F32, "part"),
          whole = p.add({3, 8, 5}, LOOM_F32, "whole"), a = p.add({64, 96}, LOOM_F32, "a"),
          b = p.add({96, 80}, LOOM_F32, "b"), c = p.add({64, 80}, LOOM_F32, "c");
  Instruction scatter{"reduce_scatter", {x}, {part}, {{"axis", 1}, {"reduction", "sum"}, {"group", "tp"}}};
  Instruction gather{"all_gather", {part}, {whole}, {{"axis", 1}, {"group", "tp"}}};
  Instruction product{"matmul", {a, b}, {c}, nlohmann::json::object()};
  std::vector<Instruction> program;
  if (async) {
    scatter.attrs["async"] = true, scatter.attrs["event"] = 0;
    gather.attrs["async"] = true, gather.attrs["event"] = 1;
    program = {scatter, product, Instruction{"event_wait", {}, {}, {{"event", 0}}},
               gather,  product, Instruction{"event_wait", {}, {}, {{"event", 1}}}};
  } else {
    program = {scatter, product, gather, product};
  }
  Manifest m = twoRanks(p, program, "tp");
  auto world = makeNcclWorld(m, {0, 1});
  // inputs[rank]: x[i][j][k] = small integers, distinct per rank.
  auto input = [](int rank, int64_t i) { return float((i * 7 + rank * 3) % 11) - 5.0f; };
  std::vector<std::vector<float>> parts(2), wholes(2);
  std::vector<int> windowCounts(2, windows ? 2 : 0); // as expected where not counted
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int k = 0; k < 2; ++k)
    threads.emplace_back([&, k] {
      try {
        auto gpu = makeCudaBackend(m.ranks[k], k, world.get());
        const RankProgram &r = m.ranks[k];
        std::vector<float> xs(120), ones(64 * 96, 1.0f), twos(96 * 80, 2.0f);
        for (int64_t i = 0; i < 120; ++i)
          xs[size_t(i)] = input(k, i);
        gpu->upload(r.buffers[x], xs.data());
        gpu->upload(r.buffers[a], ones.data());
        gpu->upload(r.buffers[b], twos.data());
        gpu->prepare("forward", program);
        // The arena and the collectives' workspace are windows where the
        // GPUs reach each other (NCCL's symmetric memory); none with
        // LOOM_NCCL_WINDOWS=0.
        int peer = 0;
        cudaDeviceCanAccessPeer(&peer, k, 1 - k);
        if (!windows || peer)
          windowCounts[size_t(k)] = gpu->ncclWindows();
        for (int round = 0; round < 3; ++round) // eager, then the graph's replays
          gpu->run("forward");
        parts[size_t(k)] = downloadFloats(*gpu, r.buffers[part]);
        wholes[size_t(k)] = downloadFloats(*gpu, r.buffers[whole]);
      } catch (const std::exception &e) {
        errors[size_t(k)] = e.what();
        abortNcclWorld(*world, e.what());
      }
    });
  for (std::thread &t : threads)
    t.join();
  ASSERT_EQ(errors[0], "") << (async ? "async" : "sync");
  ASSERT_EQ(errors[1], "") << (async ? "async" : "sync");
  for (int k = 0; k < 2; ++k) {
    if (windows)
      EXPECT_GE(windowCounts[size_t(k)], 2) << "NCCL windows of rank " << k;
    else
      EXPECT_EQ(windowCounts[size_t(k)], 0) << "NCCL windows of rank " << k;
  }
  for (int k = 0; k < 2; ++k)
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t e = 0; e < 5; ++e) {
          int64_t at = (i * 8 + j) * 5 + e;
          float sum = input(0, at) + input(1, at);
          ASSERT_EQ(wholes[size_t(k)][size_t(at)], sum)
              << (async ? "async" : "sync") << ", rank " << k << ", whole [" << i << "][" << j << "][" << e << "]";
          if (j / 4 == k)
            ASSERT_EQ(parts[size_t(k)][size_t((i * 4 + j % 4) * 5 + e)], sum)
                << (async ? "async" : "sync") << ", rank " << k << ", part [" << i << "][" << j % 4 << "][" << e
                << "]";
        }
}

TEST(CudaCollectives, AxisCollectivesOnTwoGpus) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2)
    GTEST_SKIP() << "needs two CUDA devices";
  for (const char *windows : {"1", "0"}) {
    setenv("LOOM_NCCL_WINDOWS", windows, 1);
    for (bool async : {false, true}) {
      SCOPED_TRACE(std::string("LOOM_NCCL_WINDOWS=") + windows + (async ? ", async" : ", sync"));
      axisCollectivesOnTwoGpus(async, windows[0] == '1');
    }
  }
  unsetenv("LOOM_NCCL_WINDOWS");
}

namespace {

/// Whether GPUs 0 and 1 exist and reach each other's memory (else the reason).
std::string twoPeerGpus() {
  int gpus = 0, ab = 0, ba = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2)
    return "needs two CUDA devices";
  cudaDeviceCanAccessPeer(&ab, 0, 1);
  cudaDeviceCanAccessPeer(&ba, 1, 0);
  return ab && ba ? "" : "GPUs 0 and 1 cannot reach each other's memory";
}

/// Runs `program` on both ranks of `m` (one thread and GPU each) for
/// `rounds` rounds: each uploads inputs[round][rank][i] into `in[i]`, runs,
/// and downloads `out[j]` into the result [round][rank][j]. Empty errors
/// where both ranks ran.
using PerRank = std::vector<std::vector<std::vector<std::vector<char>>>>; // [round][rank][tensor]
std::vector<std::string> runOnTwoGpus(const Manifest &m, NcclWorld &world, const std::vector<Instruction> &program,
                                      const std::vector<int64_t> &in, const PerRank &inputs,
                                      const std::vector<int64_t> &out, PerRank &results) {
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  results.assign(inputs.size(), std::vector<std::vector<std::vector<char>>>(2, std::vector<std::vector<char>>(out.size())));
  for (int k = 0; k < 2; ++k)
    threads.emplace_back([&, k] {
      const RankProgram &r = m.ranks[size_t(k)];
      try {
        auto gpu = makeCudaBackend(r, k, &world);
        gpu->prepare("forward", program);
        for (size_t round = 0; round < inputs.size(); ++round) {
          for (size_t t = 0; t < in.size(); ++t)
            gpu->upload(r.buffers[size_t(in[t])], inputs[round][size_t(k)][t].data());
          gpu->run("forward");
          for (size_t t = 0; t < out.size(); ++t) {
            const Buffer &b = r.buffers[size_t(out[t])];
            results[round][size_t(k)][t].resize(size_t(b.bytes));
            gpu->download(b, results[round][size_t(k)][t].data());
          }
        }
      } catch (const std::exception &e) {
        errors[size_t(k)] = e.what();
        abortNcclWorld(world, e.what());
      }
    });
  for (std::thread &t : threads)
    t.join();
  return errors;
}

/// Random inputs in [-3, 3] for `ids` of `m`: [round][rank][tensor].
PerRank randomInputs(const Manifest &m, const std::vector<int64_t> &ids, int rounds) {
  PerRank inputs(static_cast<size_t>(rounds));
  for (int round = 0; round < rounds; ++round)
    for (int k = 0; k < 2; ++k) {
      std::mt19937 rng(unsigned(100 * round + k));
      std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
      inputs[size_t(round)].emplace_back();
      for (int64_t id : ids)
        inputs[size_t(round)][size_t(k)].push_back(
            floatBytes(m.ranks[size_t(k)].buffers[size_t(id)], [&](int64_t) { return dist(rng); }));
    }
  return inputs;
}

/// Element i of a tensor's bytes, f32 or bf16, as a float.
float valueAt(const std::vector<char> &bytes, loom_dtype_t dt, int64_t i) {
  return dt == LOOM_BF16 ? bf16ToFloat(reinterpret_cast<const uint16_t *>(bytes.data())[i])
                         : reinterpret_cast<const float *>(bytes.data())[i];
}

} // namespace

// Two ranks on two GPUs that reach each other's memory, with
// peer collectives on (the default): their gradient buckets (async all-reduces)
// go over peer memory (CudaPeerCollectives.cu), the copy engines moving the
// halves, in waves of a 16 MiB scratch. Every round both ranks must hold
// exactly the sum (or mean) of their inputs: a packed f32 bucket with a
// tensor over several waves and pieces, one of odd size, and one under the
// peer path's threshold (NCCL's); a bf16 tensor averaged in f32 and
// rounded once; and a bucket widening bf16 gradients into f32 means, a
// large one summed in f32 from its bf16 halves (LOOM_CUDA_PEER_WIDE, on by
// default; also with it off: widened first) beside a small one packed.
// Rounds 2-4 replay the captured graph.
TEST(CudaCollectives, PeerBucketsOnTwoGpus) {
  if (std::string why = twoPeerGpus(); !why.empty())
    GTEST_SKIP() << why;
  loom::rt::test::ProgramBuilder p;
  std::vector<std::pair<int64_t, loom_dtype_t>> tensors = {
      {9000003, LOOM_F32}, {1000, LOOM_F32}, {5000011, LOOM_F32}, {3000001, LOOM_BF16},
      {6000017, LOOM_BF16}, {999, LOOM_BF16}};
  std::vector<int64_t> ids;
  for (auto [n, dt] : tensors)
    ids.push_back(p.add({n}, dt, "t"));
  int64_t mean4 = p.add({6000017}, LOOM_F32, "mean"), mean5 = p.add({999}, LOOM_F32, "mean");
  std::vector<Instruction> program = {
      Instruction{"all_reduce", {ids[0], ids[1], ids[2]}, {ids[0], ids[1], ids[2]},
                  {{"reduction", "sum"}, {"group", "dp"}, {"async", true}, {"event", 0}}},
      Instruction{"all_reduce", {ids[3]}, {ids[3]}, {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 1}}},
      Instruction{"all_reduce", {ids[4], ids[5]}, {mean4, mean5},
                  {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 2}}},
      Instruction{"event_wait", {}, {}, {{"event", 0}}}, Instruction{"event_wait", {}, {}, {{"event", 1}}},
      Instruction{"event_wait", {}, {}, {{"event", 2}}}};
  Manifest m = twoRanks(p, program, "dp");
  setenv("LOOM_CUDA_PEER_COLLECTIVES", "1", 1);
  setenv("LOOM_CUDA_PEER_SCRATCH_MIB", "16", 1);
  auto world = makeNcclWorld(m, {0, 1});
  unsetenv("LOOM_CUDA_PEER_COLLECTIVES");
  unsetenv("LOOM_CUDA_PEER_SCRATCH_MIB");
  ASSERT_EQ(describePeerLinks(*world), "ranks 0-1");
  constexpr int kRounds = 4;
  PerRank inputs = randomInputs(m, ids, kRounds), results;
  std::vector<int64_t> out = {ids[0], ids[1], ids[2], ids[3], mean4, mean5};
  for (const char *wide : {"1", "0"}) {
    SCOPED_TRACE(std::string("LOOM_CUDA_PEER_WIDE=") + wide);
    setenv("LOOM_CUDA_PEER_WIDE", wide, 1);
    std::vector<std::string> errors = runOnTwoGpus(m, *world, program, ids, inputs, out, results);
    unsetenv("LOOM_CUDA_PEER_WIDE");
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
    for (int round = 0; round < kRounds; ++round)
      for (size_t t = 0; t < ids.size(); ++t) {
        auto [n, dt] = tensors[t];
        for (int64_t i = 0; i < n; ++i) {
          float a = valueAt(inputs[size_t(round)][0][t], dt, i), b = valueAt(inputs[size_t(round)][1][t], dt, i);
          // the bf16 bucket's f32 means, the bf16 tensor's rounded, the f32 tensors' sums
          float want = t >= 4 ? (a + b) * 0.5f : dt == LOOM_BF16 ? bf16ToFloat(floatToBf16((a + b) * 0.5f)) : a + b;
          for (int k = 0; k < 2; ++k)
            ASSERT_EQ(valueAt(results[size_t(round)][size_t(k)][t], t >= 4 ? LOOM_F32 : dt, i), want)
                << "round " << round << ", rank " << k << ", tensor " << t << " [" << i << "]";
        }
      }
  }
}

// ZeRO's collectives over peer memory (peerExchange): an async packed
// reduce-scatter of bf16 gradients (summed in f32 from the pushed bf16
// parts) and f32 ones (added in place), a gradient bucket's all-reduce
// sharing the link (so each waits for the other's reads of the scratch),
// and async gathers of the mean slices into bf16 wholes (rounded as a cast)
// and f32 wholes. Rank k's slice of an n-element gradient is elements
// [k * ceil(n / 2), ...) of the mean, zero past the end; every whole on both
// ranks must be exactly the mean of the two ranks' gradients. Rounds 2-3
// replay the captured graph. The bf16 gradients are summed apart from the
// f32 ones (LOOM_CUDA_WIDE_SUMS, the default), or with them (=0). Nothing is
// packed: the copy engines push each gradient's and each whole's part.
TEST(CudaCollectives, PeerZeroCollectivesOnTwoGpus) {
  if (std::string why = twoPeerGpus(); !why.empty())
    GTEST_SKIP() << why;
  loom::rt::test::ProgramBuilder p;
  std::vector<std::pair<int64_t, loom_dtype_t>> grads = {
      {3000001, LOOM_BF16}, {1000, LOOM_F32}, {600001, LOOM_F32}, {2000003, LOOM_BF16}};
  Instruction scatter{"reduce_scatter", {}, {}, {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 0}}};
  Instruction toBf16{"all_gather", {}, {}, {{"group", "dp"}, {"async", true}, {"event", 2}}};
  Instruction toF32{"all_gather", {}, {}, {{"group", "dp"}, {"async", true}, {"event", 3}}};
  std::vector<int64_t> in, wholes;
  for (auto [n, dt] : grads) {
    int64_t g = p.add({n}, dt, "grad"), slice = p.add({(n + 1) / 2}, LOOM_F32, "slice");
    int64_t whole = p.add({n}, dt, "whole");
    scatter.in.push_back(g), scatter.out.push_back(slice);
    Instruction &gather = dt == LOOM_BF16 ? toBf16 : toF32;
    gather.in.push_back(slice), gather.out.push_back(whole);
    in.push_back(g), wholes.push_back(whole);
  }
  int64_t bucket = p.add({4000001}, LOOM_F32, "bucket");
  in.push_back(bucket);
  std::vector<Instruction> program = {
      scatter,
      Instruction{"all_reduce", {bucket}, {bucket}, {{"reduction", "sum"}, {"group", "dp"}, {"async", true}, {"event", 1}}},
      Instruction{"event_wait", {}, {}, {{"event", 0}}}, Instruction{"event_wait", {}, {}, {{"event", 1}}},
      toBf16, toF32,
      Instruction{"event_wait", {}, {}, {{"event", 2}}}, Instruction{"event_wait", {}, {}, {{"event", 3}}}};
  Manifest m = twoRanks(p, program, "dp");
  setenv("LOOM_CUDA_PEER_SCRATCH_MIB", "16", 1);
  auto world = makeNcclWorld(m, {0, 1});
  unsetenv("LOOM_CUDA_PEER_SCRATCH_MIB");
  ASSERT_EQ(describePeerLinks(*world), "ranks 0-1 (ZeRO's slices too)");
  constexpr int kRounds = 3;
  PerRank inputs = randomInputs(m, in, kRounds), results;
  std::vector<int64_t> out = wholes;
  out.push_back(bucket);
  for (const char *wideSums : {"1", "0"}) {
    SCOPED_TRACE(std::string("LOOM_CUDA_WIDE_SUMS=") + wideSums);
    setenv("LOOM_CUDA_WIDE_SUMS", wideSums, 1);
    std::vector<std::string> errors = runOnTwoGpus(m, *world, program, in, inputs, out, results);
    unsetenv("LOOM_CUDA_WIDE_SUMS");
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
    for (int round = 0; round < kRounds; ++round) {
      const auto &x = inputs[size_t(round)];
      for (size_t t = 0; t < grads.size(); ++t) {
        auto [n, dt] = grads[t];
        for (int64_t i = 0; i < n; ++i) {
          float mean = (valueAt(x[0][t], dt, i) + valueAt(x[1][t], dt, i)) * 0.5f;
          float want = dt == LOOM_BF16 ? bf16ToFloat(floatToBf16(mean)) : mean;
          for (int k = 0; k < 2; ++k)
            ASSERT_EQ(valueAt(results[size_t(round)][size_t(k)][t], dt, i), want)
                << "round " << round << ", rank " << k << ", whole " << t << " [" << i << "]";
        }
      }
      for (int64_t i = 0; i < 4000001; ++i)
        for (int k = 0; k < 2; ++k)
          ASSERT_EQ(valueAt(results[size_t(round)][size_t(k)][grads.size()], LOOM_F32, i),
                    valueAt(x[0][grads.size()], LOOM_F32, i) + valueAt(x[1][grads.size()], LOOM_F32, i))
              << "round " << round << ", rank " << k << ", bucket [" << i << "]";
    }
  }
}

// A bucket whose sums the update makes (DeferredPart; the default, and
// LOOM_CUDA_PEER_DEFER=0 sums them in the all-reduce): the bucket's large bf16 gradients only cross the link (each
// rank's copied into its f32 output's memory and pushed into the peer's
// deferred region), and the global norm and AdamW read the pair, combining
// it as the all-reduce would have. A small gradient stays packed (the
// all-reduce's way). Over three rounds (the second and third replaying the
// captured graph, the pushes of a round waiting for the peer to have read
// the last), with clipping and two weight decays in one run of updates,
// both ranks' parameters must be the same bits as with deferral off, and
// as each other's.
TEST(CudaCollectives, PeerDeferredSumsOnTwoGpus) {
  if (std::string why = twoPeerGpus(); !why.empty())
    GTEST_SKIP() << why;
  loom::rt::test::ProgramBuilder p;
  std::vector<int64_t> sizes = {3000001, 600017, 999};
  Instruction bucket{"all_reduce", {}, {}, {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 0}}};
  Instruction norm{"global_norm", {}, {}, nlohmann::json::object()};
  std::vector<int64_t> grads, params;
  std::vector<Instruction> updates;
  int64_t step = p.add({}, LOOM_F32, "step"), gradNorm = p.add({}, LOOM_F32, "norm");
  for (size_t t = 0; t < sizes.size(); ++t) {
    int64_t g = p.add({sizes[t]}, LOOM_BF16, "grad"), mean = p.add({sizes[t]}, LOOM_F32, "mean");
    int64_t w = p.add({sizes[t]}, LOOM_F32, "w"), m1 = p.add({sizes[t]}, LOOM_F32, "m"),
            m2 = p.add({sizes[t]}, LOOM_F32, "v");
    bucket.in.push_back(g), bucket.out.push_back(mean), norm.in.push_back(mean);
    grads.push_back(g), params.push_back(w);
    updates.push_back(Instruction{"adamw", {w, mean, m1, m2, step, gradNorm}, {w, m1, m2},
                                  {{"lr", 1e-2}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"clip", 1.0},
                                   {"weight_decay", t == 0 ? 0.1 : 0.0}}});
  }
  norm.out.push_back(gradNorm);
  std::vector<Instruction> program = {bucket, Instruction{"event_wait", {}, {}, {{"event", 0}}},
                                      Instruction{"step_increment", {step}, {step}, nlohmann::json::object()}, norm};
  program.insert(program.end(), updates.begin(), updates.end());
  Manifest m = twoRanks(p, program, "dp");
  setenv("LOOM_CUDA_PEER_DEFER", "1", 1);
  setenv("LOOM_CUDA_PEER_SCRATCH_MIB", "16", 1);
  auto world = makeNcclWorld(m, {0, 1});
  unsetenv("LOOM_CUDA_PEER_SCRATCH_MIB");
  ASSERT_EQ(describePeerLinks(*world), "ranks 0-1 (sums in the update: 7 MiB a rank)");
  constexpr int kRounds = 3;
  PerRank inputs = randomInputs(m, grads, kRounds);
  std::vector<PerRank> results(2);
  for (const char *defer : {"1", "0"}) {
    SCOPED_TRACE(std::string("LOOM_CUDA_PEER_DEFER=") + defer);
    setenv("LOOM_CUDA_PEER_DEFER", defer, 1);
    PerRank &r = results[defer[0] == '1' ? 0 : 1];
    std::vector<std::string> errors = runOnTwoGpus(m, *world, program, grads, inputs, params, r);
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
  }
  unsetenv("LOOM_CUDA_PEER_DEFER");
  for (int round = 0; round < kRounds; ++round)
    for (size_t t = 0; t < params.size(); ++t) {
      const std::vector<char> &want = results[1][size_t(round)][0][t];
      EXPECT_NE(want, std::vector<char>(want.size(), 0)) << "round " << round << ", parameter " << t << " never moved";
      for (int k = 0; k < 2; ++k) {
        EXPECT_EQ(results[0][size_t(round)][size_t(k)][t], want) << "round " << round << ", rank " << k << ", parameter " << t;
        EXPECT_EQ(results[1][size_t(round)][size_t(k)][t], want) << "round " << round << ", rank " << k << ", parameter " << t;
      }
    }
}

namespace {

/// A dp2 rank's bucket of three bf16 gradients (two large, one packed as
/// small) reduced into f32 means that a global norm and three AdamW updates
/// read; `edit` changes it before deferredParts looks.
std::vector<DeferredPart> deferredOfBucket(const std::function<void(RankProgram &, std::vector<int64_t> &)> &edit) {
  loom::rt::test::ProgramBuilder p;
  std::vector<int64_t> sizes = {600000, 300000, 1000}, means;
  Instruction bucket{"all_reduce", {}, {}, {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 0}}};
  Instruction norm{"global_norm", {}, {}, nlohmann::json::object()};
  std::vector<Instruction> updates;
  int64_t step = p.add({}, LOOM_F32, "step"), gradNorm = p.add({}, LOOM_F32, "norm");
  for (int64_t n : sizes) {
    int64_t g = p.add({n}, LOOM_BF16, "grad"), mean = p.add({n}, LOOM_F32, "mean");
    int64_t w = p.add({n}, LOOM_F32, "w"), m1 = p.add({n}, LOOM_F32, "m"), m2 = p.add({n}, LOOM_F32, "v");
    bucket.in.push_back(g), bucket.out.push_back(mean), norm.in.push_back(mean), means.push_back(mean);
    updates.push_back(Instruction{"adamw", {w, mean, m1, m2, step, gradNorm}, {w, m1, m2}, {{"lr", 1e-3}}});
  }
  norm.out.push_back(gradNorm);
  std::vector<Instruction> program = {bucket, Instruction{"event_wait", {}, {}, {{"event", 0}}}, norm};
  program.insert(program.end(), updates.begin(), updates.end());
  RankProgram r = p.finish(program);
  r.groups["dp"] = {0, 1};
  edit(r, means);
  return deferredParts(r);
}

} // namespace

// Which buckets' sums the update makes (deferredParts; no GPU needed): the
// large bf16 gradients whose means only the global norm and AdamW's
// gradient operand read, each at a 256-byte aligned place; none where
// anything else reads, views or names a mean, where the bucket is not a
// two-rank async sum or mean on an f32 wire, where the norm sums over a
// group, or where an environment switch turns the path off.
TEST(CudaCollectives, DeferredPartsWhereOnlyTheUpdateReads) {
  using Edit = std::function<void(RankProgram &, std::vector<int64_t> &)>;
  auto bucketAttr = [](const char *key, nlohmann::json value) -> Edit {
    return [=](RankProgram &r, std::vector<int64_t> &) { r.programs["forward"][0].attrs[key] = value; };
  };
  std::vector<DeferredPart> both = deferredOfBucket([](RankProgram &, std::vector<int64_t> &) {});
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[0].n, 600000);
  EXPECT_EQ(both[0].at, 0u);
  EXPECT_EQ(both[0].op, 1);
  EXPECT_EQ(both[1].n, 300000);
  EXPECT_EQ(both[1].at, 1200128u);
  EXPECT_EQ(deferredBytes(both), 1200128u + 600064u);
  EXPECT_EQ(deferredOfBucket(bucketAttr("reduction", "sum"))[0].op, 0);

  // The second mean read by a cast as well: only the first is deferred.
  std::vector<DeferredPart> first = deferredOfBucket([](RankProgram &r, std::vector<int64_t> &means) {
    Buffer copy = r.buffers[size_t(means[1])];
    copy.id = int64_t(r.buffers.size());
    copy.dtype = LOOM_BF16;
    r.buffers.push_back(copy);
    r.programs["forward"].push_back(Instruction{"cast", {means[1]}, {copy.id}, nlohmann::json::object()});
  });
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].n, 600000);
  // A view of the first mean, or the first mean an output: only the second.
  for (const Edit &edit : std::vector<Edit>{
           [](RankProgram &r, std::vector<int64_t> &means) {
             Buffer view = r.buffers[size_t(means[0])];
             view.id = int64_t(r.buffers.size());
             view.viewOf = means[0];
             r.buffers.push_back(view);
           },
           [](RankProgram &r, std::vector<int64_t> &means) { r.outputs.push_back({"mean", means[0], 0}); }}) {
    std::vector<DeferredPart> second = deferredOfBucket(edit);
    ASSERT_EQ(second.size(), 1u);
    EXPECT_EQ(second[0].n, 300000);
  }
  for (const Edit &edit : std::vector<Edit>{
           bucketAttr("reduction", "max"), bucketAttr("wire", "bf16"), bucketAttr("async", false),
           bucketAttr("group", "tp"),
           [](RankProgram &r, std::vector<int64_t> &) { r.groups["dp"] = {0, 1, 2}; },
           [](RankProgram &r, std::vector<int64_t> &) { r.programs["forward"][2].attrs["group"] = "mp"; }})
    EXPECT_TRUE(deferredOfBucket(edit).empty());
  for (const char *name : {"LOOM_CUDA_PEER_DEFER", "LOOM_CUDA_PEER_WIDE", "LOOM_CUDA_PEER_COLLECTIVES"}) {
    setenv(name, "0", 1);
    EXPECT_TRUE(deferredOfBucket([](RankProgram &, std::vector<int64_t> &) {}).empty()) << name << "=0";
    unsetenv(name);
  }
}

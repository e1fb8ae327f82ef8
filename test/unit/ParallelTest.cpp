//===- ParallelTest.cpp - Every plan trains like one device ---------------===//
//
// Compiles tiny GPT and Llama models for dp, tp, pp, their combinations,
// every pipeline schedule (ZB-H1 included) and ZeRO-1, runs all ranks on CPU threads for a
// few AdamW steps on the same global batches, and checks that the losses and
// the updated parameters (gathered from their parts) equal a one-device run.
// Tolerance: relative 2e-5 on losses and max-abs 2e-5 on parameters, for f32
// sums taken in a different order (microbatches, tensor-parallel partial
// sums, all-reduces). AdamW is checked separately, on losses.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/BundleWriter.h"
#include "compiler/planner/Planner.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "runtime/src/Communicator.h"
#include "loom/rt/Error.h"
#include "runtime/src/Session.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <thread>

using namespace mlir;
namespace rt = ::loom::rt;

namespace {

struct Config {
  std::string name;
  int64_t dp = 1, tp = 1, pp = 1, vpp = 1, m = 1;
  std::string schedule = "1f1b";
  bool zero1 = false;
  bool bf16 = false; // --precision bf16: compared with one bf16 device
  bool fuse = false; // --fuse (GEMM epilogues, norm gradients taking the residual gradient): against one fused device
};

void PrintTo(const Config &c, std::ostream *os) { *os << c.name; }

struct Result {
  std::vector<float> losses;
  std::map<std::string, std::vector<float>> params; // whole tensors
  std::string error;
};

constexpr int64_t kBatch = 8, kSteps = 3;

Result train(const std::string &model, const Config &c) {
  Result out;
  MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>();
  auto module = parseSourceFile<ModuleOp>(std::string(LOOM_MODELS_DIR) + "/" + model, &context);
  if (!module) {
    out.error = "cannot parse " + model;
    return out;
  }
  std::string dir = ::testing::TempDir() + "/loom-par-" + std::to_string(::getpid()) + "-" + c.name;
  std::filesystem::remove_all(dir);
  mlir::loom::BundleOptions o;
  o.batch = kBatch;
  o.train = true;
  o.seed = 7;
  o.dataParallel = c.dp, o.tensorParallel = c.tp, o.pipelineParallel = c.pp;
  o.virtualStages = c.vpp, o.microbatches = c.m, o.schedule = c.schedule, o.zero1 = c.zero1;
  o.bf16 = c.bf16;
  o.fuse = c.fuse;
  o.bucketBytes = 16 << 10; // several gradient buckets, each issued when ready
  // SGD with momentum: updates are linear in the gradients, so parameters
  // compare as closely as gradients do (Adam would turn the rounding noise
  // of gradients that are zero in exact arithmetic into lr-sized steps).
  o.training.optimizer = "sgd";
  o.training.lr = 0.1;
  if (failed(mlir::loom::writeBundle(*module, o, dir))) {
    out.error = "cannot compile " + c.name;
    return out;
  }
  int64_t n = c.dp * c.tp * c.pp;
  auto comm = std::make_shared<rt::InProcessCommunicator>(int(n), 60.0);
  std::vector<std::unique_ptr<rt::Session>> ranks;
  for (int64_t r = 0; r < n; ++r) {
    rt::SessionOptions so;
    so.rank = int(r);
    so.threads = 1;
    if (n > 1)
      so.comm = comm;
    ranks.push_back(std::make_unique<rt::Session>(dir, so));
  }
  const rt::RankProgram &r0 = ranks[0]->rank();
  if (c.tp > 1 && std::none_of(r0.params.begin(), r0.params.end(),
                               [](const rt::Parameter &p) { return p.shard.axis >= 0; })) {
    out.error = c.name + ": a tp plan that splits no parameter (every rank computes everything)";
    return out;
  }
  const rt::Buffer &tokens = r0.buffers[r0.inputs[0].buffer];
  int64_t rows = tokens.shape[0], seq = tokens.shape[1], vocab = r0.inputs[0].limit;
  std::mt19937 rng(11);
  for (int64_t step = 0; step < kSteps; ++step) {
    std::vector<int32_t> in(kBatch * seq), target(kBatch * seq);
    for (auto &t : in)
      t = int32_t(rng() % uint32_t(vocab));
    for (size_t i = 0; i < in.size(); ++i)
      target[i] = in[(i * 7 + 3) % in.size()];
    for (auto &s : ranks) {
      int64_t replica = s->rank().coords.count("dp") ? s->rank().coords.at("dp") : 0;
      size_t at = size_t(replica * rows * seq), len = size_t(rows * seq);
      s->bindInput(r0.inputs[0].name, in.data() + at, len * 4);
      s->bindInput(r0.inputs[1].name, target.data() + at, len * 4);
    }
    std::vector<std::thread> threads;
    std::mutex mutex;
    for (int64_t k = 0; k < n; ++k)
      threads.emplace_back([&, k] {
        try {
          ranks[k]->trainStep();
        } catch (const rt::Error &e) {
          std::lock_guard<std::mutex> lock(mutex);
          if (out.error.empty())
            out.error = "rank " + std::to_string(k) + ": " + e.what();
          comm->abort(int(k), e.what());
        }
      });
    for (auto &t : threads)
      t.join();
    if (!out.error.empty())
      return out;
    out.losses.push_back(ranks[0]->loss());
    for (auto &s : ranks) // every rank reports the same loss
      if (s->loss() != out.losses.back())
        out.error = "rank " + std::to_string(s->rank().rank) + " reports loss " +
                    std::to_string(s->loss()) + ", rank 0 " + std::to_string(out.losses.back());
  }
  // ZeRO-1 with bf16 copies keeps slices of the masters: every rank puts
  // its masters back together at once (a collective), then reads them.
  std::vector<std::thread> gathers;
  for (auto &s : ranks)
    gathers.emplace_back([&s] { s->gatherParameters(); });
  for (auto &t : gathers)
    t.join();
  // Gather whole parameters from every rank's parts.
  for (auto &s : ranks)
    for (const rt::Parameter &p : s->rank().params) {
      const rt::Buffer &b = s->rank().buffers[p.buffer];
      std::vector<char> local = s->read(b);
      const rt::Shape &shape = p.shard.axis >= 0 ? p.shard.fullShape : b.shape;
      std::vector<float> &whole = out.params[p.name];
      whole.resize(size_t(rt::numElements(shape).value_or(0)));
      if (p.shard.axis >= 0)
        rt::insertShard(p.shard, 4, local.data(), reinterpret_cast<char *>(whole.data()));
      else
        std::memcpy(whole.data(), local.data(), local.size());
    }
  std::filesystem::remove_all(dir);
  return out;
}

/// f32 plans sum the same products in another order (2e-5); bf16 ones also
/// round activations and gradients to bf16 at different points (bf16 has
/// 8 significant bits: 2^-9 relative per rounding).
void expectSame(const Result &one, const Result &many, const std::string &what, bool bf16) {
  double lossTol = bf16 ? 1e-3 : 2e-5, paramTol = bf16 ? 5e-4 : 2e-5;
  ASSERT_TRUE(one.error.empty()) << one.error;
  ASSERT_TRUE(many.error.empty()) << what << ": " << many.error;
  ASSERT_EQ(one.losses.size(), many.losses.size());
  for (size_t i = 0; i < one.losses.size(); ++i)
    EXPECT_NEAR(many.losses[i], one.losses[i], lossTol * std::abs(one.losses[i]))
        << what << ": loss at step " << i + 1;
  ASSERT_EQ(one.params.size(), many.params.size()) << what;
  double worst = 0;
  std::string where;
  for (auto &[name, w] : one.params) {
    auto it = many.params.find(name);
    ASSERT_NE(it, many.params.end()) << what << ": no parameter " << name;
    ASSERT_EQ(it->second.size(), w.size()) << what << ": " << name;
    for (size_t i = 0; i < w.size(); ++i)
      if (double d = std::abs(double(w[i]) - it->second[i]); d > worst)
        worst = d, where = name;
  }
  EXPECT_LT(worst, paramTol) << what << ": parameters differ most in " << where;
}

class Parallel : public ::testing::TestWithParam<std::tuple<std::string, Config>> {};

TEST_P(Parallel, TrainsLikeOneDevice) {
  auto [model, config] = GetParam();
  static std::map<std::string, Result> reference;
  std::string variant = std::string(config.bf16 ? "-bf16" : "") + (config.fuse ? "-fuse" : "");
  std::string key = model + variant;
  if (!reference.count(key)) {
    Config one{"one-" + model.substr(0, 4) + variant};
    one.bf16 = config.bf16;
    one.fuse = config.fuse;
    reference[key] = train(model, one);
  }
  expectSame(reference[key], train(model, config), config.name + " on " + model, config.bf16);
}

std::vector<Config> configs() {
  return {
      {"dp2", 2},
      {"tp2", 1, 2},
      {"pp2", 1, 1, 2, 1, 4},
      {"dp2tp2", 2, 2},
      {"tp2pp2", 1, 2, 2, 1, 2},
      {"dp2pp2", 2, 1, 2, 1, 2},
      {"dp2tp2pp2", 2, 2, 2, 1, 2},
      {"pp4-gpipe", 1, 1, 4, 1, 4, "gpipe"},
      {"pp4-1f1b", 1, 1, 4, 1, 4, "1f1b"},
      {"pp2-interleaved", 1, 1, 2, 2, 4, "interleaved"},
      {"pp2-zbh1", 1, 1, 2, 1, 4, "zb-h1"},
      {"pp4-zbh1", 1, 1, 4, 1, 4, "zb-h1"},
      {"dp2tp2pp2-zbh1", 2, 2, 2, 1, 2, "zb-h1"},
      {"accumulate4", 1, 1, 1, 1, 4},
      {"dp2-zero1", 2, 1, 1, 1, 1, "1f1b", true},
      {"dp2pp2-zero1", 2, 1, 2, 1, 2, "gpipe", true},
      {"dp2tp2-zero1", 2, 2, 1, 1, 1, "1f1b", true},
      // bf16 activations and gradients, f32 masters.
      {"bf16-dp2", 2, 1, 1, 1, 1, "1f1b", false, true},
      {"bf16-tp2", 1, 2, 1, 1, 1, "1f1b", false, true},
      {"bf16-pp2", 1, 1, 2, 1, 4, "1f1b", false, true},
      {"bf16-pp2-zbh1", 1, 1, 2, 1, 4, "zb-h1", false, true},
      {"bf16-dp2tp2pp2", 2, 2, 2, 1, 2, "1f1b", false, true},
      {"bf16-dp2tp2-zero1", 2, 2, 1, 1, 1, "1f1b", true, true},
      {"bf16-dp2-zero1", 2, 1, 1, 1, 1, "1f1b", true, true},
      {"bf16-dp2pp2-zero1", 2, 1, 2, 1, 2, "gpipe", true, true},
      // bf16 with --fuse: the epilogue rewrites in partitioned and pipelined programs.
      {"bf16-fuse-tp2", 1, 2, 1, 1, 1, "1f1b", false, true, true},
      {"bf16-fuse-dp2tp2pp2", 2, 2, 2, 1, 2, "1f1b", false, true, true},
      {"bf16-fuse-dp2-zero1", 2, 1, 1, 1, 1, "1f1b", true, true, true},
  };
}

std::string nameOf(const ::testing::TestParamInfo<std::tuple<std::string, Config>> &info) {
  std::string n = std::get<0>(info.param).substr(0, std::get<0>(info.param).find('.')) + "_" +
                  std::get<1>(info.param).name;
  for (char &ch : n)
    if (!isalnum(static_cast<unsigned char>(ch)))
      ch = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(Plans, Parallel,
                         ::testing::Combine(::testing::Values("gpt-tiny.mlir", "llama-tiny.mlir"),
                                            ::testing::ValuesIn(configs())),
                         nameOf);

} // namespace


namespace {
TEST(ParallelBuckets, GradientBucketsGoOutDuringBackward) {
  MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>();
  auto module = parseSourceFile<ModuleOp>(std::string(LOOM_MODELS_DIR) + "/gpt-tiny.mlir", &context);
  mlir::loom::BundleOptions o;
  o.batch = 4, o.train = true, o.dataParallel = 2;
  o.bucketBytes = 64 << 10;
  FailureOr<rt::Manifest> m = mlir::loom::lowerForward(*module, o);
  ASSERT_TRUE(succeeded(m));
  const auto &backward = m->ranks[0].programs.at("backward");
  std::vector<size_t> at;
  for (size_t i = 0; i < backward.size(); ++i)
    if (backward[i].op == "all_reduce" && backward[i].attrs.value("async", false))
      at.push_back(i);
  ASSERT_GE(at.size(), 3u) << "expected several buckets of 64 KiB";
  // The first buckets go out while most of backward is still to run.
  EXPECT_LT(at.front(), backward.size() / 2);
  EXPECT_EQ(m->ranks[0].programs.at("update").front().op, "event_wait");
  size_t reduced = 0;
  for (size_t i : at)
    reduced += backward[i].in.size();
  size_t grads = 0;
  for (const rt::Parameter &p : m->ranks[0].params)
    grads += p.grad >= 0;
  EXPECT_EQ(reduced, grads) << "every gradient in exactly one bucket";
}
} // namespace

namespace {
// The planner's count of the NCCL communicators a rank joins (what its memory
// model charges) against the communicators the runtime creates for the
// compiled bundle (loom::rt::communicatorsOf), for every rank of every plan.
TEST(ParallelCommunicators, PlannerCountsWhatTheRuntimeCreates) {
  MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>();
  // GPT-2 350M: enough layers for four stages of two chunks each.
  auto module = parseSourceFile<ModuleOp>(std::string(LOOM_MODELS_DIR) + "/gpt2-350m.mlir", &context);
  ASSERT_TRUE(module);
  struct Case {
    int64_t dp, tp, pp, vpp, m;
    const char *schedule;
    bool zero1;
  };
  const Case cases[] = {
      {2, 1, 1, 1, 1, "1f1b", false}, {2, 1, 1, 1, 1, "1f1b", true},  {1, 2, 1, 1, 1, "1f1b", false},
      {1, 1, 2, 1, 4, "1f1b", false}, {1, 1, 2, 1, 4, "zb-h1", false}, {2, 2, 1, 1, 1, "1f1b", false},
      {2, 2, 1, 1, 1, "1f1b", true},  {2, 1, 2, 1, 4, "zb-h1", false}, {1, 2, 2, 1, 4, "1f1b", false},
      {1, 1, 4, 1, 8, "1f1b", false}, {1, 1, 2, 2, 4, "interleaved", false}, {4, 1, 1, 1, 1, "1f1b", false},
      {2, 1, 2, 1, 4, "1f1b", true},  {1, 1, 3, 1, 4, "1f1b", false}, {1, 1, 4, 2, 8, "interleaved", false},
  };
  for (const Case &c : cases) {
    std::string name = "dp" + std::to_string(c.dp) + " tp" + std::to_string(c.tp) + " pp" + std::to_string(c.pp) +
                       " vpp" + std::to_string(c.vpp) + " " + c.schedule + (c.zero1 ? " zero1" : "");
    mlir::loom::BundleOptions o;
    o.batch = 8, o.train = true;
    o.dataParallel = c.dp, o.tensorParallel = c.tp, o.pipelineParallel = c.pp;
    o.virtualStages = c.vpp, o.microbatches = c.m, o.schedule = c.schedule, o.zero1 = c.zero1;
    FailureOr<rt::Manifest> m = mlir::loom::lowerForward(*module, o);
    ASSERT_TRUE(succeeded(m)) << name;
    rt::Communicators made = rt::communicatorsOf(*m);
    for (const rt::RankProgram &r : m->ranks) {
      int64_t stage = r.coords.at("pp");
      EXPECT_EQ(made.joinedBy(int(r.rank)), ::loom::planner::communicatorsPerRank(c.dp, c.tp, c.pp, c.vpp, c.zero1,
                                                                                  /*sharedAcrossStages=*/true, stage))
          << name << ", rank " << r.rank << " (stage " << stage << ")";
    }
  }
}
} // namespace

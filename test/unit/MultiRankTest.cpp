//===- MultiRankTest.cpp - Failing and stalled ranks stop everyone --------===//

#include "compiler/bundle/BundleWriter.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "runtime/src/Communicator.h"
#include "loom/rt/Error.h"
#include "runtime/src/Session.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

using namespace mlir;
namespace rt = ::loom::rt;

namespace {
std::string compileDp2() {
  MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>();
  auto module = parseSourceFile<ModuleOp>(std::string(LOOM_MODELS_DIR) + "/gpt-tiny.mlir", &context);
  std::string dir = ::testing::TempDir() + "/loom-dp2-" + std::to_string(::getpid()) + "-" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::filesystem::remove_all(dir);
  mlir::loom::BundleOptions options;
  options.batch = 4;
  options.train = true;
  options.dataParallel = 2;
  EXPECT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir)));
  return dir;
}

std::vector<std::unique_ptr<rt::Session>> open(const std::string &dir,
                                               std::shared_ptr<rt::InProcessCommunicator> comm) {
  std::vector<std::unique_ptr<rt::Session>> ranks;
  for (int r = 0; r < 2; ++r) {
    rt::SessionOptions o;
    o.rank = r;
    o.comm = comm;
    o.threads = 1;
    ranks.push_back(std::make_unique<rt::Session>(dir, o));
  }
  return ranks;
}

/// One training step on every rank, each in its own thread; a rank that
/// fails aborts the communicator. Returns each rank's error ("" if none).
std::vector<std::string> stepAll(std::vector<std::unique_ptr<rt::Session>> &ranks,
                                 const std::shared_ptr<rt::InProcessCommunicator> &comm) {
  std::vector<std::string> errors(ranks.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        ranks[r]->trainStep();
      } catch (const rt::Error &e) {
        errors[r] = e.what();
        comm->abort(int(r), e.what());
      }
    });
  for (auto &t : threads)
    t.join(); // reaching here at all means nothing hung
  return errors;
}
} // namespace

TEST(MultiRank, AFailingRankStopsTheOthers) {
  std::string dir = compileDp2();
  auto comm = std::make_shared<rt::InProcessCommunicator>(2);
  auto ranks = open(dir, comm);
  std::vector<int32_t> good(2 * 32, 1), bad(2 * 32, 1);
  bad[7] = 9999; // outside the vocabulary of 256: rank 1 fails in its forward pass
  ranks[0]->bindInput("tokens", good.data(), good.size() * 4);
  ranks[0]->bindInput("targets", good.data(), good.size() * 4);
  ranks[1]->bindInput("tokens", bad.data(), bad.size() * 4);
  ranks[1]->bindInput("targets", good.data(), good.size() * 4);
  std::vector<std::string> errors = stepAll(ranks, comm);
  EXPECT_NE(errors[1].find("token id in 'tokens' 9999 at position 7"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("rank 1 failed"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("'embedding'"), std::string::npos) << "should name the instruction: " << errors[0];
  std::filesystem::remove_all(dir);
}

TEST(MultiRank, AStalledRankTimesOut) {
  std::string dir = compileDp2();
  auto comm = std::make_shared<rt::InProcessCommunicator>(2, /*timeoutSeconds=*/0.5);
  auto ranks = open(dir, comm);
  std::vector<int32_t> tokens(2 * 32, 3);
  ranks[0]->bindInput("tokens", tokens.data(), tokens.size() * 4);
  ranks[0]->bindInput("targets", tokens.data(), tokens.size() * 4);
  // Rank 1 never runs: rank 0 must give up in its first collective.
  try {
    ranks[0]->trainStep();
    FAIL() << "rank 0 finished a step without rank 1";
  } catch (const rt::Error &e) {
    EXPECT_NE(std::string(e.what()).find("waited 0.5 s in a collective"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(MultiRank, OneSessionCannotRunAMultiRankBundle) {
  std::string dir = compileDp2();
  try {
    rt::Session s(dir, {});
    FAIL() << "opened a 2-rank bundle without a communicator";
  } catch (const rt::Error &e) {
    EXPECT_NE(std::string(e.what()).find("the bundle has 2 ranks; run it with loom-run"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(MultiRank, AStalledPipelineStageTimesOutNamingTheInstruction) {
  MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>();
  auto module = parseSourceFile<ModuleOp>(std::string(LOOM_MODELS_DIR) + "/gpt-tiny.mlir", &context);
  std::string dir = ::testing::TempDir() + "/loom-pp2-stall-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  mlir::loom::BundleOptions options;
  options.batch = 4;
  options.train = true;
  options.pipelineParallel = 2;
  options.microbatches = 2;
  ASSERT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir)));
  auto comm = std::make_shared<rt::InProcessCommunicator>(2, /*timeoutSeconds=*/0.5);
  auto ranks = open(dir, comm);
  std::vector<int32_t> tokens(4 * 32, 3);
  ranks[1]->bindInput("tokens", tokens.data(), tokens.size() * 4);
  ranks[1]->bindInput("targets", tokens.data(), tokens.size() * 4);
  // Stage 0 never runs: stage 1 waits for its first activation and gives up.
  try {
    ranks[1]->trainStep();
    FAIL() << "the last stage finished a step without the first";
  } catch (const rt::Error &e) {
    std::string what = e.what();
    EXPECT_NE(what.find("waited 0.5 s to receive message"), std::string::npos) << what;
    EXPECT_NE(what.find("from rank 0"), std::string::npos) << what;
    EXPECT_NE(what.find("instruction step["), std::string::npos) << what;
    EXPECT_NE(what.find("'recv'"), std::string::npos) << what;
  }
  std::filesystem::remove_all(dir);
}

TEST(MultiRank, AFailingTensorParallelRankStopsItsPartner) {
  MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>();
  auto module = parseSourceFile<ModuleOp>(std::string(LOOM_MODELS_DIR) + "/gpt-tiny.mlir", &context);
  std::string dir = ::testing::TempDir() + "/loom-tp2-fail-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  mlir::loom::BundleOptions options;
  options.batch = 2;
  options.train = true;
  options.tensorParallel = 2;
  ASSERT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir)));
  auto comm = std::make_shared<rt::InProcessCommunicator>(2);
  auto ranks = open(dir, comm);
  std::vector<int32_t> good(2 * 32, 1), bad(2 * 32, 1);
  bad[5] = 300; // outside the vocabulary of 256, seen by rank 1 only
  ranks[0]->bindInput("tokens", good.data(), good.size() * 4);
  ranks[1]->bindInput("tokens", bad.data(), bad.size() * 4);
  for (auto &r : ranks)
    r->bindInput("targets", good.data(), good.size() * 4);
  std::vector<std::string> errors = stepAll(ranks, comm);
  EXPECT_NE(errors[1].find("token id in 'tokens' 300 at position 5 is outside [0, 256)"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("rank 1 failed"), std::string::npos) << errors[0];
  std::filesystem::remove_all(dir);
}

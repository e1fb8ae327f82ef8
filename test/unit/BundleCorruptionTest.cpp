//===- BundleCorruptionTest.cpp - Bad bundles give clear errors -----------===//
//
// A good bundle is compiled once, then copies are damaged one way each; the
// runtime must refuse every one with a status naming the file and the field,
// never crash.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/BundleWriter.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "loom/runtime.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "runtime/src/Safetensors.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

class BundleCorruptionTest : public ::testing::Test {
protected:
  static void SetUpTestSuite() {
    mlir::MLIRContext context;
    context.loadDialect<mlir::loom::LoomDialect, mlir::func::FuncDialect>();
    auto module = mlir::parseSourceFile<mlir::ModuleOp>(
        std::string(LOOM_MODELS_DIR) + "/gpt-tiny.mlir", &context);
    ASSERT_TRUE(module);
    good = ::testing::TempDir() + "/loom-good-" + std::to_string(::getpid()) + ".loom";
    fs::remove_all(good);
    mlir::loom::BundleOptions options;
    options.batch = 2;
    ASSERT_TRUE(mlir::succeeded(mlir::loom::writeBundle(*module, options, good)));
  }
  static void TearDownTestSuite() { fs::remove_all(good); }

  std::string copy() {
    std::string dir = good + "." + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir);
    fs::copy(good, dir, fs::copy_options::recursive);
    dirs.push_back(dir);
    return dir;
  }
  ~BundleCorruptionTest() override {
    for (auto &d : dirs)
      fs::remove_all(d);
  }

  json manifest(const std::string &dir) {
    std::ifstream in(dir + "/manifest.json");
    return json::parse(in);
  }
  void writeManifest(const std::string &dir, const json &m) {
    std::ofstream(dir + "/manifest.json") << m.dump();
  }

  /// Opens `dir` and expects failure with `code` and a message containing `text`.
  void expectRefused(const std::string &dir, loom_status_code_t code, const std::string &text) {
    loom_session_t *session = nullptr;
    loom_status_t *st = loom_session_create(dir.c_str(), nullptr, &session);
    ASSERT_NE(st, nullptr) << "the damaged bundle was accepted";
    EXPECT_EQ(session, nullptr);
    EXPECT_EQ(loom_status_code(st), code) << loom_status_message(st);
    EXPECT_NE(std::string(loom_status_message(st)).find(text), std::string::npos)
        << "message: " << loom_status_message(st) << "\nexpected to contain: " << text;
    loom_status_free(st);
  }

  static std::string good;
  std::vector<std::string> dirs;
};
std::string BundleCorruptionTest::good;

TEST_F(BundleCorruptionTest, GoodBundleOpens) {
  loom_session_t *session = nullptr;
  ASSERT_EQ(loom_session_create(good.c_str(), nullptr, &session), nullptr);
  EXPECT_EQ(loom_session_num_inputs(session), 1);
  loom_tensor_info_t info;
  ASSERT_EQ(loom_session_input_info(session, 0, &info), nullptr);
  EXPECT_STREQ(info.name, "tokens");
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.shape[0], 2);
  EXPECT_EQ(info.shape[1], 32);
  loom_status_t *st = loom_session_input_info(session, 5, &info);
  EXPECT_NE(st, nullptr);
  loom_status_free(st);
  loom_session_destroy(session);
}

TEST_F(BundleCorruptionTest, MissingDirectory) {
  expectRefused("/nonexistent/model.loom", LOOM_IO_ERROR, "is not a bundle directory");
}

TEST_F(BundleCorruptionTest, TruncatedManifest) {
  std::string dir = copy();
  std::string text;
  {
    std::ifstream in(dir + "/manifest.json");
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::ofstream(dir + "/manifest.json") << text.substr(0, text.size() / 2);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "manifest.json: not valid JSON");
}

TEST_F(BundleCorruptionTest, NewerVersion) {
  std::string dir = copy();
  json m = manifest(dir);
  m["version"] = 99;
  writeManifest(dir, m);
  expectRefused(dir, LOOM_UNSUPPORTED, "bundle format version 99 is newer than this runtime");
}

TEST_F(BundleCorruptionTest, ForeignFormat) {
  std::string dir = copy();
  json m = manifest(dir);
  m["format"] = "onnx";
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "field 'format' is 'onnx', not 'loom-bundle'");
}

TEST_F(BundleCorruptionTest, MissingField) {
  std::string dir = copy();
  json m = manifest(dir);
  m["ranks"][0]["buffers"][3].erase("shape");
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "field 'ranks[0].buffers[3].shape' is missing");
}

TEST_F(BundleCorruptionTest, BufferOutsideArena) {
  std::string dir = copy();
  json m = manifest(dir);
  m["ranks"][0]["buffers"][5]["offset"] = m["ranks"][0]["arena_bytes"].get<int64_t>();
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "ranks[0].buffers[5].offset' places");
}

TEST_F(BundleCorruptionTest, BufferSizeDisagreesWithShape) {
  std::string dir = copy();
  json m = manifest(dir);
  m["ranks"][0]["buffers"][2]["bytes"] = 12;
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "ranks[0].buffers[2].bytes' is 12 but f32");
}

TEST_F(BundleCorruptionTest, InstructionNamesMissingBuffer) {
  std::string dir = copy();
  json m = manifest(dir);
  m["ranks"][0]["programs"]["forward"][0]["in"][0] = 100000;
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "names buffer 100000");
}

TEST_F(BundleCorruptionTest, InstructionShapesInconsistent) {
  std::string dir = copy();
  json m = manifest(dir);
  // Point a matmul at the wrong weight: shapes no longer form a product.
  for (auto &ins : m["ranks"][0]["programs"]["forward"])
    if (ins["op"] == "matmul") {
      ins["in"][1] = ins["in"][0];
      break;
    }
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "'matmul': shapes");
}

TEST_F(BundleCorruptionTest, UnknownInstruction) {
  std::string dir = copy();
  json m = manifest(dir);
  m["ranks"][0]["programs"]["forward"][1]["op"] = "frobnicate";
  writeManifest(dir, m);
  // Refused while the manifest is read, against the instruction table
  // (loom/instructions.def), before any backend sees the program.
  expectRefused(dir, LOOM_UNSUPPORTED,
                "manifest.json: ranks[0].programs.forward[1]: 'frobnicate' is not an instruction this runtime knows");
}

TEST_F(BundleCorruptionTest, InstructionWithTooManyInputs) {
  std::string dir = copy();
  json m = manifest(dir);
  for (auto &ins : m["ranks"][0]["programs"]["forward"])
    if (ins["op"] == "matmul") {
      ins["in"] = {ins["in"][0], ins["in"][1], ins["in"][0], ins["in"][1], ins["in"][0]};
      break;
    }
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "'matmul' takes 2 to 4 inputs, got 5");
}

TEST_F(BundleCorruptionTest, InstructionWithUnknownAttribute) {
  std::string dir = copy();
  json m = manifest(dir);
  m["ranks"][0]["programs"]["forward"][1]["attrs"]["frobnicate"] = true;
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "ranks[0].programs.forward[1]: ");
  expectRefused(dir, LOOM_INVALID_BUNDLE, "has no attribute 'frobnicate'");
}

TEST_F(BundleCorruptionTest, MissingWeights) {
  std::string dir = copy();
  fs::remove(dir + "/weights.safetensors");
  expectRefused(dir, LOOM_IO_ERROR, "weights.safetensors");
}

TEST_F(BundleCorruptionTest, TruncatedWeights) {
  std::string dir = copy();
  fs::resize_file(dir + "/weights.safetensors", fs::file_size(dir + "/weights.safetensors") / 2);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "the file is truncated");
}

TEST_F(BundleCorruptionTest, WeightShapeMismatch) {
  std::string dir = copy();
  loom::rt::SafetensorsFile w = loom::rt::readSafetensors(dir + "/weights.safetensors");
  std::vector<loom::rt::SafetensorsTensorRef> refs;
  for (auto &[name, e] : w.tensors) {
    loom::rt::Shape shape = e.shape;
    size_t bytes = e.bytes;
    if (name == "wpe") { // [32, 64] -> [16, 64]
      shape[0] = 16;
      bytes /= 2;
    }
    refs.push_back({name, e.dtype, shape, w.data.data() + e.offset, bytes});
  }
  loom::rt::writeSafetensors(dir + "/weights.safetensors", refs);
  expectRefused(dir, LOOM_INVALID_BUNDLE,
                "parameter 'wpe' is f32[16, 64] in the file but f32[32, 64] in the bundle");
}

TEST_F(BundleCorruptionTest, WeightMissing) {
  std::string dir = copy();
  loom::rt::SafetensorsFile w = loom::rt::readSafetensors(dir + "/weights.safetensors");
  std::vector<loom::rt::SafetensorsTensorRef> refs;
  for (auto &[name, e] : w.tensors)
    if (name != "layer.1.mlp.fc.w")
      refs.push_back({name, e.dtype, e.shape, w.data.data() + e.offset, e.bytes});
  loom::rt::writeSafetensors(dir + "/weights.safetensors", refs);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "parameter 'layer.1.mlp.fc.w' is missing");
}

TEST_F(BundleCorruptionTest, NotJsonAtAll) {
  std::string dir = copy();
  std::ofstream(dir + "/manifest.json") << std::string("\x00\x01\x02garbage", 10);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "not valid JSON");
}

TEST_F(BundleCorruptionTest, AtomicWriteLeavesNoTemporaryFiles) {
  std::string dir = copy();
  loom_session_t *session = nullptr;
  ASSERT_EQ(loom_session_create(dir.c_str(), nullptr, &session), nullptr);
  ASSERT_EQ(loom_session_save_weights(session, (dir + "/w.safetensors").c_str()), nullptr);
  for (auto &entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().string().find(".tmp-"), std::string::npos) << entry.path();
  loom_status_t *st = loom_session_save_weights(session, "/nonexistent-dir/w.safetensors");
  ASSERT_NE(st, nullptr);
  EXPECT_EQ(loom_status_code(st), LOOM_IO_ERROR);
  loom_status_free(st);
  loom_session_destroy(session);
}

TEST_F(BundleCorruptionTest, ShardThatDoesNotFitItsParameter) {
  std::string dir = copy();
  json m = manifest(dir);
  json &param = m["ranks"][0]["parameters"][0]; // wte, f32[256, 64]
  param["shard"] = {{"full_shape", {256, 64}}, {"axis", 0}, {"parts", 3}, {"index", 0}, {"blocks", 1}};
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "field 'ranks[0].parameters[0].shard' does not describe a part");
}

TEST_F(BundleCorruptionTest, GroupWithoutTheRankItself) {
  std::string dir = copy();
  json m = manifest(dir);
  m["ranks"][0]["groups"] = {{"tp", {1, 2}}};
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "does not contain the rank itself");
}

TEST_F(BundleCorruptionTest, FusedKernelWithForwardReference) {
  std::string dir = copy();
  json m = manifest(dir);
  json &forward = m["ranks"][0]["programs"]["forward"];
  // Replace the first add by a fused kernel whose step reads a value not yet defined.
  for (json &ins : forward)
    if (ins["op"] == "add") {
      ins["op"] = "fused";
      ins["attrs"] = {{"kernel", "fused_0"},
                      {"steps", {{{"op", "add"}, {"args", {0, 5}}}}},
                      {"results", {2}}};
      break;
    }
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "step argument 5 is not a value defined before it");
}

TEST_F(BundleCorruptionTest, KernelsFileOutsideTheBundle) {
  std::string dir = copy();
  json m = manifest(dir);
  m["kernels"] = "../elsewhere.ptx";
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "field 'kernels' must be a file name inside the bundle");
}

TEST_F(BundleCorruptionTest, CollectiveOutsideLoomRun) {
  std::string dir = copy();
  json m = manifest(dir);
  json &forward = m["ranks"][0]["programs"]["forward"];
  json first = forward[0];
  forward.insert(forward.begin(), json{{"op", "all_reduce"}, {"in", first["out"]}, {"out", first["out"]},
                                       {"attrs", {{"group", "dp"}}}});
  writeManifest(dir, m);
  expectRefused(dir, LOOM_UNSUPPORTED, "needs the other ranks; run multi-rank bundles with loom-run");
}

} // namespace

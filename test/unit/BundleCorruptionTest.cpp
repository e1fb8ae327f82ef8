//===- BundleCorruptionTest.cpp - Bad bundles give clear errors -----------===//
//
// A good bundle is compiled once, then copies are damaged one way each; the
// runtime must refuse every one with a status naming the file and the field,
// never crash. Built without the compiler (LOOM_CORRUPTION_RUNTIME_ONLY, the
// sanitizer build of scripts/sanitize.sh), the good bundle is the one
// `loomc compile models/gpt-tiny.mlir --batch 2` wrote at $LOOM_TEST_BUNDLE.
//
//===----------------------------------------------------------------------===//

#include "loom/runtime.h"
#include "loom/rt/Bundle.h"
#include "loom/rt/Safetensors.h"
#ifndef LOOM_CORRUPTION_RUNTIME_ONLY
#include "compiler/bundle/BundleWriter.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#endif

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

class BundleCorruptionTest : public ::testing::Test {
protected:
  static void SetUpTestSuite() {
    good = ::testing::TempDir() + "/loom-good-" + std::to_string(::getpid()) + ".loom";
    fs::remove_all(good);
#ifdef LOOM_CORRUPTION_RUNTIME_ONLY
    const char *compiled = std::getenv("LOOM_TEST_BUNDLE");
    ASSERT_NE(compiled, nullptr) << "set LOOM_TEST_BUNDLE to a bundle of gpt-tiny at batch 2";
    fs::copy(compiled, good, fs::copy_options::recursive);
#else
    mlir::MLIRContext context;
    context.loadDialect<mlir::loom::LoomDialect, mlir::func::FuncDialect>();
    auto module = mlir::parseSourceFile<mlir::ModuleOp>(
        std::string(LOOM_MODELS_DIR) + "/gpt-tiny.mlir", &context);
    ASSERT_TRUE(module);
    mlir::loom::BundleOptions options;
    options.batch = 2;
    ASSERT_TRUE(mlir::succeeded(mlir::loom::writeBundle(*module, options, good)));
#endif
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

TEST_F(BundleCorruptionTest, BufferOffsetThatOverflows) {
  // offset + bytes wraps past INT64_MAX; the bounds check must still fail.
  std::string dir = copy();
  json m = manifest(dir);
  m["ranks"][0]["buffers"][5]["offset"] = INT64_MAX - 7;
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "ranks[0].buffers[5].offset' places");
}

TEST_F(BundleCorruptionTest, MisalignedBuffer) {
  std::string dir = copy();
  json m = manifest(dir);
  json &b = m["ranks"][0]["buffers"][5];
  ASSERT_EQ(b["dtype"], "f32");
  b["offset"] = b["offset"].get<int64_t>() + 3;
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "ranks[0].buffers[5].offset' is " +
                                              std::to_string(b["offset"].get<int64_t>()) +
                                              ", not a multiple of 4 (the size of f32)");
}

/// Ids of the first two buffers with `role` that are not views.
static std::vector<int64_t> buffersWithRole(const json &m, const std::string &role) {
  std::vector<int64_t> ids;
  for (const json &b : m["ranks"][0]["buffers"])
    if (b["role"] == role && !b.contains("view_of") && ids.size() < 2)
      ids.push_back(b["id"].get<int64_t>());
  return ids;
}

TEST_F(BundleCorruptionTest, ParametersThatOverlap) {
  std::string dir = copy();
  json m = manifest(dir);
  std::vector<int64_t> params = buffersWithRole(m, "param");
  ASSERT_EQ(params.size(), 2u);
  json &buffers = m["ranks"][0]["buffers"];
  buffers[params[1]]["offset"] = buffers[params[0]]["offset"];
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE,
                "ranks[0].buffers[" + std::to_string(params[1]) + "].offset' places param '" +
                    buffers[params[1]]["name"].get<std::string>() + "'");
  expectRefused(dir, LOOM_INVALID_BUNDLE, "parameters, inputs, outputs and state may not share storage");
}

TEST_F(BundleCorruptionTest, ActivationOverAnInput) {
  std::string dir = copy();
  json m = manifest(dir);
  std::vector<int64_t> inputs = buffersWithRole(m, "input"), acts = buffersWithRole(m, "activation");
  ASSERT_FALSE(inputs.empty());
  ASSERT_FALSE(acts.empty());
  json &buffers = m["ranks"][0]["buffers"];
  buffers[acts[0]]["offset"] = buffers[inputs[0]]["offset"];
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "over input 'tokens'");
}

TEST_F(BundleCorruptionTest, ActivationsMayShareStorage) {
  // The compiler packs activations by lifetime; two at one offset are fine
  // as far as the reader is concerned.
  std::string dir = copy();
  json m = manifest(dir);
  std::vector<int64_t> acts = buffersWithRole(m, "activation");
  ASSERT_EQ(acts.size(), 2u);
  json &buffers = m["ranks"][0]["buffers"];
  ASSERT_LE(buffers[acts[1]]["bytes"].get<int64_t>(), buffers[acts[0]]["bytes"].get<int64_t>());
  buffers[acts[1]]["offset"] = buffers[acts[0]]["offset"];
  writeManifest(dir, m);
  EXPECT_NO_THROW(loom::rt::readManifest(dir));
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

TEST_F(BundleCorruptionTest, ThreadCountOutOfRange) {
  for (int32_t threads : {100000, -1}) {
    loom_session_options_t options;
    loom_session_options_init(&options);
    options.num_threads = threads;
    loom_session_t *session = nullptr;
    loom_status_t *st = loom_session_create(good.c_str(), &options, &session);
    ASSERT_NE(st, nullptr) << "num_threads " << threads << " was accepted";
    EXPECT_EQ(session, nullptr);
    EXPECT_EQ(loom_status_code(st), LOOM_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(loom_status_message(st)),
              "options.num_threads must be from 0 (one per core) to 1024, got " + std::to_string(threads));
    loom_status_free(st);
  }
}

TEST_F(BundleCorruptionTest, TimeoutOutOfRange) {
  loom_session_options_t options;
  loom_session_options_init(&options);
  EXPECT_EQ(options.timeout_seconds, 300.0);
  for (double seconds : {0.0, -1.0, 1e9, std::nan(""), double(INFINITY)}) {
    options.timeout_seconds = seconds;
    loom_session_t *session = nullptr;
    loom_status_t *st = loom_session_create(good.c_str(), &options, &session);
    ASSERT_NE(st, nullptr) << "timeout_seconds " << seconds << " was accepted";
    EXPECT_EQ(session, nullptr);
    EXPECT_EQ(loom_status_code(st), LOOM_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(loom_status_message(st))
                  .rfind("options.timeout_seconds must be above 0 and at most 86400 seconds, got ", 0),
              0u)
        << loom_status_message(st);
    loom_status_free(st);
  }
  options.timeout_seconds = 0.5;
  loom_session_t *session = nullptr;
  ASSERT_EQ(loom_session_create(good.c_str(), &options, &session), nullptr);
  loom_session_destroy(session);
}

/// The bytes of parameter `name` as the session holds it now.
static std::vector<char> parameterBytes(loom_session_t *session, const std::string &path,
                                        const std::string &name) {
  EXPECT_EQ(loom_session_save_weights(session, path.c_str()), nullptr);
  loom::rt::SafetensorsFile f = loom::rt::readSafetensors(path);
  const char *p = f.bytesOf(name);
  return std::vector<char>(p, p + f.tensors.at(name).bytes);
}

TEST_F(BundleCorruptionTest, LoadWeightsChecksEveryTensorFirst) {
  // wte (the first parameter) is good and different; a later one is missing.
  // The load is refused and wte keeps its old value.
  std::string dir = copy();
  loom_session_t *session = nullptr;
  ASSERT_EQ(loom_session_create(dir.c_str(), nullptr, &session), nullptr);
  std::vector<char> before = parameterBytes(session, dir + "/before.safetensors", "wte");
  loom::rt::SafetensorsFile w = loom::rt::readSafetensors(dir + "/weights.safetensors");
  std::vector<float> sevens(w.tensors.at("wte").bytes / 4, 7.0f);
  std::vector<loom::rt::SafetensorsTensorRef> refs;
  for (auto &[name, e] : w.tensors) {
    if (name == "layer.1.mlp.fc.w")
      continue;
    const void *data = name == "wte" ? static_cast<const void *>(sevens.data()) : w.data.data() + e.offset;
    refs.push_back({name, e.dtype, e.shape, data, e.bytes});
  }
  std::string bad = dir + "/bad.safetensors";
  loom::rt::writeSafetensors(bad, refs);
  loom_status_t *st = loom_session_load_weights(session, bad.c_str());
  ASSERT_NE(st, nullptr);
  EXPECT_NE(std::string(loom_status_message(st)).find("parameter 'layer.1.mlp.fc.w' is missing"),
            std::string::npos)
      << loom_status_message(st);
  loom_status_free(st);
  EXPECT_EQ(parameterBytes(session, dir + "/after.safetensors", "wte"), before)
      << "a refused load changed a parameter";
  loom_session_destroy(session);
}

/// A process id that no process has now: a child that has exited.
static pid_t deadPid() {
  pid_t pid = ::fork();
  if (pid == 0)
    ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

TEST_F(BundleCorruptionTest, SaveRemovesStaleTemporaries) {
  std::string dir = copy();
  std::string target = dir + "/w.safetensors";
  std::string stale = target + ".tmp-" + std::to_string(deadPid());
  std::string live = target + ".tmp-1"; // init: running, so possibly still writing
  std::ofstream(stale) << "interrupted";
  std::ofstream(live) << "in progress";
  loom_session_t *session = nullptr;
  ASSERT_EQ(loom_session_create(dir.c_str(), nullptr, &session), nullptr);
  ASSERT_EQ(loom_session_save_weights(session, target.c_str()), nullptr);
  EXPECT_FALSE(fs::exists(stale)) << "a dead process's temporary file was left";
  EXPECT_TRUE(fs::exists(live)) << "a running process's temporary file was removed";
  loom_session_destroy(session);
}

#ifndef LOOM_CORRUPTION_RUNTIME_ONLY
TEST_F(BundleCorruptionTest, CompileReplacesABundleAsAUnit) {
  std::string dir = copy();
  std::string stale = dir + ".tmp-" + std::to_string(deadPid());
  fs::create_directory(stale);
  std::ofstream(stale + "/manifest.json") << "half";
  std::ofstream(dir + "/leftover.txt") << "from the old bundle";
  mlir::MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, mlir::func::FuncDialect>();
  auto module = mlir::parseSourceFile<mlir::ModuleOp>(std::string(LOOM_MODELS_DIR) + "/gpt-tiny.mlir",
                                                      &context);
  ASSERT_TRUE(module);
  mlir::loom::BundleOptions options;
  options.batch = 3;
  ASSERT_TRUE(mlir::succeeded(mlir::loom::writeBundle(*module, options, dir)));
  EXPECT_EQ(manifest(dir)["batch"], 3);
  EXPECT_FALSE(fs::exists(dir + "/leftover.txt")) << "the new bundle was mixed into the old";
  EXPECT_FALSE(fs::exists(stale)) << "a killed compile's staging directory was left";
  for (auto &entry : fs::directory_iterator(fs::path(dir).parent_path()))
    EXPECT_EQ(entry.path().string().find(dir + ".tmp-"), std::string::npos) << entry.path();

  // A directory that is not a bundle is never replaced.
  std::string other = dir + ".notes";
  fs::create_directory(other);
  dirs.push_back(other);
  std::ofstream(other + "/notes.txt") << "keep me";
  mlir::ScopedDiagnosticHandler quiet(&context, [](mlir::Diagnostic &d) {
    EXPECT_NE(d.str().find("exists and is not a bundle directory; refusing to replace it"),
              std::string::npos)
        << d.str();
    return mlir::success();
  });
  EXPECT_TRUE(mlir::failed(mlir::loom::writeBundle(*module, options, other)));
  EXPECT_TRUE(fs::exists(other + "/notes.txt"));
}
#endif

TEST_F(BundleCorruptionTest, ShardThatDoesNotFitItsParameter) {
  std::string dir = copy();
  json m = manifest(dir);
  json &param = m["ranks"][0]["parameters"][0]; // wte, f32[256, 64]
  param["shard"] = {{"full_shape", {256, 64}}, {"axis", 0}, {"parts", 3}, {"index", 0}, {"blocks", 1}};
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "field 'ranks[0].parameters[0].shard' does not describe a part");
}

TEST_F(BundleCorruptionTest, ShardWhoseSlicesOverflow) {
  // blocks x parts wraps to 0; checking divisibility by it must not trap.
  std::string dir = copy();
  json m = manifest(dir);
  json &param = m["ranks"][0]["parameters"][0]; // wte, f32[256, 64]
  param["shard"] = {{"full_shape", {256, 64}}, {"axis", 0}, {"parts", int64_t(1) << 32},
                    {"index", 0}, {"blocks", int64_t(1) << 32}};
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "field 'ranks[0].parameters[0].shard' does not describe a part");
}

TEST_F(BundleCorruptionTest, ZeroThreeShardOfTheWrongLength) {
  // A ZeRO-3 chunk is one row of ceil(elements / zero_parts); wte is
  // f32[256, 64], so a chunk of three parts would be 5462 long, not 16384.
  std::string dir = copy();
  json m = manifest(dir);
  json &param = m["ranks"][0]["parameters"][0];
  param["shard"] = {{"full_shape", {256, 64}}, {"axis", -1},       {"parts", 1},
                    {"index", 0},              {"zero_parts", 3}, {"zero_index", 0}, {"blocks", 1}};
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "field 'ranks[0].parameters[0].shard' does not describe a part");
  param["shard"]["zero_parts"] = 2, param["shard"]["zero_index"] = 2;
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "zero_index' must be below zero_parts (2)");
  param["shard"].erase("zero_parts"), param["shard"].erase("zero_index");
  writeManifest(dir, m); // axis -1 names no split at all
  expectRefused(dir, LOOM_INVALID_BUNDLE, "parameters[0].shard.axis");
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

TEST_F(BundleCorruptionTest, SliceViewsStayInsideTheirBuffer) {
  // A slice view (loom-overlap-tensor-gather's rows of a product) is a
  // contiguous part of the buffer it views, `view_offset` bytes in. Made
  // here of two f32 activations: the later one becomes the second half of
  // the earlier.
  std::string dir = copy();
  json m = manifest(dir);
  json &buffers = m["ranks"][0]["buffers"];
  std::vector<int64_t> f32;
  for (const json &b : buffers)
    if (b["role"] == "activation" && !b.contains("view_of") && b["dtype"] == "f32" &&
        b["bytes"].get<int64_t>() % 8 == 0)
      f32.push_back(b["id"].get<int64_t>());
  ASSERT_GE(f32.size(), 2u) << "the bundle has fewer than two f32 activations";
  json &v = buffers[f32[1]];
  const json &root = buffers[f32[0]];
  int64_t half = root["bytes"].get<int64_t>() / 2;
  v["view_of"] = f32[0];
  v["shape"] = json::array({half / 4});
  v["bytes"] = half;
  v["view_offset"] = half;
  v["offset"] = root["offset"].get<int64_t>() + half;
  writeManifest(dir, m);
  EXPECT_NO_THROW(loom::rt::readManifest(dir)); // the second half
  std::string at = "buffers[" + std::to_string(f32[1]) + "]";
  v["view_offset"] = half + 4; // one element past the end
  v["offset"] = root["offset"].get<int64_t>() + half + 4;
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, at + ".view_offset' must place the slice inside the viewed buffer");
  v["view_offset"] = half; // where the offset does not say
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, "must place the slice inside the viewed buffer, at its offset plus");
  v.erase("view_of"); // not a view at all
  writeManifest(dir, m);
  expectRefused(dir, LOOM_INVALID_BUNDLE, at + ".view_offset' is only for a view");
}

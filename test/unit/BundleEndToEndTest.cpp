//===- BundleEndToEndTest.cpp - Compile, run on the CPU, compare ----------===//
//
// Each model is compiled to a bundle, run through the C API on the CPU
// backend, and compared with the independent double-precision reference
// evaluator working on the IR (test/reference). Tolerance (f32): relative
// error ||got - ref||_2 / ||ref||_2 <= 1e-5 for every output.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/BundleWriter.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "loom/runtime.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "passes/Passes.h"
#include "loom/rt/Init.h"
#include "loom/rt/Safetensors.h"
#include "test/reference/ReferenceEvaluator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>

using namespace mlir;
namespace rt = ::loom::rt;
namespace ref = ::loom::reference;

namespace {

std::string tempDir(const std::string &name) {
  std::string dir = ::testing::TempDir() + "/loom-" + name + "-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

class BundleTest : public ::testing::Test {
protected:
  BundleTest() { context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>(); }

  OwningOpRef<ModuleOp> parse(const std::string &file) {
    auto m = parseSourceFile<ModuleOp>(std::string(LOOM_MODELS_DIR) + "/" + file, &context);
    EXPECT_TRUE(m) << file;
    return m;
  }

  /// Compiles `file`, runs it on the CPU and against the reference; returns
  /// the normwise relative error of each output.
  std::vector<double> compileRunCompare(const std::string &file, int64_t batch) {
    OwningOpRef<ModuleOp> module = parse(file);
    if (!module)
      return {};
    std::string dir = tempDir(file);
    mlir::loom::BundleOptions options;
    options.batch = batch;
    options.seed = 7;
    options.modelName = file;
    rt::Manifest manifest;
    if (failed(mlir::loom::writeBundle(*module, options, dir, &manifest))) {
      ADD_FAILURE() << "cannot compile " << file;
      return {};
    }

    loom_session_options_t opts;
    loom_session_options_init(&opts);
    loom_session_t *session = nullptr;
    loom_status_t *st = loom_session_create(dir.c_str(), &opts, &session);
    if (st) {
      ADD_FAILURE() << loom_status_message(st);
      loom_status_free(st);
      return {};
    }

    // Inputs: ids below their limit, floats from N(0, 1); the same values
    // go to the reference.
    std::mt19937 rng(11);
    std::vector<ref::Tensor> refInputs;
    const rt::RankProgram &rank = manifest.ranks.front();
    for (const rt::NamedBuffer &in : rank.inputs) {
      const rt::Buffer &b = rank.buffers[in.buffer];
      ref::Tensor t{b.shape, {}};
      int64_t n = rt::numElements(b.shape).value_or(0);
      std::vector<char> bytes(b.bytes);
      for (int64_t i = 0; i < n; ++i) {
        if (b.dtype == LOOM_I32) {
          int32_t v = static_cast<int32_t>(rng() % uint32_t(in.limit > 0 ? in.limit : 2));
          reinterpret_cast<int32_t *>(bytes.data())[i] = v;
          t.data.push_back(v);
        } else {
          float v = std::normal_distribution<float>()(rng);
          reinterpret_cast<float *>(bytes.data())[i] = v;
          t.data.push_back(v);
        }
      }
      EXPECT_EQ(loom_session_bind_input(session, in.name.c_str(), bytes.data(), bytes.size()), nullptr);
      refInputs.push_back(std::move(t));
    }
    st = loom_session_run_forward(session);
    EXPECT_EQ(st, nullptr) << loom_status_message(st);
    loom_status_free(st);

    rt::SafetensorsFile weights = rt::readSafetensors(dir + "/weights.safetensors");
    auto params = [&](const std::string &name) {
      const rt::SafetensorsEntry &e = weights.tensors.at(name);
      const float *p = reinterpret_cast<const float *>(weights.data.data() + e.offset);
      return ref::Tensor{e.shape, std::vector<double>(p, p + e.bytes / 4)};
    };
    OwningOpRef<ModuleOp> specialised(module->clone());
    EXPECT_TRUE(succeeded(mlir::loom::specializeBatch(*specialised, batch)));
    std::vector<ref::Tensor> expected;
    std::string error;
    EXPECT_TRUE(ref::evaluateForward(*specialised, refInputs, params, expected, error)) << error;

    std::vector<double> errors;
    for (size_t o = 0; o < rank.outputs.size() && o < expected.size(); ++o) {
      const rt::Buffer &b = rank.buffers[rank.outputs[o].buffer];
      std::vector<float> got(b.bytes / 4);
      EXPECT_EQ(loom_session_read_output(session, rank.outputs[o].name.c_str(), got.data(), b.bytes),
                nullptr);
      EXPECT_EQ(got.size(), expected[o].data.size());
      double diff2 = 0, ref2 = 0;
      for (size_t i = 0; i < got.size() && i < expected[o].data.size(); ++i) {
        diff2 += (got[i] - expected[o].data[i]) * (got[i] - expected[o].data[i]);
        ref2 += expected[o].data[i] * expected[o].data[i];
      }
      errors.push_back(std::sqrt(diff2 / std::max(ref2, 1e-300)));
      std::printf("%s output %s: relative error %.3g\n", file.c_str(), rank.outputs[o].name.c_str(),
                  errors.back());
    }
    loom_session_destroy(session);
    std::filesystem::remove_all(dir);
    return errors;
  }

  MLIRContext context;
};

constexpr double kF32Tolerance = 1e-5;

TEST_F(BundleTest, GptTinyMatchesReference) {
  for (double e : compileRunCompare("gpt-tiny.mlir", 2))
    EXPECT_LE(e, kF32Tolerance);
}

TEST_F(BundleTest, LlamaTinyMatchesReference) {
  for (double e : compileRunCompare("llama-tiny.mlir", 2))
    EXPECT_LE(e, kF32Tolerance);
}

TEST_F(BundleTest, BertTinyMatchesReference) {
  for (double e : compileRunCompare("bert-tiny.mlir", 2))
    EXPECT_LE(e, kF32Tolerance);
}

TEST_F(BundleTest, MlpMatchesReference) {
  for (double e : compileRunCompare("mlp.mlir", 4))
    EXPECT_LE(e, kF32Tolerance);
}

/// The full ResNet-50 at 224x224 (about 20 s of reference evaluation). Batch
/// statistics over few values make small ResNets ill-conditioned: at 32x32
/// with batch 2, rounding only the *input* to f32 already moves the output by
/// 26%, so the check uses the real size, where that sensitivity is 1e-6.
TEST_F(BundleTest, Resnet50MatchesReference) {
  for (double e : compileRunCompare("resnet50.mlir", 1))
    EXPECT_LE(e, kF32Tolerance);
}

/// The full-size GPT-2 124M and BERT-base (a few minutes of reference
/// evaluation between them); the larger checked-in models share their
/// writers and ops and are lowered and memory-planned below.
TEST_F(BundleTest, Gpt2SmallMatchesReference) {
  for (double e : compileRunCompare("gpt2-124m.mlir", 1))
    EXPECT_LE(e, kF32Tolerance);
}

TEST_F(BundleTest, BertBaseMatchesReference) {
  for (double e : compileRunCompare("bert-base.mlir", 1))
    EXPECT_LE(e, kF32Tolerance);
}

/// GPT-2 350M takes about ten minutes of reference evaluation, too long for
/// CI: run it with --gtest_also_run_disabled_tests (passed 2026-11-26: 680 s
/// on two cores).
TEST_F(BundleTest, DISABLED_Gpt2MediumMatchesReference) {
  for (double e : compileRunCompare("gpt2-350m.mlir", 1))
    EXPECT_LE(e, kF32Tolerance);
}

/// TinyLlama (1.1B, sequence 2048): over an hour of reference evaluation on
/// two cores; run it with --gtest_also_run_disabled_tests (passed 2026-11-26:
/// 4,478 s on two cores).
TEST_F(BundleTest, DISABLED_Llama1bMatchesReference) {
  for (double e : compileRunCompare("llama-1.1b.mlir", 1))
    EXPECT_LE(e, kF32Tolerance);
}

/// The large checked-in models are lowered and memory-planned (running them
/// on a CPU in CI would take too long); the plan must never let two live
/// activations share bytes.
TEST_F(BundleTest, LargeModelsLowerWithSoundMemoryPlans) {
  for (const char *file : {"gpt2-124m.mlir", "gpt2-350m.mlir", "bert-base.mlir",
                           "llama-1.1b.mlir", "resnet50.mlir", "gpt-tiny.mlir"}) {
    OwningOpRef<ModuleOp> module = parse(file);
    ASSERT_TRUE(module);
    mlir::loom::BundleOptions options;
    options.batch = 2;
    FailureOr<rt::Manifest> m = mlir::loom::lowerForward(*module, options);
    ASSERT_TRUE(succeeded(m)) << file;
    const rt::RankProgram &rank = m->ranks.front();
    const auto &program = rank.programs.at("forward");
    std::vector<int64_t> first(rank.buffers.size(), INT64_MAX), last(rank.buffers.size(), -1);
    auto root = [&](int64_t id) {
      while (rank.buffers[id].viewOf >= 0)
        id = rank.buffers[id].viewOf;
      return id;
    };
    for (size_t i = 0; i < program.size(); ++i)
      for (const auto *ids : {&program[i].in, &program[i].out})
        for (int64_t id : *ids) {
          first[root(id)] = std::min<int64_t>(first[root(id)], i);
          last[root(id)] = std::max<int64_t>(last[root(id)], i);
        }
    std::vector<const rt::Buffer *> acts;
    for (const rt::Buffer &b : rank.buffers)
      if (b.role == rt::BufferRole::Activation && b.viewOf < 0 && last[b.id] >= 0)
        acts.push_back(&b);
    for (size_t i = 0; i < acts.size(); ++i)
      for (size_t j = i + 1; j < acts.size(); ++j) {
        const rt::Buffer &a = *acts[i], &b = *acts[j];
        bool liveTogether = !(last[a.id] < first[b.id] || last[b.id] < first[a.id]);
        bool overlap = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
        ASSERT_FALSE(liveTogether && overlap) << file << ": " << a.name << " and " << b.name;
      }
    EXPECT_LE(rank.peakActivationBytes + 0, rank.arenaBytes);
  }
}

TEST_F(BundleTest, TokenOutsideVocabularyIsAnError) {
  OwningOpRef<ModuleOp> module = parse("gpt-tiny.mlir");
  std::string dir = tempDir("vocab");
  mlir::loom::BundleOptions options;
  ASSERT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir)));
  loom_session_t *session = nullptr;
  ASSERT_EQ(loom_session_create(dir.c_str(), nullptr, &session), nullptr);
  std::vector<int32_t> tokens(32, 1);
  tokens[5] = 300; // vocabulary is 256
  ASSERT_EQ(loom_session_bind_input(session, "tokens", tokens.data(), tokens.size() * 4), nullptr);
  loom_status_t *st = loom_session_run_forward(session);
  ASSERT_NE(st, nullptr);
  EXPECT_EQ(loom_status_code(st), LOOM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(loom_status_message(st)).find("token id in 'tokens' 300 at position 5 is outside [0, 256)"),
            std::string::npos)
      << loom_status_message(st);
  loom_status_free(st);
  // A wrong size is refused too.
  st = loom_session_bind_input(session, "tokens", tokens.data(), 8);
  ASSERT_NE(st, nullptr);
  EXPECT_NE(std::string(loom_status_message(st)).find("got 8 bytes"), std::string::npos);
  loom_status_free(st);
  loom_session_destroy(session);
  std::filesystem::remove_all(dir);
}

TEST_F(BundleTest, OutputsInPlaceAndInputsFromDevices) {
  OwningOpRef<ModuleOp> module = parse("gpt-tiny.mlir");
  std::string dir = tempDir("memory");
  mlir::loom::BundleOptions options;
  ASSERT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir)));
  loom_session_t *session = nullptr;
  ASSERT_EQ(loom_session_create(dir.c_str(), nullptr, &session), nullptr);
  loom_device_t device{LOOM_DEVICE_CUDA, 7};
  ASSERT_EQ(loom_session_device(session, &device), nullptr);
  EXPECT_EQ(device.type, LOOM_DEVICE_CPU);
  EXPECT_EQ(device.id, 0);
  std::vector<int32_t> tokens(32);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = int32_t(i * 7 % 256);
  // Host memory, named as such or by NULL, binds as loom_session_bind_input does.
  ASSERT_EQ(loom_session_bind_input_from(session, "tokens", tokens.data(), 128, &device), nullptr);
  ASSERT_EQ(loom_session_bind_input_from(session, "tokens", tokens.data(), 128, nullptr), nullptr);
  ASSERT_EQ(loom_session_run_forward(session), nullptr);
  void *data = nullptr;
  ASSERT_EQ(loom_session_output_data(session, "logits", &data), nullptr);
  ASSERT_NE(data, nullptr);
  std::vector<float> copy(32 * 256);
  ASSERT_EQ(loom_session_read_output(session, "logits", copy.data(), copy.size() * 4), nullptr);
  EXPECT_EQ(0, std::memcmp(data, copy.data(), copy.size() * 4));
  // GPU memory for the CPU backend, an unknown device type, an unknown output.
  loom_device_t gpu{LOOM_DEVICE_CUDA, 0};
  loom_status_t *st = loom_session_bind_input_from(session, "tokens", tokens.data(), 128, &gpu);
  ASSERT_NE(st, nullptr);
  EXPECT_EQ(loom_status_code(st), LOOM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(loom_status_message(st)).find("runs on the cpu backend"), std::string::npos)
      << loom_status_message(st);
  loom_status_free(st);
  loom_device_t odd{static_cast<loom_device_type_t>(9), 0};
  st = loom_session_bind_input_from(session, "tokens", tokens.data(), 128, &odd);
  ASSERT_NE(st, nullptr);
  EXPECT_EQ(loom_status_code(st), LOOM_INVALID_ARGUMENT);
  loom_status_free(st);
  st = loom_session_output_data(session, "probs", &data);
  ASSERT_NE(st, nullptr);
  EXPECT_NE(std::string(loom_status_message(st)).find("no output named 'probs'"), std::string::npos);
  EXPECT_EQ(data, nullptr);
  loom_status_free(st);
  loom_session_destroy(session);
  std::filesystem::remove_all(dir);
}

TEST_F(BundleTest, SaveAndLoadWeightsRoundTrip) {
  OwningOpRef<ModuleOp> module = parse("mlp.mlir");
  std::string dir = tempDir("weights");
  mlir::loom::BundleOptions options;
  options.seed = 3;
  ASSERT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir)));
  loom_session_t *session = nullptr;
  ASSERT_EQ(loom_session_create(dir.c_str(), nullptr, &session), nullptr);
  std::string saved = dir + "/saved.safetensors";
  ASSERT_EQ(loom_session_save_weights(session, saved.c_str()), nullptr);
  ASSERT_EQ(loom_session_load_weights(session, saved.c_str()), nullptr);
  rt::SafetensorsFile a = rt::readSafetensors(dir + "/weights.safetensors");
  rt::SafetensorsFile b = rt::readSafetensors(saved);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (auto &[name, e] : a.tensors)
    EXPECT_EQ(0, std::memcmp(a.data.data() + e.offset, b.data.data() + b.tensors.at(name).offset, e.bytes)) << name;
  // --weights: a new bundle from saved weights has the same parameters.
  options.weightsFile = saved;
  options.seed = 99;
  std::string dir2 = tempDir("weights2");
  ASSERT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir2)));
  rt::SafetensorsFile c = rt::readSafetensors(dir2 + "/weights.safetensors");
  for (auto &[name, e] : a.tensors)
    EXPECT_EQ(0, std::memcmp(a.data.data() + e.offset, c.data.data() + c.tensors.at(name).offset, e.bytes)) << name;
  loom_session_destroy(session);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir2);
}

TEST(Init, SeededAndDistributed) {
  rt::ParamInit normal{"normal", 0.02};
  std::vector<float> a = rt::initialValues(normal, 100000, 1, "w");
  std::vector<float> b = rt::initialValues(normal, 100000, 1, "w");
  std::vector<float> c = rt::initialValues(normal, 100000, 2, "w");
  std::vector<float> d = rt::initialValues(normal, 100000, 1, "v");
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, d);
  double mean = 0, sq = 0;
  for (float v : a)
    mean += v, sq += double(v) * v;
  mean /= a.size();
  EXPECT_NEAR(mean, 0.0, 0.001);
  EXPECT_NEAR(std::sqrt(sq / a.size()), 0.02, 0.0005);
  std::vector<float> u = rt::initialValues({"uniform", 0.5}, 10000, 1, "u");
  EXPECT_LE(*std::max_element(u.begin(), u.end()), 0.5f);
  EXPECT_GE(*std::min_element(u.begin(), u.end()), -0.5f);
  std::vector<float> o = rt::initialValues({"ones", 0}, 3, 1, "o");
  EXPECT_EQ(o, std::vector<float>({1, 1, 1}));
}

/// The initial values as one sequential splitmix64 stream makes them (what
/// every bundle written with weights holds), against the runtime's values,
/// computed in parallel chunks for large parameters: equal bit for bit, odd
/// counts and chunk edges included.
TEST(Init, ParallelChunksAreTheSequentialStream) {
  auto sequential = [](const rt::ParamInit &init, int64_t count, uint64_t seed, const std::string &name) {
    uint64_t h = 1469598103934665603ull ^ seed;
    for (char c : name)
      h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    auto uniform = [&h] {
      uint64_t z = (h += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      return ((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
    };
    std::vector<float> out(static_cast<size_t>(count));
    for (size_t i = 0; i < out.size(); i += init.kind == "normal" ? 2 : 1) {
      if (init.kind == "uniform") {
        out[i] = float((2 * uniform() - 1) * init.scale);
        continue;
      }
      double u1 = 1.0 - uniform(), u2 = uniform();
      double r = std::sqrt(-2.0 * std::log(u1)) * init.scale;
      out[i] = float(r * std::cos(2 * M_PI * u2));
      if (i + 1 < out.size())
        out[i + 1] = float(r * std::sin(2 * M_PI * u2));
    }
    return out;
  };
  for (int64_t count : {int64_t(7), int64_t(3) << 20 | 1, int64_t(5) << 20}) {
    for (const rt::ParamInit &init : {rt::ParamInit{"normal", 0.02}, rt::ParamInit{"uniform", 0.1}}) {
      std::vector<float> want = sequential(init, count, 3, "h.0.w"), got = rt::initialValues(init, count, 3, "h.0.w");
      ASSERT_EQ(want.size(), got.size());
      EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
          << init.kind << ", " << count << " values";
    }
  }
}

} // namespace

//===- InstructionTableTest.cpp - One instruction set, read by everyone ---===//
//
// runtime/include/loom/instructions.def is the instruction set: the manifest
// reader and the compiler's loomrt.instr verifier check against it, and the
// CPU backend implements exactly it. These tests keep the table and the
// backend's builders from drifting apart, and show the reader's errors.
//
//===----------------------------------------------------------------------===//

#include "loom/instructions.h"
#include "loom/rt/Bundle.h"
#include "loom/rt/Error.h"
#include "runtime/src/cpu/CpuBackend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

using namespace loom;
using json = nlohmann::json;

TEST(InstructionTable, NamesExactlyTheCpuBackendsOps) {
  std::set<std::string> table, cpu;
  for (const InstructionInfo &info : kInstructions)
    EXPECT_TRUE(table.insert(std::string(info.name)).second) << "listed twice: " << info.name;
  for (const std::string &op : rt::cpuSupportedOps())
    cpu.insert(op);
  std::vector<std::string> onlyTable, onlyCpu;
  std::set_difference(table.begin(), table.end(), cpu.begin(), cpu.end(), std::back_inserter(onlyTable));
  std::set_difference(cpu.begin(), cpu.end(), table.begin(), table.end(), std::back_inserter(onlyCpu));
  EXPECT_TRUE(onlyTable.empty()) << "in instructions.def but without a CPU kernel: " << ::testing::PrintToString(onlyTable);
  EXPECT_TRUE(onlyCpu.empty()) << "CPU kernels missing from instructions.def: " << ::testing::PrintToString(onlyCpu);
}

TEST(InstructionTable, EntriesAreWellFormed) {
  for (const InstructionInfo &info : kInstructions) {
    EXPECT_LE(0, info.minInputs) << info.name;
    EXPECT_LE(info.minInputs, info.maxInputs) << info.name;
    EXPECT_LE(0, info.minOutputs) << info.name;
    EXPECT_LE(info.minOutputs, info.maxOutputs) << info.name;
    EXPECT_FALSE(info.summary.empty()) << info.name;
    EXPECT_EQ(info.attrs.find("  "), std::string_view::npos) << info.name;
    EXPECT_TRUE(info.attrs.empty() || (info.attrs.front() != ' ' && info.attrs.back() != ' ')) << info.name;
    EXPECT_EQ(findInstruction(info.name), &info);
  }
  EXPECT_EQ(findInstruction("frobnicate"), nullptr);
  const InstructionInfo *matmul = findInstruction("matmul");
  ASSERT_NE(matmul, nullptr);
  EXPECT_TRUE(matmul->acceptsAttr("transpose_b"));
  EXPECT_TRUE(matmul->acceptsAttr("epilogue"));
  EXPECT_FALSE(matmul->acceptsAttr("transpose"));
  EXPECT_FALSE(matmul->acceptsAttr(""));
}

TEST(InstructionTable, DescribesWhatDoesNotFit) {
  std::vector<std::string> none, attrs = {"transpose_a", "loom.layer"};
  const InstructionInfo &matmul = *findInstruction("matmul"), &add = *findInstruction("add");
  EXPECT_EQ(checkInstruction(matmul, 2, 1, none), "");
  EXPECT_EQ(checkInstruction(matmul, 5, 1, none), "'matmul' takes 2 to 4 inputs, got 5");
  EXPECT_EQ(checkInstruction(add, 1, 1, none), "'add' takes 2 inputs, got 1");
  EXPECT_EQ(checkInstruction(*findInstruction("rmsnorm_grad"), 3, 1, none),
            "'rmsnorm_grad' writes 2 outputs, got 1");
  EXPECT_EQ(checkInstruction(*findInstruction("attention"), 3, 2, none), "'attention' writes 1 output, got 2");
  EXPECT_EQ(checkInstruction(*findInstruction("layernorm_grad"), 2, 3, none),
            "'layernorm_grad' takes 3 or 4 inputs, got 2");
  EXPECT_EQ(checkInstruction(*findInstruction("concat"), 0, 1, none), "'concat' takes at least 1 input, got 0");
  EXPECT_EQ(checkInstruction(*findInstruction("all_reduce"), 300, 300, none), "");
  // The compiler's notes are exempt only where the caller says so.
  EXPECT_EQ(checkInstruction(matmul, 2, 1, attrs, "loom."), "");
  EXPECT_EQ(checkInstruction(matmul, 2, 1, attrs),
            "'matmul' has no attribute 'loom.layer' (it takes transpose_a transpose_b epilogue)");
  EXPECT_EQ(checkInstruction(add, 2, 1, std::vector<std::string>{"axis"}),
            "'add' has no attribute 'axis' (it takes none)");
}

namespace {

/// A one-rank manifest of x[2] -> y[2] with one instruction (op, in, out, attrs).
json manifestWith(const json &instruction) {
  json buffer = {{"dtype", "f32"}, {"shape", {2}}, {"bytes", 8}, {"role", "activation"}};
  json x = buffer, y = buffer;
  x.update({{"id", 0}, {"name", "x"}, {"offset", 0}, {"role", "input"}});
  y.update({{"id", 1}, {"name", "y"}, {"offset", 8}, {"role", "output"}});
  json rank = {{"rank", 0},
               {"device", "cpu"},
               {"arena_bytes", 16},
               {"peak_activation_bytes", 0},
               {"buffers", {x, y}},
               {"inputs", {{{"name", "x"}, {"buffer", 0}}}},
               {"outputs", {{{"name", "y"}, {"buffer", 1}}}},
               {"parameters", json::array()},
               {"programs", {{"forward", {{{"op", "relu"}, {"in", {0}}, {"out", {1}}}, instruction}}}}};
  return {{"format", "loom-bundle"}, {"version", 1},  {"model", "t"},
          {"mode", "infer"},         {"batch", 1},    {"weights", ""},
          {"ranks", {rank}}};
}

/// The error parseManifest gives, or "" when it accepts the manifest.
std::string parseError(const json &instruction, loom_status_code_t *code = nullptr) {
  try {
    rt::parseManifest(manifestWith(instruction), "manifest.json");
  } catch (const rt::Error &e) {
    if (code)
      *code = e.code;
    return e.what();
  }
  return "";
}

} // namespace

TEST(InstructionTable, ManifestReaderChecksEveryInstruction) {
  EXPECT_EQ(parseError({{"op", "neg"}, {"in", {0}}, {"out", {1}}}), "");
  EXPECT_EQ(parseError({{"op", "scale"}, {"in", {0}}, {"out", {1}}, {"attrs", {{"factor", 2.0}}}}), "");
  loom_status_code_t code = LOOM_OK;
  EXPECT_EQ(parseError({{"op", "matmul"}, {"in", {0, 0, 0, 0, 0}}, {"out", {1}}}, &code),
            "manifest.json: ranks[0].programs.forward[1]: 'matmul' takes 2 to 4 inputs, got 5");
  EXPECT_EQ(code, LOOM_INVALID_BUNDLE);
  EXPECT_EQ(parseError({{"op", "neg"}, {"in", {0}}, {"out", json::array()}}),
            "manifest.json: ranks[0].programs.forward[1]: 'neg' writes 1 output, got 0");
  EXPECT_EQ(parseError({{"op", "neg"}, {"in", {0}}, {"out", {1}}, {"attrs", {{"factor", 2.0}}}}),
            "manifest.json: ranks[0].programs.forward[1]: 'neg' has no attribute 'factor' (it takes none)");
  // Compiler notes never reach a bundle: the reader refuses them like any other.
  EXPECT_NE(parseError({{"op", "neg"}, {"in", {0}}, {"out", {1}}, {"attrs", {{"loom.layer", "layer.0."}}}}), "");
  std::string unknown = parseError({{"op", "frobnicate"}, {"in", {0}}, {"out", {1}}}, &code);
  EXPECT_EQ(code, LOOM_UNSUPPORTED);
  EXPECT_EQ(unknown.rfind("manifest.json: ranks[0].programs.forward[1]: 'frobnicate' is not an instruction", 0), 0u)
      << unknown;
}

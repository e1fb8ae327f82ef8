//===- instructions.h - The runtime's instruction set, as data --*- C++ -*-===//
//
// The table of instructions.def as a sorted array of InstructionInfo, with
// the checks both sides share: the runtime's manifest reader
// (runtime/src/Bundle.cpp) and the compiler's `loomrt.instr` verifier
// (dialects/loomrt/IR/LoomRtDialect.cpp). Header-only, standard C++17, so the
// compiler includes it without linking the runtime and the runtime stays free
// of MLIR and LLVM.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_INSTRUCTIONS_H
#define LOOM_INSTRUCTIONS_H

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>

namespace loom {

struct InstructionInfo {
  std::string_view name;
  int minInputs, maxInputs;   // maxInputs == kManyOperands: any number
  int minOutputs, maxOutputs;
  std::string_view attrs;     // accepted attribute names, separated by spaces
  std::string_view summary;

  static constexpr int kManyOperands = 1000000;

  bool acceptsInputs(size_t n) const { return n >= size_t(minInputs) && n <= size_t(maxInputs); }
  bool acceptsOutputs(size_t n) const { return n >= size_t(minOutputs) && n <= size_t(maxOutputs); }
  bool acceptsAttr(std::string_view attr) const {
    for (size_t pos = 0; pos < attrs.size();) {
      size_t end = attrs.find(' ', pos);
      if (end == std::string_view::npos)
        end = attrs.size();
      if (attrs.substr(pos, end - pos) == attr)
        return true;
      pos = end + 1;
    }
    return false;
  }
};

#define LOOM_INSTRUCTION_MANY ::loom::InstructionInfo::kManyOperands

/// Every instruction, in the order of instructions.def.
inline constexpr InstructionInfo kInstructions[] = {
#define LOOM_INSTRUCTION(name, minIn, maxIn, minOut, maxOut, attrs, summary)                      \
  {#name, minIn, maxIn, minOut, maxOut, attrs, summary},
#include "instructions.def" // found beside this header
};
inline constexpr size_t kNumInstructions = sizeof(kInstructions) / sizeof(kInstructions[0]);

/// The instruction named `name`, or null when the runtime has no such one.
inline const InstructionInfo *findInstruction(std::string_view name) {
  for (const InstructionInfo &info : kInstructions)
    if (info.name == name)
      return &info;
  return nullptr;
}

/// "2 inputs", "2 or 3 inputs", "2 to 4 inputs", "at least 1 input": how
/// many buffers an instruction takes, for error messages.
inline std::string describeOperandCount(int min, int max, const char *noun) {
  auto counted = [&](int n) { return std::to_string(n) + " " + noun + (n == 1 ? "" : "s"); };
  if (max >= InstructionInfo::kManyOperands)
    return "at least " + counted(min);
  if (min == max)
    return counted(min);
  return std::to_string(min) + (max == min + 1 ? " or " : " to ") + counted(max);
}

/// Why an instruction with these counts and attribute names does not fit the
/// table ("" when it does). Attribute names starting with `ignorePrefix` (the
/// compiler's "loom." notes) are not checked; `attrNames` is any range of
/// things convertible to std::string_view.
template <typename AttrNames>
std::string checkInstruction(const InstructionInfo &info, size_t inputs, size_t outputs,
                             const AttrNames &attrNames, std::string_view ignorePrefix = {}) {
  std::string quoted = "'" + std::string(info.name) + "'";
  if (!info.acceptsInputs(inputs))
    return quoted + " takes " + describeOperandCount(info.minInputs, info.maxInputs, "input") +
           ", got " + std::to_string(inputs);
  if (!info.acceptsOutputs(outputs))
    return quoted + " writes " + describeOperandCount(info.minOutputs, info.maxOutputs, "output") +
           ", got " + std::to_string(outputs);
  for (const auto &a : attrNames) {
    std::string_view attr(a);
    if (!ignorePrefix.empty() && attr.substr(0, ignorePrefix.size()) == ignorePrefix)
      continue;
    if (!info.acceptsAttr(attr))
      return quoted + " has no attribute '" + std::string(attr) + "' (it takes " +
             (info.attrs.empty() ? std::string("none") : std::string(info.attrs)) + ")";
  }
  return "";
}

} // namespace loom

#endif

//===- LoomcInspect.h - loomc inspect ---------------------------*- C++ -*-===//
#ifndef LOOM_COMPILER_TOOLS_LOOMCINSPECT_H
#define LOOM_COMPILER_TOOLS_LOOMCINSPECT_H

#include <string>

namespace loom::tools {
/// Prints a bundle directory's manifest; 1 with the error printed if unreadable.
int inspectBundle(const std::string &inspectInput);
/// Prints a plan file (loomc plan --json), simulating its pipeline, and
/// draws it to `inspectSvg` unless empty.
int inspectPlan(const std::string &inspectInput, const std::string &inspectSvg);
} // namespace loom::tools

#endif

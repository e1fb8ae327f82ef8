//===- NestingLimit.h - Refuse text nested too deep to parse ----*- C++ -*-===//
//
// MLIR's parser is recursive descent: every nested region, attribute array,
// type parameter list or parenthesis is a few stack frames, so 5,000 nested
// `module {` or 10,000 nested `[` end in SIGSEGV before any diagnostic. The
// tools scan the text first and refuse nesting past a fixed depth, which also
// bounds the verifier's and printer's recursion over the parsed IR.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_NESTINGLIMIT_H
#define LOOM_COMPILER_NESTINGLIMIT_H

#include "mlir/Support/LogicalResult.h"
#include "llvm/Support/SourceMgr.h"

namespace mlir::loom {

/// Levels of (), [], {} and <> together that a model file may nest. Models
/// nest about ten (module, function, loom.repeat, a tensor type in an
/// attribute); the parser overflows an 8 MiB stack after a few thousand.
constexpr int kMaxNesting = 256;

/// Fails, printing `FILE:LINE:COL: error: ...` to stderr, at the first bracket
/// that opens level kMaxNesting + 1 of `sourceMgr`'s buffer `bufferId`.
/// String literals and `//` comments are skipped; `->` closes nothing.
LogicalResult checkNesting(const llvm::SourceMgr &sourceMgr, unsigned bufferId);

} // namespace mlir::loom

#endif

//===- VerifyFuzzer.cpp - Fuzz loomc verify's parse path ------------------===//
//
// The bytes are a model file: parsed and verified as loomc verify does, with
// the dialects it loads, diagnostics swallowed. An invalid model is a
// diagnostic; a crash, an assertion or a sanitizer report is a finding.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/SourceMgr.h"

#include <cstdint>

/// LLVM's BumpPtrAllocator poisons a fresh slab and unpoisons what it hands
/// out, but only in code built with ASan: the dialect's inlined allocations
/// poison slabs that Debian's uninstrumented libMLIR then allocates from
/// without unpoisoning, a false use-after-poison. Ignore manual poisoning.
extern "C" const char *__asan_default_options() { return "allow_user_poisoning=0"; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  // A fresh context per input: types and attributes it uniques do not pile up.
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  context.loadDialect<mlir::loom::LoomDialect, mlir::func::FuncDialect>();
  mlir::ScopedDiagnosticHandler quiet(&context, [](mlir::Diagnostic &) { return mlir::success(); });
  // As loomc reads a file: a null-terminated copy (the lexer relies on it).
  llvm::SourceMgr sourceMgr;
  sourceMgr.AddNewSourceBuffer(
      llvm::MemoryBuffer::getMemBufferCopy(
          llvm::StringRef(reinterpret_cast<const char *>(data), size), "fuzz.mlir"),
      llvm::SMLoc());
  mlir::OwningOpRef<mlir::ModuleOp> module =
      mlir::parseSourceFile<mlir::ModuleOp>(sourceMgr, &context);
  return 0;
}

//===- LoomDialect.h - The loom dialect -------------------------*- C++ -*-===//
#ifndef LOOM_DIALECTS_LOOM_IR_LOOMDIALECT_H
#define LOOM_DIALECTS_LOOM_IR_LOOMDIALECT_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Dialect.h"

#include "dialects/loom/IR/LoomDialect.h.inc"

#endif

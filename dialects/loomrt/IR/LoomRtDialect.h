//===- LoomRtDialect.h - The lowered step -----------------------*- C++ -*-===//
#ifndef LOOM_DIALECTS_LOOMRT_IR_LOOMRTDIALECT_H
#define LOOM_DIALECTS_LOOMRT_IR_LOOMRTDIALECT_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "dialects/loomrt/IR/LoomRtDialect.h.inc"

#define GET_OP_CLASSES
#include "dialects/loomrt/IR/LoomRtOps.h.inc"

#endif

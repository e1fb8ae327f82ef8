//===- LoomOps.h - Operations of the loom dialect ---------------*- C++ -*-===//
#ifndef LOOM_DIALECTS_LOOM_IR_LOOMOPS_H
#define LOOM_DIALECTS_LOOM_IR_LOOMOPS_H

#include "dialects/loom/IR/LoomAttrs.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/CallInterfaces.h"
#include "mlir/Interfaces/ControlFlowInterfaces.h"
#include "mlir/Interfaces/FunctionInterfaces.h"
#include "mlir/Interfaces/InferTypeOpInterface.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "dialects/loom/IR/GradientBuilder.h"
#include "dialects/loom/IR/TensorParallel.h"
#include "dialects/loom/IR/LoomInterfaces.h.inc"

#define GET_OP_CLASSES
#include "dialects/loom/IR/LoomOps.h.inc"

#endif

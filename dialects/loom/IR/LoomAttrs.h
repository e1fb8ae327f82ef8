//===- LoomAttrs.h - Attributes of the loom dialect -------------*- C++ -*-===//
#ifndef LOOM_DIALECTS_LOOM_IR_LOOMATTRS_H
#define LOOM_DIALECTS_LOOM_IR_LOOMATTRS_H

#include "mlir/IR/Attributes.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/OpImplementation.h"

#include "dialects/loom/IR/LoomEnums.h.inc"

#define GET_ATTRDEF_CLASSES
#include "dialects/loom/IR/LoomAttrs.h.inc"

#endif

//===- LoomAttrs.td - Attributes of the loom dialect ------*- tablegen -*-===//
#ifndef LOOM_ATTRS_TD
#define LOOM_ATTRS_TD

include "dialects/loom/IR/LoomBase.td"
include "mlir/IR/EnumAttr.td"

def Loom_InitKind : I32EnumAttr<"InitKind", "parameter initializer", [
  I32EnumAttrCase<"Zeros", 0, "zeros">,
  I32EnumAttrCase<"Ones", 1, "ones">,
  I32EnumAttrCase<"Normal", 2, "normal">,
  I32EnumAttrCase<"Uniform", 3, "uniform">,
  I32EnumAttrCase<"Constant", 4, "constant">
]> {
  let cppNamespace = "::mlir::loom";
  let genSpecializedAttr = 0;
}

class Loom_Attr<string name, string attrMnemonic, list<Trait> traits = []>
    : AttrDef<Loom_Dialect, name, traits> {
  let mnemonic = attrMnemonic;
}

def Loom_InitAttr : Loom_Attr<"Init", "init"> {
  let summary = "How a parameter is initialised";
  let description = [{
    `#loom.init<zeros>`, `#loom.init<ones>`, `#loom.init<normal(0.02)>`
    (mean 0, the given standard deviation), `#loom.init<uniform(0.1)>`
    (uniform in [-a, a]) or `#loom.init<constant(0.5)>`.
  }];
  let parameters = (ins "InitKind":$kind, APFloatParameter<"">:$scale);
  let hasCustomAssemblyFormat = 1;
  let genVerifyDecl = 1;
}

def Loom_MeshAttr : Loom_Attr<"Mesh", "mesh"> {
  let summary = "A logical device mesh: named axes with sizes";
  let description = [{
    `#loom.mesh<["dp" = 2, "tp" = 4]>` is a 2x4 mesh of 8 devices whose
    axes are called `dp` and `tp`. A module names its mesh with the
    `loom.mesh` attribute; `#loom.sharding` attributes refer to its axes.
  }];
  let parameters = (ins ArrayRefParameter<"::mlir::StringAttr">:$axisNames,
                        ArrayRefParameter<"int64_t">:$axisSizes);
  let hasCustomAssemblyFormat = 1;
  let genVerifyDecl = 1;
  let extraClassDeclaration = [{
    /// Size of the named axis, or std::nullopt if the mesh has no such axis.
    std::optional<int64_t> getAxisSize(::llvm::StringRef name) const;
    int64_t getNumDevices() const;
  }];
}

def Loom_ShardingAttr : Loom_Attr<"Sharding", "sharding"> {
  let summary = "How a tensor is split over the mesh";
  let description = [{
    One list of mesh axes per tensor dimension:
    `#loom.sharding<[{"dp"}, {}, {"tp"} ]>` splits dimension 0 over `dp` and
    dimension 2 over `tp` and replicates the rest. `partial = {"tp"}` marks
    a value that still has to be summed over `tp`. An axis appears at most
    once. Attached to an op as the discardable attribute `loom.sharding`, it
    is checked against the module's `loom.mesh` and the op's result type.
  }];
  let parameters = (ins ArrayRefParameter<"::mlir::ArrayAttr">:$dims,
                        ArrayRefParameter<"::mlir::StringAttr">:$partialAxes);
  let hasCustomAssemblyFormat = 1;
  let genVerifyDecl = 1;
  let extraClassDeclaration = [{
    /// Checks the sharding against a mesh and a value's type.
    ::mlir::LogicalResult verifyFor(MeshAttr mesh, ::mlir::RankedTensorType type,
        ::llvm::function_ref<::mlir::InFlightDiagnostic()> emitError) const;
  }];
}

#endif // LOOM_ATTRS_TD

//===- LoomOps.td - Operations of the loom dialect --------*- tablegen -*-===//
#ifndef LOOM_OPS_TD
#define LOOM_OPS_TD

include "dialects/loom/IR/LoomBase.td"
include "dialects/loom/IR/LoomAttrs.td"
include "dialects/loom/IR/LoomInterfaces.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/IR/BuiltinAttributes.td"
include "mlir/Interfaces/InferTypeOpInterface.td"
include "mlir/Interfaces/SideEffectInterfaces.td"
include "mlir/Interfaces/FunctionInterfaces.td"
include "mlir/Interfaces/CallInterfaces.td"
include "mlir/Interfaces/ControlFlowInterfaces.td"

//===----------------------------------------------------------------------===//
// Structure: parameters, blocks, repetition
//===----------------------------------------------------------------------===//

def Loom_ParamOp : Loom_Op<"param", [Symbol, ParentOneOf<["::mlir::ModuleOp", "BlockOp"]>]> {
  let summary = "Declares a trainable parameter";
  let description = [{
    Declares a parameter of the given tensor type and its initializer:

    ```mlir
    loom.param @wte : tensor<50257x768xf32> init <normal(0.02)>
    ```

    At module level the parameter exists once. Inside a `loom.block` each
    application of the block (each layer of a `loom.repeat`) owns its own
    copy. Read it with `loom.get`.
  }];
  let arguments = (ins SymbolNameAttr:$sym_name,
                       TypeAttrOf<Loom_FloatTensor>:$type,
                       Loom_InitAttr:$init);
  let assemblyFormat = "$sym_name `:` $type `init` $init attr-dict";
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    ::mlir::RankedTensorType getTensorType() {
      return ::llvm::cast<::mlir::RankedTensorType>(getType());
    }
  }];
}

def Loom_GetOp : Loom_Op<"get", [Pure, DeclareOpInterfaceMethods<SymbolUserOpInterface>]> {
  let summary = "Reads a parameter";
  let description = [{
    `%w = loom.get @wte : tensor<50257x768xf32>` reads the parameter `@wte`,
    looked up first in the enclosing `loom.block`, then in the module.
  }];
  let arguments = (ins FlatSymbolRefAttr:$name);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$name attr-dict `:` type($result)";
  let extraClassDeclaration = [{
    /// The declaration this op reads, or null.
    ParamOp lookupParam();
  }];
}

def Loom_BlockOp : Loom_Op<"block", [
    Symbol, SymbolTable, IsolatedFromAbove, FunctionOpInterface,
    HasParent<"::mlir::ModuleOp">]> {
  let summary = "A repeated block (for example a transformer layer)";
  let description = [{
    A function-like block written once and applied per layer by
    `loom.repeat`. Parameters declared inside it with `loom.param` belong to
    each application separately.

    ```mlir
    loom.block @layer(%x: tensor<?x1024x768xf32>) -> tensor<?x1024x768xf32> {
      loom.param @ln1.g : tensor<768xf32> init <ones>
      ...
      loom.yield %y : tensor<?x1024x768xf32>
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name,
                       TypeAttrOf<FunctionType>:$function_type,
                       OptionalAttr<DictArrayAttr>:$arg_attrs,
                       OptionalAttr<DictArrayAttr>:$res_attrs);
  let regions = (region SizedRegion<1>:$body);
  let hasCustomAssemblyFormat = 1;
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    ::llvm::ArrayRef<::mlir::Type> getArgumentTypes() { return getFunctionType().getInputs(); }
    ::llvm::ArrayRef<::mlir::Type> getResultTypes() { return getFunctionType().getResults(); }
    ::mlir::Region *getCallableRegion() { return &getBody(); }
  }];
}

def Loom_YieldOp : Loom_Op<"yield", [Pure, Terminator, ReturnLike, HasParent<"BlockOp">]> {
  let summary = "Returns the outputs of a loom.block";
  let arguments = (ins Variadic<AnyRankedTensor>:$values);
  let assemblyFormat = "($values^ `:` type($values))? attr-dict";
  let hasVerifier = 1;
}

def Loom_RepeatOp : Loom_Op<"repeat", [DeclareOpInterfaceMethods<SymbolUserOpInterface>]> {
  let summary = "Applies a loom.block several times in sequence";
  let description = [{
    `%y = loom.repeat 12 @layer(%x) : (tensor<?x1024x768xf32>) -> tensor<?x1024x768xf32>`
    applies `@layer` 12 times, feeding each application's results to the
    next. Each application has its own parameters; the planner sees the
    count and splits the layers into pipeline stages. The count is between
    1 and 16384: each application is lowered and allocated separately.
  }];
  let arguments = (ins I64Attr:$count, FlatSymbolRefAttr:$block,
                       Variadic<AnyRankedTensor>:$inputs);
  let results = (outs Variadic<AnyRankedTensor>:$results);
  let assemblyFormat = [{
    $count $block `(` $inputs `)` attr-dict `:` functional-type($inputs, $results)
  }];
  let extraClassDeclaration = [{
    static constexpr int64_t kMaxCount = 16384;
    BlockOp lookupBlock();
  }];
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Elementwise
//===----------------------------------------------------------------------===//

class Loom_BinaryOp<string mnemonic, string what>
    : Loom_Op<mnemonic, [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>, DeclareOpInterfaceMethods<LoomTensorParallelOpInterface>]> {
  let summary = "Elementwise " # what # " with broadcasting";
  let description = [{
    Operands broadcast as in NumPy: dimensions are aligned from the right and
    each pair must be equal or contain a 1. Element types must be equal;
    insert `loom.cast` to mix precisions.
  }];
  let arguments = (ins Loom_FloatTensor:$lhs, Loom_FloatTensor:$rhs);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$lhs `,` $rhs attr-dict `:` type($lhs) `,` type($rhs)";
}

def Loom_AddOp : Loom_BinaryOp<"add", "addition">;
def Loom_SubOp : Loom_BinaryOp<"sub", "subtraction">;
def Loom_MulOp : Loom_BinaryOp<"mul", "multiplication">;
def Loom_DivOp : Loom_BinaryOp<"div", "division">;

class Loom_UnaryOp<string mnemonic, string what, dag extraArgs = (ins)>
    : Loom_Op<mnemonic, [Pure, AllTypesMatch<["x", "result"]>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>, DeclareOpInterfaceMethods<LoomTensorParallelOpInterface>]> {
  let summary = "Elementwise " # what;
  let arguments = !con((ins Loom_FloatTensor:$x), extraArgs);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
}

def Loom_GeluOp : Loom_UnaryOp<"gelu", "GELU; `approximate` selects the tanh form",
                               (ins UnitAttr:$approximate)>;
def Loom_ReluOp : Loom_UnaryOp<"relu", "max(x, 0)">;
def Loom_SiluOp : Loom_UnaryOp<"silu", "x * sigmoid(x)">;
def Loom_ExpOp : Loom_UnaryOp<"exp", "e^x">;
def Loom_TanhOp : Loom_UnaryOp<"tanh", "hyperbolic tangent">;
def Loom_RsqrtOp : Loom_UnaryOp<"rsqrt", "1 / sqrt(x)">;
def Loom_NegOp : Loom_UnaryOp<"neg", "negation">;
def Loom_ScaleOp : Loom_UnaryOp<"scale", "multiplication by the constant `factor`",
                                (ins F64Attr:$factor)>;

//===----------------------------------------------------------------------===//
// Linear algebra and reductions
//===----------------------------------------------------------------------===//

def Loom_MatmulOp : Loom_Op<"matmul", [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>, DeclareOpInterfaceMethods<LoomTensorParallelOpInterface>]> {
  let summary = "(Batched) matrix product";
  let description = [{
    `lhs` is `[..., M, K]` (`[..., K, M]` with `transpose_a`) and `rhs` is
    `[..., K, N]` (`[..., N, K]` with `transpose_b`); leading batch
    dimensions broadcast, so a rank-2 weight multiplies every batch. The
    result is `[..., M, N]`.
  }];
  let arguments = (ins Loom_FloatTensor:$lhs, Loom_FloatTensor:$rhs,
                       UnitAttr:$transpose_a, UnitAttr:$transpose_b);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$lhs `,` $rhs attr-dict `:` type($lhs) `,` type($rhs)";
}

class Loom_ReduceOp<string mnemonic, string what>
    : Loom_Op<mnemonic, [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Reduces `axes` by " # what;
  let description = [{
    Reduces the listed axes (negative values count from the end). With
    `keepdim` the reduced axes stay as size 1.
  }];
  let arguments = (ins Loom_FloatTensor:$x, DenseI64ArrayAttr:$axes, UnitAttr:$keepdim);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
}

def Loom_ReduceSumOp : Loom_ReduceOp<"reduce_sum", "summing">;
def Loom_ReduceMaxOp : Loom_ReduceOp<"reduce_max", "taking the maximum">;
def Loom_ReduceMeanOp : Loom_ReduceOp<"reduce_mean", "averaging">;

def Loom_SoftmaxOp : Loom_Op<"softmax", [Pure, AllTypesMatch<["x", "result"]>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Softmax along one axis";
  let arguments = (ins Loom_FloatTensor:$x, DefaultValuedAttr<I64Attr, "-1">:$axis);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
  let hasVerifier = 1;
}

// The layout of an image tensor: absent or "nchw" (channels first), or
// "nhwc" (channels last, what tensor cores read best).
def Loom_LayoutAttr : StringBasedAttr<
    CPred<"::llvm::isa<::mlir::StringAttr>($_self) && "
          "(::llvm::cast<::mlir::StringAttr>($_self).getValue() == \"nchw\" || "
          "::llvm::cast<::mlir::StringAttr>($_self).getValue() == \"nhwc\")">,
    "image layout, \"nchw\" or \"nhwc\"">;

//===----------------------------------------------------------------------===//
// Normalisation
//===----------------------------------------------------------------------===//

def Loom_LayerNormOp : Loom_Op<"layernorm", [Pure, AllTypesMatch<["x", "result"]>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Layer normalisation over the last dimension";
  let description = [{
    `(x - mean) / sqrt(var + eps) * gamma + beta` over the last dimension;
    `gamma` and `beta` have the shape of that dimension.
  }];
  let arguments = (ins Loom_FloatTensor:$x, Loom_FloatTensor:$gamma, Loom_FloatTensor:$beta,
                       DefaultValuedAttr<F64Attr, "1e-5">:$eps);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x `,` $gamma `,` $beta attr-dict `:` type($x) `,` type($gamma) `,` type($beta)";
  let hasVerifier = 1;
}

def Loom_RMSNormOp : Loom_Op<"rmsnorm", [Pure, AllTypesMatch<["x", "result"]>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "RMS normalisation over the last dimension";
  let description = [{ `x / sqrt(mean(x^2) + eps) * gamma` over the last dimension. }];
  let arguments = (ins Loom_FloatTensor:$x, Loom_FloatTensor:$gamma,
                       DefaultValuedAttr<F64Attr, "1e-6">:$eps);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x `,` $gamma attr-dict `:` type($x) `,` type($gamma)";
  let hasVerifier = 1;
}

def Loom_BatchNormOp : Loom_Op<"batchnorm", [Pure, AllTypesMatch<["x", "result"]>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Batch normalisation over all dimensions but the channel (dim 1)";
  let description = [{
    Normalises `[N, C, ...]` with the statistics of the batch for each
    channel, then scales by `gamma[C]` and shifts by `beta[C]`. With
    `layout = "nhwc"` the channel is the last dimension (`[N, ..., C]`).
  }];
  let arguments = (ins Loom_FloatTensor:$x, Loom_FloatTensor:$gamma, Loom_FloatTensor:$beta,
                       DefaultValuedAttr<F64Attr, "1e-5">:$eps, OptionalAttr<Loom_LayoutAttr>:$layout);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x `,` $gamma `,` $beta attr-dict `:` type($x) `,` type($gamma) `,` type($beta)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Transformer building blocks
//===----------------------------------------------------------------------===//

def Loom_EmbeddingOp : Loom_Op<"embedding", [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>, DeclareOpInterfaceMethods<LoomTensorParallelOpInterface>]> {
  let summary = "Looks up rows of a table";
  let description = [{
    `table` is `[V, H]`, `ids` any shape `[...]`; the result is `[..., H]`.
    With `vocab_group`, the table is this rank's part of a vocabulary split
    in equal contiguous parts over that group (tensor parallelism): ids held
    by another rank give zero rows, and an all-reduce over the group sums
    the parts.
  }];
  let arguments = (ins Loom_FloatTensor:$table, Loom_IndexTensor:$ids,
                       OptionalAttr<StrAttr>:$vocab_group);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$table `,` $ids attr-dict `:` type($table) `,` type($ids)";
}

def Loom_RotaryOp : Loom_Op<"rotary", [Pure, AllTypesMatch<["x", "result"]>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>, DeclareOpInterfaceMethods<LoomTensorParallelOpInterface>]> {
  let summary = "Rotary position embedding (RoPE) applied per head";
  let description = [{
    `x` is `[B, S, heads * head_dim]`. Each head's pairs `(x[2i], x[2i+1])`
    are rotated by `pos * theta^(-2i/head_dim)` where `pos` is the index in S.
  }];
  let arguments = (ins Loom_FloatTensor:$x, I64Attr:$num_heads,
                       DefaultValuedAttr<F64Attr, "10000.0">:$theta);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
  let hasVerifier = 1;
}

def Loom_AttentionOp : Loom_Op<"attention", [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>, DeclareOpInterfaceMethods<LoomTensorParallelOpInterface>]> {
  let summary = "Multi-head scaled dot-product attention";
  let description = [{
    `q` is `[B, S, heads * D]`; `k` and `v` are `[B, Skv, kv_heads * D]`.
    Each group of `heads / kv_heads` query heads shares one key/value head
    (grouped-query attention; `num_kv_heads` defaults to `num_heads`).
    Scores are scaled by `scale` (default `1/sqrt(D)`); `causal` masks
    positions after the query's. The result has `q`'s type.
  }];
  let arguments = (ins Loom_FloatTensor:$q, Loom_FloatTensor:$k, Loom_FloatTensor:$v,
                       I64Attr:$num_heads, OptionalAttr<I64Attr>:$num_kv_heads,
                       UnitAttr:$causal, OptionalAttr<F64Attr>:$scale);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$q `,` $k `,` $v attr-dict `:` type($q) `,` type($k) `,` type($v)";
  let extraClassDeclaration = [{
    int64_t getKvHeads() { return getNumKvHeads().value_or(getNumHeads()); }
  }];
}

def Loom_CrossEntropyOp : Loom_Op<"cross_entropy", [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>, DeclareOpInterfaceMethods<LoomTensorParallelOpInterface>]> {
  let summary = "Mean softmax cross-entropy over all positions";
  let description = [{
    `logits` is `[..., V]` and `targets` `[...]` holds class ids in `[0, V)`.
    The result is the mean loss as a scalar `tensor<f32>`, whatever the
    logits' precision: the reduction accumulates in f32. With `vocab_group`,
    `logits` hold this rank's part of a vocabulary split in equal contiguous
    parts over that group; the loss and its gradient all-reduce the row
    maxima, sums of exponentials and target logits (`3 x [...]` floats), never
    the logits themselves.
  }];
  let arguments = (ins Loom_FloatTensor:$logits, Loom_IndexTensor:$targets,
                       OptionalAttr<StrAttr>:$vocab_group);
  let results = (outs 0DTensorOf<[F32]>:$result);
  let assemblyFormat = "$logits `,` $targets attr-dict `:` type($logits) `,` type($targets)";
}

//===----------------------------------------------------------------------===//
// Communication (written by the partitioner)
//===----------------------------------------------------------------------===//

def Loom_AllReduceOp : Loom_Op<"all_reduce", [AllTypesMatch<["x", "result"]>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Sums (or averages, or takes the maximum of) a tensor over a group of ranks";
  let description = [{
    Every rank of `group` (a mesh axis such as `"tp"`) contributes its `x`
    and receives the reduction. After a row-parallel linear layer it turns
    the ranks' partial sums into the full result (Megatron's `g`); its
    gradient is the identity, because what follows it is replicated.
  }];
  let arguments = (ins Loom_FloatTensor:$x, StrAttr:$group,
                       DefaultValuedStrAttr<StrAttr, "sum">:$reduction);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
  let hasVerifier = 1;
}

def Loom_GradAllReduceOp : Loom_Op<"grad_all_reduce", [AllTypesMatch<["x", "result"]>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Identity forward; its gradient is summed over a group of ranks";
  let description = [{
    Marks where a replicated tensor enters a tensor-parallel region
    (Megatron's `f`): each rank uses it with its own part of the weights, so
    each computes only part of its gradient, and backward all-reduces the
    parts over `group`.
  }];
  let arguments = (ins Loom_FloatTensor:$x, StrAttr:$group);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
}

def Loom_AllGatherOp : Loom_Op<"all_gather", [DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Concatenates the parts of a tensor held by a group of ranks";
  let description = [{
    Every rank of `group` holds `parts` equal slices along `axis`; each
    receives all of them, in the group's order. The partitioner gathers a
    model's split outputs with it when compiling for inference (the
    vocabulary-parallel logits), and sequence parallelism gathers a
    token-split activation before a column-parallel layer with it; its
    gradient is `loom.reduce_scatter` of the result's gradient.
  }];
  let arguments = (ins Loom_FloatTensor:$x, StrAttr:$group, I64Attr:$axis, I64Attr:$parts);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
}

def Loom_ReduceScatterOp : Loom_Op<"reduce_scatter", [DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Sums a tensor over a group of ranks; each keeps its part along an axis";
  let description = [{
    Every rank of `group` contributes its whole `x`; rank `i` of the group
    receives part `i` of the sum, one of `parts` equal slices along `axis`.
    With sequence parallelism it replaces the all-reduce after a
    row-parallel layer (Megatron's `g`): the same bytes, and what follows
    (residual adds, norms) works on 1/`parts` of the tokens. Its gradient
    is `loom.all_gather` of the result's gradient.
  }];
  let arguments = (ins Loom_FloatTensor:$x, StrAttr:$group, I64Attr:$axis, I64Attr:$parts);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
}

//===----------------------------------------------------------------------===//
// Shape manipulation
//===----------------------------------------------------------------------===//

def Loom_ReshapeOp : Loom_Op<"reshape", [Pure, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Changes the shape, keeping the element order";
  let arguments = (ins AnyRankedTensor:$x);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x) `->` type($result)";
  let hasVerifier = 1;
}

def Loom_TransposeOp : Loom_Op<"transpose", [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Permutes dimensions: result dim i is input dim permutation[i]";
  let arguments = (ins AnyRankedTensor:$x, DenseI64ArrayAttr:$permutation);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
}

def Loom_SliceOp : Loom_Op<"slice", [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>, DeclareOpInterfaceMethods<LoomTensorParallelOpInterface>]> {
  let summary = "Takes `size` elements from `start` along `axis`";
  let arguments = (ins AnyRankedTensor:$x, I64Attr:$axis, I64Attr:$start, I64Attr:$size);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
}

def Loom_ConcatOp : Loom_Op<"concat", [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Joins tensors along `axis`";
  let arguments = (ins Variadic<AnyRankedTensor>:$inputs, I64Attr:$axis);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$inputs attr-dict `:` type($inputs)";
}

def Loom_BroadcastOp : Loom_Op<"broadcast", [Pure, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "Broadcasts to the result shape (NumPy rules)";
  let arguments = (ins AnyRankedTensor:$x);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x) `->` type($result)";
  let hasVerifier = 1;
}

def Loom_CastOp : Loom_Op<"cast", [Pure, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>, DeclareOpInterfaceMethods<LoomTensorParallelOpInterface>]> {
  let summary = "Converts the element type, keeping the shape";
  let arguments = (ins AnyRankedTensor:$x);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x) `->` type($result)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Convolutional networks
//===----------------------------------------------------------------------===//

def Loom_Conv2DOp : Loom_Op<"conv2d", [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = "2-D convolution, NCHW input and OIHW filter (or NHWC and OHWI)";
  let description = [{
    `x` is `[N, C, H, W]` and `filter` `[O, C / groups, KH, KW]`; the result
    is `[N, O, (H + 2*pad - KH) / stride + 1, (W + 2*pad - KW) / stride + 1]`.
    With `layout = "nhwc"` (channels last, chosen by loom-layout-nhwc) `x` is
    `[N, H, W, C]`, `filter` `[O, KH, KW, C / groups]` and the result
    `[N, Ho, Wo, O]`.
  }];
  let arguments = (ins Loom_FloatTensor:$x, Loom_FloatTensor:$filter,
                       DefaultValuedAttr<I64Attr, "1">:$stride,
                       DefaultValuedAttr<I64Attr, "0">:$padding,
                       DefaultValuedAttr<I64Attr, "1">:$groups,
                       OptionalAttr<Loom_LayoutAttr>:$layout);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x `,` $filter attr-dict `:` type($x) `,` type($filter)";
}

class Loom_Pool2DOp<string mnemonic, string what>
    : Loom_Op<mnemonic, [Pure, DeclareOpInterfaceMethods<InferTypeOpInterface>, DeclareOpInterfaceMethods<LoomDifferentiableOpInterface>]> {
  let summary = what # " pooling over windows of an NCHW tensor (NHWC with layout = \"nhwc\")";
  let arguments = (ins Loom_FloatTensor:$x, I64Attr:$kernel,
                       DefaultValuedAttr<I64Attr, "1">:$stride,
                       DefaultValuedAttr<I64Attr, "0">:$padding,
                       OptionalAttr<Loom_LayoutAttr>:$layout);
  let results = (outs Loom_FloatTensor:$result);
  let assemblyFormat = "$x attr-dict `:` type($x)";
}

def Loom_MaxPool2DOp : Loom_Pool2DOp<"max_pool2d", "Max">;
def Loom_AvgPool2DOp : Loom_Pool2DOp<"avg_pool2d", "Average">;

#endif // LOOM_OPS_TD

//===- LoomRtOps.td - The lowered training or inference step -*- tablegen -*-===//
//
// The `loomrt` dialect is the bundle before it is written: per rank, buffers
// in one arena, parameter and state bindings, and programs of runtime
// instructions over buffer ids. Every compile stage after lowering
// (autodiff, pipeline schedule, data parallelism, the optimizer update, the
// bf16 step rewrites, fusion, memory planning) is a pass from loomrt to
// loomrt; serialisation writes it out unchanged. Instruction names and
// attributes are the runtime's (docs/bundle-format.md).
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RT_OPS_TD
#define LOOM_RT_OPS_TD

include "mlir/IR/OpBase.td"
include "mlir/IR/BuiltinAttributes.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

def LoomRt_Dialect : Dialect {
  let name = "loomrt";
  let summary = "The lowered step: ranks, buffers and instruction programs";
  let description = [{
    What `loomc compile` writes into a bundle, as IR: a `loomrt.bundle`
    holds one `loomrt.rank` per device; a rank declares its buffers
    (`loomrt.buffer`: id, name, tensor type, role, arena offset, or a view of
    another buffer), binds parameters, inputs, outputs and optimizer state to
    them, and holds named programs (`forward`, `backward`, `step`, `update`)
    of `loomrt.instr` operations, each naming a runtime instruction with the
    ids of the buffers it reads and writes. An instruction's attributes are
    the op's discardable attributes; those prefixed `loom.` are notes between
    passes (a record's layer and pipeline chunk) that serialisation drops.
  }];
  let cppNamespace = "::mlir::loomrt";
}

class LoomRt_Op<string mnemonic, list<Trait> traits = []>
    : Op<LoomRt_Dialect, mnemonic, traits>;

def LoomRt_BundleOp : LoomRt_Op<"bundle", [NoTerminator, SingleBlock]> {
  let summary = "The bundle being compiled: its ranks and manifest fields";
  let arguments = (ins StrAttr:$model, StrAttr:$mode, I64Attr:$batch, I64Attr:$seed,
                       StrAttr:$weights, StrAttr:$kernels, DictionaryAttr:$plan);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$model $mode `batch` $batch `seed` $seed attr-dict-with-keyword $body";
}

def LoomRt_RankOp : LoomRt_Op<"rank", [NoTerminator, SingleBlock, HasParent<"BundleOp">]> {
  let summary = "One rank's buffers, bindings and programs";
  let arguments = (ins I64Attr:$rank, StrAttr:$device, I64Attr:$arena_bytes,
                       I64Attr:$peak_bytes, DictionaryAttr:$coords);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$rank $device attr-dict-with-keyword $body";
}

def LoomRt_BufferOp : LoomRt_Op<"buffer", [HasParent<"RankOp">]> {
  let summary = "A buffer of the rank's arena (or a view of another buffer)";
  let description = [{
    `bytes` is given only where it is not the type's size; `view_of` is -1
    for a buffer with its own storage. A view is a reshape of the buffer it
    views, or with `view_offset` (bytes) a slice of it: a contiguous part
    that many bytes in (a product split by rows, loom-overlap-tensor-gather).
  }];
  let arguments = (ins I64Attr:$id, StrAttr:$name, TypeAttr:$type, StrAttr:$role,
                       I64Attr:$offset, OptionalAttr<I64Attr>:$bytes,
                       DefaultValuedAttr<I64Attr, "-1">:$view_of,
                       DefaultValuedAttr<I64Attr, "0">:$view_offset);
  let assemblyFormat = "$id $name `:` $type $role `at` $offset attr-dict";
}

def LoomRt_ParamOp : LoomRt_Op<"param", [HasParent<"RankOp">]> {
  let summary = "A parameter: its buffer, initialiser, gradient and shard";
  let arguments = (ins StrAttr:$name, I64Attr:$buffer, StrAttr:$init, F64Attr:$scale,
                       DefaultValuedAttr<I64Attr, "-1">:$grad,
                       DefaultValuedAttr<I64Attr, "-1">:$shard_axis,
                       DefaultValuedAttr<I64Attr, "1">:$shard_parts,
                       DefaultValuedAttr<I64Attr, "0">:$shard_index,
                       DefaultValuedAttr<I64Attr, "1">:$shard_blocks,
                       DefaultValuedAttr<DenseI64ArrayAttr, "{}">:$full_shape,
                       DefaultValuedAttr<I64Attr, "1">:$zero_parts,
                       DefaultValuedAttr<I64Attr, "0">:$zero_index);
  let assemblyFormat = "$name `=` $buffer $init `(` $scale `)` attr-dict";
}

class LoomRt_BindingOp<string mnemonic, string what>
    : LoomRt_Op<mnemonic, [HasParent<"RankOp">]> {
  let summary = what;
  let arguments = (ins StrAttr:$name, I64Attr:$buffer,
                       DefaultValuedAttr<I64Attr, "0">:$limit);
  let assemblyFormat = "$name `=` $buffer attr-dict";
}
def LoomRt_InputOp : LoomRt_BindingOp<"input",
    "An input of the rank (limit: the exclusive bound of index values, 0 if none)">;
def LoomRt_OutputOp : LoomRt_BindingOp<"output", "An output of the rank">;
def LoomRt_StateOp : LoomRt_BindingOp<"state",
    "Optimizer state or the step counter, kept across steps and checkpointed">;

def LoomRt_GroupOp : LoomRt_Op<"group", [HasParent<"RankOp">]> {
  let summary = "A communication group: the global ranks collectives over it span";
  let arguments = (ins StrAttr:$name, DenseI64ArrayAttr:$members);
  let assemblyFormat = "$name `=` $members attr-dict";
}

def LoomRt_ParamGradOp : LoomRt_Op<"param_grad", [HasParent<"RankOp">]> {
  let summary = "Between passes: a parameter's gradient as one pipeline chunk computes it";
  let description = [{
    Written by `loom-autodiff` (a parameter used by several pipeline chunks,
    such as a tied embedding, has one gradient per chunk) and read by the
    pipeline and data-parallel passes; not part of the bundle.
  }];
  let arguments = (ins I64Attr:$param, I64Attr:$chunk, I64Attr:$grad);
  let assemblyFormat = "$param `chunk` $chunk `=` $grad attr-dict";
}

def LoomRt_ZeroShardOp : LoomRt_Op<"zero_shard", [HasParent<"RankOp">]> {
  let summary = "Between passes: the gradient slice ZeRO-1 gives this rank of a parameter";
  let arguments = (ins I64Attr:$param, I64Attr:$shard);
  let assemblyFormat = "$param `=` $shard attr-dict";
}

def LoomRt_PartialGradOp : LoomRt_Op<"partial_grad", [HasParent<"RankOp">]> {
  let summary = "Between passes: a parameter whose gradient each rank computes from its own tokens";
  let description = [{
    Written by `loom-lower-to-step` from a parameter's `loom.partial_grad`
    (sequence parallelism) and read by `loom-data-parallel`, which sums the
    gradient over `group`; not part of the bundle.
  }];
  let arguments = (ins I64Attr:$param, StrAttr:$group);
  let assemblyFormat = "$param `over` $group attr-dict";
}

def LoomRt_ProgramOp : LoomRt_Op<"program", [NoTerminator, SingleBlock, HasParent<"RankOp">]> {
  let summary = "A named instruction stream (forward, backward, step, update)";
  let arguments = (ins StrAttr:$name);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$name attr-dict-with-keyword $body";
}

def LoomRt_InstrOp : LoomRt_Op<"instr", [HasParent<"ProgramOp">]> {
  let summary = "One runtime instruction over buffer ids";
  let description = [{
    `op` names the runtime's instruction (`matmul`, `layernorm_grad`,
    `all_reduce`, `fused`, ...); its attributes are this op's discardable
    attributes. `loom.layer`, `loom.chunk` and `loom.view` are notes for
    autodiff and the pipeline split (a `loom.view` record is a reshape the
    forward pass made without an instruction).

    The verifier checks each instruction against the runtime's table
    (`runtime/include/loom/instructions.def`, which the runtime's manifest
    reader also reads): the op must be one the runtime knows, take a number
    of inputs and outputs in its range, and carry only attributes it lists.
    Attributes prefixed `loom.` are the compiler's notes and are not checked;
    a `loom.view` record is no instruction and is not checked at all.
  }];
  let arguments = (ins StrAttr:$op, DenseI64ArrayAttr:$ins, DenseI64ArrayAttr:$outs);
  let assemblyFormat = "$op $ins `->` $outs attr-dict";
  let hasVerifier = 1;
}

def LoomRt_FusedOp : LoomRt_Op<"fused", [HasParent<"ProgramOp">, SingleBlock,
                                         SingleBlockImplicitTerminator<"YieldOp">]> {
  let summary = "A chain of elementwise instructions run as one generated kernel";
  let description = [{
    What loom-fuse-elementwise makes of a chain: one kernel that reads the
    buffers `ins` and writes `outs`, element by element. The body says what
    it computes for one element: its block arguments are the elements of
    `ins` (of their buffers' element types), each `loomrt.step` applies one
    runtime elementwise instruction to earlier values (in f32, as the
    kernels compute), and `loomrt.yield` gives the values stored to `outs`
    (converted to their buffers' element types). The op's other attributes
    (`kernel`, `launch`) name the generated kernel and its launch shape.

    The bundle writes it as the runtime's `fused` instruction: the steps as
    a `steps` list (each its op, attributes and `args`, which index the
    inputs and then the earlier steps) and the yielded values as `results`.
  }];
  let arguments = (ins DenseI64ArrayAttr:$ins, DenseI64ArrayAttr:$outs);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$ins `->` $outs attr-dict-with-keyword $body";
  let hasVerifier = 1;
}

def LoomRt_StepOp : LoomRt_Op<"step", [HasParent<"FusedOp">, Pure]> {
  let summary = "One elementwise instruction inside a fused kernel";
  let description = [{
    `op` is a runtime instruction with one output (`add`, `gelu`,
    `unary_grad`, ...); its attributes are this op's discardable attributes.
  }];
  let arguments = (ins StrAttr:$op, Variadic<AnyType>:$args);
  let results = (outs F32:$result);
  let assemblyFormat = "$op `(` $args `)` attr-dict `:` type($args)";
  let hasVerifier = 1;
}

def LoomRt_YieldOp : LoomRt_Op<"yield", [HasParent<"FusedOp">, Terminator, Pure]> {
  let summary = "The values a fused kernel stores to its outputs, in order";
  let arguments = (ins Variadic<AnyType>:$values);
  let assemblyFormat = "attr-dict ($values^ `:` type($values))?";
  let builders = [OpBuilder<(ins), [{ build($_builder, $_state, ValueRange()); }]>];
}

#endif // LOOM_RT_OPS_TD

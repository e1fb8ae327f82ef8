//===- Passes.td - Loom passes ----------------------------*- tablegen -*-===//
#ifndef LOOM_PASSES_TD
#define LOOM_PASSES_TD

include "mlir/Pass/PassBase.td"

def SpecializeBatch : Pass<"loom-specialize-batch", "::mlir::ModuleOp"> {
  let summary = "Gives the dynamic batch dimension a concrete size";
  let description = [{
    Models leave the batch dimension dynamic (`tensor<?x1024xi32>`). This
    pass replaces every dynamic dimension in the signatures of `func.func`
    and `loom.block` operations with `batch`, then re-infers the type of
    every value so the whole module has static shapes.
  }];
  let options = [
    Option<"batch", "batch", "int64_t", /*default=*/"1", "Batch size (>= 1)">
  ];
}

def MixedPrecision : Pass<"loom-mixed-precision", "::mlir::ModuleOp"> {
  let summary = "Computes in bf16 while parameters stay f32 masters";
  let description = [{
    Every read of an f32 parameter (and every f32 entry argument) is cast to
    bf16 where it is read; activations, their gradients and block signatures
    become bf16. Parameters, their gradients and optimizer state stay f32
    (the casts' gradients convert back), and the loss stays f32 because
    loom.cross_entropy accumulates and returns f32.
  }];
}

def PartitionTensorParallel : Pass<"loom-partition-tp", "::mlir::ModuleOp"> {
  let summary = "Rewrites a model into one tensor-parallel rank's program (Megatron rules)";
  let description = [{
    Splits linear layers column- then row-parallel, attention by heads and
    the embedding, output projection and loss by vocabulary, over `tp`
    ranks. Parameters take the shape of one rank's part and record the
    split in `loom.shard`; `loom.grad_all_reduce` marks where replicated
    activations enter a parallel region (its gradient is summed over the
    ranks) and `loom.all_reduce` sums the partial results of row-parallel
    layers and of the vocabulary-parallel embedding. A transformer layer
    gets two all-reduces forward and two backward. Run after
    loom-specialize-batch: partitioning needs static shapes.
  }];
  let options = [
    Option<"tp", "tp", "int64_t", /*default=*/"2", "Tensor-parallel degree (>= 1)">,
    Option<"gatherOutputs", "gather-outputs", "bool", /*default=*/"false",
           "All-gather what @forward returns split (inference bundles)">
  ];
}

def SequenceParallel : Pass<"loom-sequence-parallel", "::mlir::ModuleOp"> {
  let summary = "Splits the tokens between tensor-parallel regions (Megatron's sequence parallelism)";
  let description = [{
    Runs on loom-partition-tp's output (a training step). Each
    `loom.all_reduce` after a row-parallel layer (or the vocabulary-parallel
    embedding) becomes a `loom.reduce_scatter` along axis 0 and each
    `loom.grad_all_reduce` entering a column-parallel layer a
    `loom.all_gather`, so that the residual adds, biases and norms between
    them hold 1/tp of the tokens: the same bytes on the wire as the
    all-reduces, 1/tp of the work and of the memory between them. The
    parameters those ops read are marked `loom.partial_grad = "tp"`: each
    rank computes their gradient from its own tokens and loom-data-parallel
    sums it over the group. Anything else that reads split tokens is an
    error naming the op; so is a leading dimension tp does not divide.
  }];
}

def NhwcLayout : Pass<"loom-nhwc-layout", "::mlir::ModuleOp"> {
  let summary = "Runs a convolution network's convolutions, batch norms and pooling in NHWC";
  let description = [{
    Channels last is the layout tensor cores read best. In a module with
    `loom.conv2d`, every convolution, batch norm of an image and pooling
    takes `layout = "nhwc"` with NHWC tensor types (filters OHWI), between
    `loom.transpose` conversions; then elementwise ops take the layout of
    their operands, the blocks that convolve pass their images in NHWC
    (their `loom.repeat`s convert around them), reductions over the spatial
    axes read NHWC, and a conversion followed by its inverse cancels. What
    is left converts the input image once and each filter where it is
    read. `loomc compile --layout nchw` leaves it out of the pipeline.
  }];
}

//===----------------------------------------------------------------------===//
// The compile pipeline (loom-compile): configuration, then the lowered step
//===----------------------------------------------------------------------===//

def Configure : Pass<"loom-configure", "::mlir::ModuleOp"> {
  let summary = "Puts the compile options and the parallel plan on the module";
  let description = [{
    Writes `loom.options` (batch, seed, precision, fusion, the optimizer's
    hyper-parameters) and `loom.plan` (dp, tp, pp, vpp, microbatches,
    schedule, ZeRO stage, stages, gradient bucket size, recomputation, and
    the plan recorded in the manifest) on the module, after checking that
    the plan fits the batch and the schedule. Every later stage reads them
    from there. `loomc compile` and the `loom-compile` pipeline create it
    with their options; run alone it records the defaults.
  }];
  let constructor = "::mlir::loom::createConfigurePass()";
}

def LowerToStep : Pass<"loom-lower-to-step", "::mlir::ModuleOp"> {
  let summary = "Lowers @forward (or @loss for training) to the runtime's instructions";
  let description = [{
    One instruction per loom op over buffers (a reshape becomes a view),
    every `loom.repeat` unrolled with per-layer parameter names
    (`layer.3.ln1.g`), inputs and outputs named as the model's source names
    them, into a `loomrt.bundle` with one rank. For training, each forward
    entry notes its layer (`loom.layer`) and the loom op it came from
    (`loom.source`), and reshapes stay as `loom.view` records, for
    autodiff; the model stays beside the step until autodiff has used its
    gradient rules. Inference drops the model.
  }];
  let dependentDialects = ["::mlir::loomrt::LoomRtDialect"];
}

def PipelineSplit : Pass<"loom-pipeline-split", "::mlir::ModuleOp"> {
  let summary = "Assigns the forward pass's units to pipeline chunks";
  let description = [{
    Units are what precedes the first layer, each layer, and what follows
    the last. They are split over pp x vpp chunks as the plan's `stages`
    say (evenly when it gives none); each forward entry is noted with its
    chunk (`loom.chunk`), which autodiff carries to the gradients and the
    schedule turns into stages. Nothing to do without pipelining.
  }];
}

def Autodiff : Pass<"loom-autodiff", "::mlir::ModuleOp"> {
  let summary = "Reverse mode: the backward program from each op's gradient rule";
  let description = [{
    Walks the forward records in reverse and asks each op's
    DifferentiableOpInterface to build its operands' gradients as backward
    instructions; gradients of values used more than once are summed, and
    of broadcast operands reduced to their shape. Each instruction notes
    its layer (`loom.layer`) for loom-recompute. A parameter used
    by several pipeline chunks gets one gradient per chunk
    (`loomrt.param_grad`). The loss gradient's seed is 1 / microbatches.
    Drops the model afterwards.
  }];
}

def Recompute : Pass<"loom-recompute", "::mlir::ModuleOp"> {
  let summary = "Recomputes the plan's layers in backward instead of keeping their activations";
  let description = [{
    For each layer the plan recomputes (`--recompute all`, a block such as
    `layer` for every application of @layer, or one application such as
    `layer.3`), copies its forward instructions, into new buffers, right
    before its first gradient instruction, and makes backward read the
    copies (and views of them) from there on, so the forward pass's
    activations of that layer need not live through backward. A name that
    is no layer of the model is an error. Drops the `loom.layer` notes.
  }];
}

def ServePrograms : Pass<"loom-serve-programs", "::mlir::ModuleOp"> {
  let summary = "Prefill and decode step programs over a paged key/value cache (serving)";
  let description = [{
    For a serving bundle (`loomc compile --serve`), replaces the forward
    pass of a decoder with step programs `serve.N` over N token slots, any
    mix of prompt chunks and decoding sequences: each token carries its
    position, its cache row (`slots`) and its sequence's block table.
    Every causal attention becomes a `kv_write` of the step's keys and
    values into that layer's paged cache and a `paged_attention` of each
    token over its sequence's cached keys; a learned position table is
    read at the tokens' positions; rotary embeddings rotate by them. The
    final norm and output head run only on the rows whose logits are
    sampled (`rows`). Casts of parameters move to a `prepare` program that
    runs once, into persistent copies. Records the cache geometry and the
    programs in the bundle's `serve` attribute. A model that is not a
    causal decoder with batch 1 and one token input is an error.
  }];
}

def DistributeRanks : Pass<"loom-distribute-ranks", "::mlir::ModuleOp"> {
  let summary = "One rank per device of the dp x tp x pp grid";
  let description = [{
    Copies the lowered rank to every rank of the plan's grid (tp fastest,
    then dp, then pp, as Megatron-LM numbers them), with its coordinates,
    communication groups (dp, tp, pp, mp, all) and the index of its
    tensor-parallel shard of each split parameter.
  }];
}

def PipelineSchedule : Pass<"loom-pipeline-schedule", "::mlir::ModuleOp"> {
  let summary = "Each rank's step program: its chunks' microbatch tasks in schedule order";
  let description = [{
    With pipeline stages or several microbatches, forward and backward
    become one `step` program per rank running the schedule's order (GPipe,
    1F1B or interleaved 1F1B) of the tasks of the chunks it holds, on
    per-microbatch copies of activations, with recv before a task of what
    other stages produced and send after it of what they need; parameter
    gradients are summed over microbatches and the loss averaged.
  }];
}

def DataParallel : Pass<"loom-data-parallel", "::mlir::ModuleOp"> {
  let summary = "Gradient reductions: tied parameters over stages, buckets over replicas, ZeRO-1";
  let description = [{
    A parameter held by several stages sums its gradient over them; every
    other gradient is averaged over the data-parallel replicas in buckets
    of about `bucket_bytes`, each issued on the communication stream right
    after backward finishes its last gradient (reduce-scatter into this
    rank's slice with ZeRO-1); the loss is averaged over replicas and
    broadcast over stages. The reductions that wait for backward open the
    `update` program.
  }];
}

def OptimizerUpdate : Pass<"loom-optimizer-update", "::mlir::ModuleOp"> {
  let summary = "The update program: step counter, clipping norm and AdamW or SGD";
  let description = [{
    Appends to `update` the step counter, the global gradient norm (each
    element of a split or replicated model counted once, summed over the
    model-parallel ranks, or over all ranks with ZeRO-1) and one in-place
    optimizer instruction per parameter with its state; with ZeRO-1 each
    rank updates its slice of every parameter and all-gathers the slices.
  }];
}

def JoinSliceGradients : Pass<"loom-join-slice-gradients", "::mlir::ModuleOp"> {
  let summary = "Gradients of an operand sliced into parts that tile it become one concat";
  let description = [{
    The gradient of an operand sliced along one axis (q|k|v) arrives as one
    slice_grad per part and adds summing them; where the parts tile the
    axis, a concat of the parts' gradients computes the same sum.
  }];
}

def PackedQkvAttention : Pass<"loom-packed-qkv-attention", "::mlir::ModuleOp"> {
  let summary = "bf16 attention reads q, k, v in place from the fused projection";
  let description = [{
    Where attention's q, k and v are slices of one q|k|v projection read by
    nothing else, attention reads the projection's columns in place
    (attribute `packed`) and its gradient writes the concat's result: no
    copies of q, k, v or of their gradients. bf16 training bundles only.
  }];
}

def Bf16StepCasts : Pass<"loom-bf16-step-casts", "::mlir::ModuleOp"> {
  let summary = "Fewer and earlier bf16 casts in the training step";
  let description = [{
    Rewrites of training steps: a pipelined step casts each weight once
    for every microbatch; the optimizer and the clipping norm read bf16
    gradients directly where nothing else reads their f32 copies; adds into
    f32 gradient sums read the bf16 values; a data-parallel bucket's
    all-reduce reads the bf16 gradients and writes their f32 means, without
    a cast of each, and ZeRO-1's reduce-scatter reads them too (writing f32
    slices); with --grad-reduce bf16 the buckets average bf16 in place; a
    sum's first add becomes a cast
    of that gradient into it, without the fill of zeros before it; the
    weights' casts move to the start of the forward, where the runtime
    converts them in one launch.
  }];
}

def ZeroGatherCopies : Pass<"loom-zero-gather-copies", "::mlir::ModuleOp"> {
  let summary = "ZeRO keeps master slices and all-gathers the weights where they are read";
  let description = [{
    Mixed-precision ZeRO-1 steps: each rank keeps its slice of every f32
    master weight (role cache) and updates it in place; the forward starts
    by all-gathering the slices into the bf16 copies in buckets on the
    communication stream, each waited for before the first read of one of
    its weights, instead of the update gathering f32 masters and the
    forward casting them. A `prepare` program takes the slices from the
    masters after weights are written, and `gather_parameters` puts whole
    masters back before they are read (checkpoints).

    ZeRO-3 (`zero=3`, f32 or bf16): the slice is the parameter (its shard's
    `zero_parts`), and the forward and the backward each all-gather the
    weights (bf16 copies, or f32 buffers read instead of the parameter) a
    bucket at a time, each bucket issued where the one before it is waited
    for; the backward gathers into copies of its own. No `prepare` or
    `gather_parameters` program; a weight it cannot shard is an error.
  }];
}

def UpdateCopies : Pass<"loom-update-copies", "::mlir::ModuleOp"> {
  let summary = "The optimizer writes the bf16 weight copies the forward cast";
  let description = [{
    Mixed-precision training: where the update's `adamw` or `sgd` is the
    only writer of an f32 master and every other reader casts it to bf16,
    the update writes the bf16 copy as its last output (the cast's
    rounding), the copy is kept across steps (role cache, one buffer for a
    tied weight's readers), and the casts move to a `prepare` program that
    the runtime runs whenever weights are written. Saves the step's pass
    over the masters (GPT-2 350M: 1.4 GB read, 0.7 GB written).
  }];
}

def FuseLossGradient : Pass<"loom-fuse-loss-gradient", "::mlir::ModuleOp"> {
  let summary = "The cross-entropy loss writes its gradient over the logits";
  let description = [{
    Where a training step's cross_entropy and its cross_entropy_grad read
    the same logits and targets, nothing else reads the logits, and the
    gradient's seed is a fill of a constant, the loss gets a second output,
    the logits themselves, which it overwrites with their gradient (scaled
    by the constant, attribute `grad_scale`); the gradient and the fill go,
    and the gradient's readers read the logits' buffer. One read of the
    logits instead of three, and no memory of the gradient's own.
  }];
}

def FuseElementwise : Pass<"loom-fuse-elementwise", "::mlir::ModuleOp"> {
  let summary = "Elementwise chains into generated kernels, GEMM epilogues, named row kernels";
  let description = [{
    Fuses chains of elementwise instructions into `fused` instructions that
    describe the chain (the CPU evaluates it; the bundle writer generates
    its PTX), folds bias, GELU, residual and bias-gradient epilogues into
    matrix products, and names generated kernels for norms, softmax, the
    cross-entropy loss and runs of AdamW updates. Kernels are numbered
    across ranks in rank order.
  }];
}

def AccumulateInProducts : Pass<"loom-accumulate-in-products", "::mlir::ModuleOp"> {
  let summary = "A microbatch's weight gradient added into its sum by its own product";
  let description = [{
    Where a microbatched step adds a product's result into an f32 gradient
    sum (`add(acc, g) -> acc`) and nothing else reads it, the product takes
    the sum as its C input with beta = 1 and writes it in place: epilogue
    "residual", or "bgrad_residual" for a product that also writes its bias
    gradient (widened to f32 when only its own sum's add reads it). The add
    and the product's separate result go.
  }];
}

def ReduceFromProducts : Pass<"loom-reduce-from-products", "::mlir::ModuleOp"> {
  let summary = "A data-parallel bucket's f32 weight gradients written by their products";
  let description = [{
    Where a data-parallel bucket's all-reduce (f32 on the wire) widens a
    bf16 weight gradient into its f32 result and nothing else reads the
    gradient, the product writes the f32 result itself (bf16 operands, f32
    output) and the bucket reduces it in place: no widening pass over the
    bucket before NCCL, and the gradient keeps the product's bits beyond
    bf16's. A bias gradient from the same call is widened to f32 with it
    where the bucket is all that reads it.
  }];
}

def GatherEmbeddingRows : Pass<"loom-gather-embedding-rows", "::mlir::ModuleOp"> {
  let summary = "Embedding gradients over data parallelism as gathered rows, not reduced tables";
  let description = [{
    Where a data-parallel bucket averages an embedding table's gradient
    whose lookup part the backward makes last (a [vocab, hidden] sum with
    rows only for the replica's tokens), the table's other part (a tied
    head's product, made at the backward's start) is reduced in a bucket
    of its own right after its product, and the update adds the lookup's
    rows of every replica, from their token ids and output gradients
    gathered over dp (embedding_grad with accumulate and scale 1 / dp). An
    untied table's gradient leaves its bucket the same way. Under ZeRO-1 the
    head's gradient is reduce-scattered into the rank's slice, and the rows
    of the rank's part of the vocabulary go into a view of the slice
    (vocab_group = "dp"). Only where the gathered rows are fewer bytes than
    the table's gradient, without ZeRO-2/3, pipelines or microbatches.
  }];
}

def OverlapTensorReduce : Pass<"loom-overlap-tensor-reduce", "::mlir::ModuleOp"> {
  let summary = "Tensor-parallel all-reduces go out beside the compute that does not need them";
  let description = [{
    Moves each synchronous all-reduce over the "tp" group up to right after
    the instruction that writes its input, marks it async (the
    communication stream) with a new event, and has the first instruction
    that reads its result wait for that event: a layer's backward
    all-reduces its input gradient while its weight gradient's product
    runs. Left alone where nothing would run beside it, and on ranks whose
    programs already have async collectives (data-parallel buckets).
  }];
}

def OverlapTensorGather : Pass<"loom-overlap-tensor-gather", "::mlir::ModuleOp"> {
  let summary = "A product's own rows run beside the tensor-parallel all-gather of the others";
  let description = [{
    Under sequence parallelism a layer all-gathers the tokens the ranks
    hold before its product. Where the product is the gather's first
    reader (its left operand, not transposed), the gather goes out on the
    communication stream (async, a new event), the product of the rank's
    own rows runs beside it from the rank's own part, and the product of
    the other ranks' rows waits for it. Operands with a row per token are
    cut with slice views (`view_offset`). Left alone on ranks whose
    programs already have async collectives of other groups. The compile
    pipeline runs it with `loomc compile --tp-overlap`.
  }];
}

def SplitTensorReduce : Pass<"loom-split-tensor-reduce", "::mlir::ModuleOp"> {
  let summary = "A row-parallel product and its tensor-parallel all-reduce in two halves of its rows";
  let description = [{
    Where a synchronous all-reduce over the "tp" group sums what the product
    right before it wrote (a Megatron-style layer's forward), the product is
    cut into two halves of its rows (slice views), each half's all-reduce
    goes out on the communication stream after it (async, new events), and
    the next instruction waits for both: the first half's sum runs beside
    the second half's product. Left alone on ranks whose programs already
    have async collectives of other groups. The compile pipeline runs it
    with `loomc compile --tp-overlap`.
  }];
}

def CompactRanks : Pass<"loom-compact-ranks", "::mlir::ModuleOp"> {
  let summary = "Drops the buffers and parameters a rank never touches; renumbers the rest";
}

def PlanMemory : Pass<"loom-plan-memory", "::mlir::ModuleOp"> {
  let summary = "Packs each rank's buffers into one arena by lifetime";
  let description = [{
    Persistent buffers (parameters, inputs, outputs, state) first in id
    order; then activations, largest first, each at the lowest offset that
    overlaps no placed activation whose lifetime (over the programs in
    execution order: forward, step, backward, update) intersects its own.
    Parameter gradients live to the end of the step.
  }];
}

#endif // LOOM_PASSES_TD

// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 pp=2 mb=2 precision=bf16 fuse=true" --mlir-print-ir-after-all -o /dev/null 2>&1 | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="batch=2" --mlir-print-ir-after-all -o /dev/null 2>&1 | FileCheck %s --check-prefix=INFER

// loom-compile runs every stage, in order, each printing its IR: the model
// passes, then the loomrt stages from lowering to memory planning.

// CHECK: // -----// IR Dump After Configure (loom-configure) //----- //
// CHECK-NEXT: module attributes {{{.*}}loom.options = {batch = 2 : i64, {{.*}}bf16 = true, {{.*}}fuse = true
// CHECK: // -----// IR Dump After SpecializeBatch (loom-specialize-batch) //----- //
// CHECK: // -----// IR Dump After PartitionTensorParallel (loom-partition-tp) //----- //
// CHECK: // -----// IR Dump After MixedPrecision (loom-mixed-precision) //----- //
// CHECK-NOT: loomrt.bundle
// CHECK: // -----// IR Dump After LowerToStep (loom-lower-to-step) //----- //
// CHECK: loomrt.bundle "model" "train" batch 2
// CHECK: // -----// IR Dump After PipelineSplit (loom-pipeline-split) //----- //
// CHECK: loom.chunk = 1 : i64
// CHECK: // -----// IR Dump After Autodiff (loom-autodiff) //----- //
// CHECK: loomrt.program "backward"
// CHECK: // -----// IR Dump After Recompute (loom-recompute) //----- //
// CHECK: // -----// IR Dump After DistributeRanks (loom-distribute-ranks) //----- //
// CHECK: loomrt.rank 1 "cpu" attributes {{{.*}}coords = {dp = 0 : i64, pp = 1 : i64
// CHECK: // -----// IR Dump After PipelineSchedule (loom-pipeline-schedule) //----- //
// CHECK: loomrt.program "step"
// CHECK: // -----// IR Dump After DataParallel (loom-data-parallel) //----- //
// CHECK: "all_reduce" {{.*}}group = "stages.0.1", reduction = "sum"
// CHECK: // -----// IR Dump After OptimizerUpdate (loom-optimizer-update) //----- //
// CHECK: "adamw"
// CHECK: // -----// IR Dump After JoinSliceGradients (loom-join-slice-gradients) //----- //
// CHECK: // -----// IR Dump After PackedQkvAttention (loom-packed-qkv-attention) //----- //
// CHECK: packed = array<i64: 0, 64, 128>
// CHECK: // -----// IR Dump After Bf16StepCasts (loom-bf16-step-casts) //----- //
// CHECK: // -----// IR Dump After FuseElementwise (loom-fuse-elementwise) //----- //
// CHECK: kernel = "{{[a-z]+}}_0"
// CHECK: // -----// IR Dump After CompactRanks (loom-compact-ranks) //----- //
// CHECK: // -----// IR Dump After PlanMemory (loom-plan-memory) //----- //
// CHECK: loomrt.rank 0 "cpu" attributes {arena_bytes = {{[1-9][0-9]*}} : i64
// CHECK-NOT: IR Dump After

// Inference: no training stages, no compaction.
// INFER: IR Dump After Configure (loom-configure)
// INFER-NEXT: module
// INFER: IR Dump After SpecializeBatch (loom-specialize-batch)
// INFER: IR Dump After PartitionTensorParallel (loom-partition-tp)
// INFER: IR Dump After LowerToStep (loom-lower-to-step)
// INFER: IR Dump After DistributeRanks (loom-distribute-ranks)
// INFER: IR Dump After PlanMemory (loom-plan-memory)
// INFER-NOT: IR Dump After
// INFER-NOT: Autodiff

// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 fuse=true until=loom-bf16-step-casts" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 fuse=true until=loom-bf16-step-casts" | loom-opt --loom-fuse-elementwise | FileCheck %s

// loom-fuse-elementwise: chains of elementwise instructions become
// `loomrt.fused` region ops whose body computes one element (a
// `loomrt.step` per instruction, `loomrt.yield` of what is stored) with a
// generated kernel (fused_N); bias and bias-gradient epilogues fold into
// matrix products; the loss and AdamW get named kernels. Kernels are
// numbered in order.

// BEFORE-NOT: fused
// BEFORE-NOT: kernel =
// BEFORE: loomrt.instr "matmul" [16, 23] -> [27] {transpose_a = true}
// BEFORE: loomrt.instr "add" [4, 3] -> [5]
// BEFORE-NEXT: loomrt.instr "relu" [5] -> [6]
// BEFORE: loomrt.instr "matmul" [16, 17] -> [19]
// BEFORE-NEXT: loomrt.instr "add" [19, 18] -> [20]

// Backward: the bias gradient (reduce_sum) rides on the weight gradient's
// matmul as a second output.
// CHECK: loomrt.program "backward" {
// CHECK: loomrt.instr "cross_entropy_grad" [20, 1, 22] -> [23] {kernel = "ce_3", launch = {{{.*}}}}
// CHECK-NOT: "reduce_sum"
// CHECK: loomrt.instr "matmul" [16, 23] -> [27, 24] {epilogue = "bgrad", transpose_a = true}
// CHECK-NOT: "reduce_sum"
// CHECK: loomrt.instr "matmul" [0, 38] -> [41, 39] {epilogue = "bgrad", transpose_a = true}
// CHECK-NEXT: {{^ *}}}
// Forward: add + relu of each hidden layer fuse (both results kept for
// backward); the head's bias is a matmul epilogue.
// CHECK: loomrt.program "forward" {
// CHECK-NEXT: loomrt.instr "matmul" [0, 2] -> [4]
// CHECK-NEXT: loomrt.fused [4, 3] -> [5, 6] attributes {kernel = "fused_0", launch = {block = 256 : i64, grid = 1 : i64, vector = 4 : i64}} {
// CHECK-NEXT: ^bb0(%[[X:.*]]: f32, %[[B:.*]]: f32):
// CHECK-NEXT: %[[SUM:.*]] = loomrt.step "add"(%[[X]], %[[B]]) : f32, f32
// CHECK-NEXT: %[[RELU:.*]] = loomrt.step "relu"(%[[SUM]]) : f32
// CHECK-NEXT: loomrt.yield %[[SUM]], %[[RELU]] : f32, f32
// CHECK-NEXT: }
// CHECK-NEXT: loomrt.instr "matmul" [6, 7] -> [9]
// CHECK-NEXT: loomrt.fused [9, 8] -> [10, 11] attributes {kernel = "fused_1"
// CHECK-COUNT-3: loomrt.
// CHECK-NEXT: }
// CHECK-NEXT: loomrt.instr "matmul" [11, 12] -> [14]
// CHECK-NEXT: loomrt.fused [14, 13] -> [15, 16] attributes {kernel = "fused_2"
// CHECK-COUNT-3: loomrt.
// CHECK-NEXT: }
// CHECK-NEXT: loomrt.instr "matmul" [16, 17, 18] -> [20] {epilogue = "bias"}
// CHECK-NEXT: loomrt.instr "cross_entropy" [20, 1] -> [21] {kernel = "ce_4"
// CHECK-NEXT: {{^ *}}}
// CHECK-NOT: loomrt.instr "add"
// CHECK-NOT: loomrt.instr "relu"
// The run of AdamW updates shares one kernel.
// CHECK: loomrt.program "update" {
// CHECK-COUNT-8: loomrt.instr "adamw" {{.*}}kernel = "adam_5"

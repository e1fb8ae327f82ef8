// RUN: loom-opt %s --split-input-file --loom-lower-to-step -verify-diagnostics | FileCheck %s
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-partition-tp" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-lower-to-step" | FileCheck %s --check-prefix=MLP

// loom-lower-to-step: one loomrt.instr per loom op over buffers, every
// loom.repeat unrolled with per-layer parameter names, into a loomrt.bundle
// with one rank.

// Training lowers @loss. Each forward record notes its layer and source op;
// the reshape is a view (view_of) with a `loom.view` record, not a copy. The
// model stays for autodiff's gradient rules.
// CHECK-LABEL: module attributes {loom.options = {batch = 2 : i64, train = true}}
// CHECK: loom.block @layer
// CHECK: func.func @forward
// CHECK: func.func @loss
// CHECK: loomrt.bundle "model" "train" batch 2 seed 0
// CHECK-NEXT: loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64}
// CHECK-NEXT: loomrt.buffer 0 "{{.*}}" : tensor<2x4xi32> "input" at 0
// CHECK-NEXT: loomrt.buffer 1 "{{.*}}" : tensor<8xi32> "input" at 0
// CHECK-NEXT: loomrt.buffer 2 "emb" : tensor<16x8xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 3 "embedding.0" : tensor<2x4x8xf32> "activation" at 0
// CHECK-NEXT: loomrt.buffer 4 "layer.0.w" : tensor<8x8xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 5 "layer.0.matmul.1" : tensor<2x4x8xf32> "activation" at 0
// CHECK-NEXT: loomrt.buffer 6 "layer.0.gelu.2" : tensor<2x4x8xf32> "activation" at 0
// CHECK-NEXT: loomrt.buffer 7 "layer.1.w" : tensor<8x8xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 8 "layer.1.matmul.3"
// CHECK-NEXT: loomrt.buffer 9 "layer.1.gelu.4"
// CHECK-NEXT: loomrt.buffer 10 "reshape.5" : tensor<8x8xf32> "activation" at 0 {view_of = 9 : i64}
// CHECK-NEXT: loomrt.buffer 11 "cross_entropy.6" : tensor<f32> "output" at 0
// CHECK-NEXT: loomrt.param "emb" = 2 "normal"(2.000000e-02)
// CHECK-NEXT: loomrt.param "layer.0.w" = 4 "normal"(1.000000e-01)
// CHECK-NEXT: loomrt.param "layer.1.w" = 7 "normal"(1.000000e-01)
// CHECK-NEXT: loomrt.input "{{.*}}" = 0 {limit = 16 : i64}
// CHECK-NEXT: loomrt.input "{{.*}}" = 1 {limit = 8 : i64}
// CHECK-NEXT: loomrt.output "{{.*}}" = 11
// CHECK-NEXT: loomrt.program "forward" {
// CHECK-NEXT: loomrt.instr "embedding" [2, 0] -> [3] {loom.source = ["forward", 1]}
// CHECK-NEXT: loomrt.instr "matmul" [3, 4] -> [5] {loom.layer = "layer.0.", loom.source = ["layer", 2]}
// CHECK-NEXT: loomrt.instr "gelu" [5] -> [6] {loom.layer = "layer.0.", loom.source = ["layer", 3]}
// CHECK-NEXT: loomrt.instr "matmul" [6, 7] -> [8] {loom.layer = "layer.1.", loom.source = ["layer", 2]}
// CHECK-NEXT: loomrt.instr "gelu" [8] -> [9] {loom.layer = "layer.1.", loom.source = ["layer", 3]}
// CHECK-NEXT: loomrt.instr "reshape" [9] -> [10] {loom.source = ["forward", 3], loom.view = true}
// CHECK-NEXT: loomrt.instr "cross_entropy" [10, 1] -> [11] {loom.source = ["loss", 1]}
// CHECK-NEXT: {{^ *}}}
// CHECK-NOT: loomrt.program
module attributes {loom.options = {batch = 2 : i64, train = true}} {
  loom.param @emb : tensor<16x8xf32> init <normal(0.02)>
  loom.block @layer(%x: tensor<2x4x8xf32>) -> tensor<2x4x8xf32> {
    loom.param @w : tensor<8x8xf32> init <normal(0.1)>
    %w = loom.get @w : tensor<8x8xf32>
    %y = loom.matmul %x, %w : tensor<2x4x8xf32>, tensor<8x8xf32>
    %z = loom.gelu %y : tensor<2x4x8xf32>
    loom.yield %z : tensor<2x4x8xf32>
  }
  func.func @forward(%t: tensor<2x4xi32>) -> tensor<8x8xf32> {
    %e = loom.get @emb : tensor<16x8xf32>
    %x = loom.embedding %e, %t : tensor<16x8xf32>, tensor<2x4xi32>
    %y = loom.repeat 2 @layer(%x) : (tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
    %f = loom.reshape %y : tensor<2x4x8xf32> -> tensor<8x8xf32>
    return %f : tensor<8x8xf32>
  }
  func.func @loss(%t: tensor<2x4xi32>, %l: tensor<8xi32>) -> tensor<f32> {
    %y = call @forward(%t) : (tensor<2x4xi32>) -> tensor<8x8xf32>
    %loss = loom.cross_entropy %y, %l : tensor<8x8xf32>, tensor<8xi32>
    return %loss : tensor<f32>
  }
}

// -----

// Inference lowers @forward without notes and drops the model; the reshape
// is still a view, here of the output.
// CHECK-LABEL: module attributes {loom.options = {batch = 2 : i64, train = false}}
// CHECK-NOT: loom.block
// CHECK-NOT: func.func
// CHECK: loomrt.bundle "model" "infer" batch 2 seed 0
// CHECK: loomrt.buffer 7 "layer.1.matmul.3" : tensor<2x4x8xf32> "activation" at 0
// CHECK-NEXT: loomrt.buffer 8 "layer.1.gelu.4" : tensor<2x4x8xf32> "output" at 0
// CHECK-NEXT: loomrt.buffer 9 "reshape.5" : tensor<8x8xf32> "output" at 0 {view_of = 8 : i64}
// CHECK: loomrt.output "output0" = 9
// CHECK-NEXT: loomrt.program "forward" {
// CHECK-NEXT: loomrt.instr "embedding" [1, 0] -> [2]{{$}}
// CHECK-NEXT: loomrt.instr "matmul" [2, 3] -> [4]{{$}}
// CHECK-NEXT: loomrt.instr "gelu" [4] -> [5]{{$}}
// CHECK-NEXT: loomrt.instr "matmul" [5, 6] -> [7]{{$}}
// CHECK-NEXT: loomrt.instr "gelu" [7] -> [8]{{$}}
// CHECK-NEXT: {{^ *}}}
module attributes {loom.options = {batch = 2 : i64, train = false}} {
  loom.param @emb : tensor<16x8xf32> init <normal(0.02)>
  loom.block @layer(%x: tensor<2x4x8xf32>) -> tensor<2x4x8xf32> {
    loom.param @w : tensor<8x8xf32> init <normal(0.1)>
    %w = loom.get @w : tensor<8x8xf32>
    %y = loom.matmul %x, %w : tensor<2x4x8xf32>, tensor<8x8xf32>
    %z = loom.gelu %y : tensor<2x4x8xf32>
    loom.yield %z : tensor<2x4x8xf32>
  }
  func.func @forward(%t: tensor<2x4xi32>) -> tensor<8x8xf32> {
    %e = loom.get @emb : tensor<16x8xf32>
    %x = loom.embedding %e, %t : tensor<16x8xf32>, tensor<2x4xi32>
    %y = loom.repeat 2 @layer(%x) : (tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
    %f = loom.reshape %y : tensor<2x4x8xf32> -> tensor<8x8xf32>
    return %f : tensor<8x8xf32>
  }
}

// -----

// expected-error @below {{model has no @loss function to compile (training differentiates @loss, which returns a scalar loss)}}
module attributes {loom.options = {batch = 2 : i64, train = true}} {
  func.func @forward(%x: tensor<2x8xf32>) -> tensor<2x8xf32> {
    return %x : tensor<2x8xf32>
  }
}

// -----

// Lowering needs static shapes (loom-specialize-batch runs first).
module attributes {loom.options = {batch = 2 : i64}} {
  // expected-error @below {{cannot lower 'tensor<?x8xf32>': buffers need static shapes}}
  func.func @forward(%x: tensor<?x8xf32>) -> tensor<?x8xf32> {
    %y = loom.relu %x : tensor<?x8xf32>
    return %y : tensor<?x8xf32>
  }
}

// mlp.mlir: loom-compile up to partitioning leaves the model with static shapes
// and no bundle; lowering adds the bundle, with inputs named as the model's
// source names them (the names come from the source file, so inputs read
// from a split or a pipe are named input0, input1), and four matmul records
// (the repeat of 2 layers unrolled).
// BEFORE: func.func @forward(%{{.*}}: tensor<4x784xf32>) -> tensor<4x10xf32>
// BEFORE: loom.repeat 2 @layer
// BEFORE-NOT: loomrt.
// MLP: loomrt.bundle "model" "train" batch 4
// MLP: loomrt.buffer 0 "input" : tensor<4x784xf32> "input" at 0
// MLP-NEXT: loomrt.buffer 1 "labels" : tensor<4xi32> "input" at 0
// MLP: loomrt.param "layer.0.w" = 7 "normal"(6.250000e-02)
// MLP: loomrt.param "layer.1.w" = 12 "normal"(6.250000e-02)
// MLP: loomrt.input "input" = 0
// MLP-NEXT: loomrt.input "labels" = 1 {limit = 10 : i64}
// MLP-NEXT: loomrt.output "loss" = 21
// MLP-NEXT: loomrt.program "forward"
// MLP-COUNT-4: loomrt.instr "matmul"
// MLP: loomrt.instr "cross_entropy" [20, 1] -> [21]
// MLP-NOT: loomrt.instr

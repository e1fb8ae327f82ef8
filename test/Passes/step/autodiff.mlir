// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-pipeline-split" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-pipeline-split" | loom-opt --loom-autodiff | FileCheck %s --check-prefix=MLP
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 pp=2 mb=2 until=loom-pipeline-split" | loom-opt --loom-autodiff | FileCheck %s --check-prefix=GPT
// RUN: loom-opt %s --loom-autodiff -verify-diagnostics

// loom-autodiff walks the forward records in reverse and builds the
// `backward` program from each op's gradient rule; every parameter gets its
// gradient (`grad`, and a loomrt.param_grad per pipeline chunk); the model
// (func.func, loom.block) is dropped, and so are the forward records' notes
// but their layer (`loom.layer`), which every backward instruction built for
// a layer's op notes too, for loom-recompute.

// Before: the model is still there, the forward records carry their notes,
// and there is no backward.
// BEFORE: loom.block @layer
// BEFORE: func.func @loss
// BEFORE: loomrt.program "forward"
// BEFORE: loomrt.instr "matmul" [6, 7] -> [9] {loom.layer = "layer.0.", loom.source = ["layer", 4]}
// BEFORE-NOT: loomrt.program "backward"
// BEFORE-NOT: loomrt.param_grad

// MLP-NOT: func.func
// MLP-NOT: loom.block
// MLP: loomrt.buffer 22 "grad.loss" : tensor<f32> "activation" at 0
// MLP: loomrt.buffer 25 "grad.reduce.view" : tensor<10xf32> "activation" at 0 {view_of = 24 : i64}
// MLP: loomrt.param "in.w" = 2 "normal"(3.571430e-02) {grad = 41 : i64}
// MLP: loomrt.param "out.b" = 18 "zeros"(0.000000e+00) {grad = 25 : i64}
// MLP: loomrt.param_grad 2 chunk 0 = 41
// MLP-COUNT-6: loomrt.param_grad {{[0-9]+}} chunk 0 =
// MLP-NEXT: loomrt.param_grad 18 chunk 0 = 25
// MLP-NEXT: loomrt.program "backward" {
// The seed is 1 / microbatches = 1; the bias gradient is a reduce_sum over
// the batch (its broadcast), the weight gradient a transposed matmul.
// MLP-NEXT: loomrt.instr "fill" [] -> [22] {value = 1.000000e+00 : f64}
// MLP-NEXT: loomrt.instr "cross_entropy_grad" [20, 1, 22] -> [23]
// MLP-NEXT: loomrt.instr "reduce_sum" [23] -> [24] {axes = array<i64: 0>, keepdim = true}
// MLP-NEXT: loomrt.instr "matmul" [23, 17] -> [26] {transpose_b = true}
// MLP-NEXT: loomrt.instr "matmul" [16, 23] -> [27] {transpose_a = true}
// MLP-NEXT: loomrt.instr "unary_grad" [15, 16, 26] -> [28] {fn = "relu", loom.layer = "layer.1."}
// MLP-COUNT-9: loomrt.instr
// No gradient of the input: the last instruction is in.w's.
// MLP-NEXT: loomrt.instr "matmul" [0, 38] -> [41] {transpose_a = true}
// MLP-NEXT: {{^ *}}}
// MLP-NEXT: loomrt.program "forward" {
// MLP-NEXT: loomrt.instr "matmul" [0, 2] -> [4]{{$}}
// MLP: loomrt.instr "matmul" [6, 7] -> [9] {loom.layer = "layer.0."}
// MLP-NOT: loom.source

// GPT with two stages and two microbatches: the seed is 1/2, gradients keep
// their chunk, and the tied embedding (read by the embedding in chunk 0 and
// the head in chunk 1) has one gradient per chunk.
// GPT-NOT: func.func
// GPT: loomrt.param "wte" = 2 "normal"(2.000000e-02) {grad = [[WTE:[0-9]+]] : i64}
// GPT: loomrt.param_grad 2 chunk 0 = [[WTE]]
// GPT-NEXT: loomrt.param_grad 2 chunk 1 = [[WTE1:[0-9]+]]
// GPT-NEXT: loomrt.param_grad 3 chunk 0 =
// GPT: loomrt.param_grad 35 chunk 1 =
// GPT: loomrt.program "backward" {
// GPT-NEXT: loomrt.instr "fill" [] -> [{{[0-9]+}}] {loom.chunk = 1 : i64, value = 5.000000e-01 : f64}
// GPT-NEXT: loomrt.instr "cross_entropy_grad"
// GPT: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}] -> [[[WTE1]]] {loom.chunk = 1 : i64, transpose_a = true}
// GPT-NEXT: loomrt.instr "layernorm_grad" [{{.*}}] -> [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}] {eps = 1.000000e-05 : f64, loom.chunk = 1 : i64}
// GPT: loomrt.instr "attention_grad" {{.*}}causal = true, loom.chunk = 1 : i64, loom.layer = "layer.1.", num_heads = 4 : i64}
// GPT: loomrt.instr "layernorm_grad" {{.*}}loom.chunk = 1 : i64, loom.layer = "layer.1."}
// GPT-COUNT-2: loomrt.instr "layernorm_grad" {{.*}}loom.chunk = 0 : i64, loom.layer = "layer.0."}
// GPT-NOT: loomrt.instr "layernorm_grad"
// GPT: loomrt.instr "embedding_grad" [0, {{[0-9]+}}] -> [[[WTE]]] {loom.chunk = 0 : i64}
// GPT-NEXT: {{^ *}}}
// GPT-NEXT: loomrt.program "forward" {
// GPT-NEXT: loomrt.instr "embedding" [2, 0] -> [4] {loom.chunk = 0 : i64}

// A forward record must name the model op it lowers (loom.source), and the
// model must still be there.
// expected-error @below {{forward entry 'matmul' names no op of the model}}
module attributes {loom.options = {batch = 4 : i64, train = true}} {
  loomrt.bundle "model" "train" batch 4 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<4x8xf32> "input" at 0
      loomrt.buffer 1 "labels" : tensor<4xi32> "input" at 0
      loomrt.buffer 2 "w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 4 "loss" : tensor<f32> "output" at 0
      loomrt.param "w" = 2 "normal"(1.0e-01)
      loomrt.input "x" = 0
      loomrt.input "labels" = 1 {limit = 8 : i64}
      loomrt.output "loss" = 4
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 2] -> [3]
        loomrt.instr "cross_entropy" [3, 1] -> [4]
      }
    }
  }
}

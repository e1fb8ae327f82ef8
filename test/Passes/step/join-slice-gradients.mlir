// RUN: loom-opt %s --loom-join-slice-gradients | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 until=loom-optimizer-update" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 until=loom-optimizer-update" | loom-opt --loom-join-slice-gradients | FileCheck %s --check-prefix=GPT

// loom-join-slice-gradients: the gradient of an operand sliced along one
// axis arrives as one slice_grad per part, summed with adds; where the parts
// tile the axis, one concat of the parts' gradients (in axis order) computes
// the same sum.

// The three parts tile columns [0, 12): one concat writes the sum's buffer.
// Two parts that leave a gap ([4, 8) missing) stay as they are.
// CHECK-LABEL: loomrt.program "backward" {
// CHECK-NEXT: loomrt.instr "concat" [0, 1, 2] -> [7] {axis = 1 : i64}
// CHECK-NEXT: loomrt.instr "slice_grad" [0] -> [8] {axis = 1 : i64, size = 4 : i64, start = 0 : i64}
// CHECK-NEXT: loomrt.instr "slice_grad" [1] -> [9] {axis = 1 : i64, size = 4 : i64, start = 8 : i64}
// CHECK-NEXT: loomrt.instr "add" [8, 9] -> [10]
// CHECK-NEXT: {{^ *}}}

// gpt-tiny: q|k|v slices of each layer's fused projection, two layers.
// BEFORE-COUNT-6: loomrt.instr "slice_grad"
// BEFORE-NOT: "concat"
// GPT-NOT: "slice_grad"
// GPT: loomrt.instr "attention_grad" [{{.*}}] -> [[[Q1:[0-9]+]], [[K1:[0-9]+]], [[V1:[0-9]+]]]
// GPT-NEXT: loomrt.instr "concat" [[[Q1]], [[K1]], [[V1]]] -> [{{[0-9]+}}] {axis = 2 : i64}
// GPT: loomrt.instr "attention_grad" [{{.*}}] -> [[[Q0:[0-9]+]], [[K0:[0-9]+]], [[V0:[0-9]+]]]
// GPT-NEXT: loomrt.instr "concat" [[[Q0]], [[K0]], [[V0]]] -> [{{[0-9]+}}] {axis = 2 : i64}
// GPT-NOT: "slice_grad"
module attributes {loom.options = {batch = 2 : i64, train = true}} {
  loomrt.bundle "model" "train" batch 2 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "dq" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 1 "dk" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 2 "dv" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 3 "v.grad" : tensor<2x12xf32> "activation" at 0
      loomrt.buffer 4 "k.grad" : tensor<2x12xf32> "activation" at 0
      loomrt.buffer 5 "vk.grad" : tensor<2x12xf32> "activation" at 0
      loomrt.buffer 6 "q.grad" : tensor<2x12xf32> "activation" at 0
      loomrt.buffer 7 "qkv.grad" : tensor<2x12xf32> "activation" at 0
      loomrt.buffer 8 "a.grad" : tensor<2x12xf32> "activation" at 0
      loomrt.buffer 9 "b.grad" : tensor<2x12xf32> "activation" at 0
      loomrt.buffer 10 "ab.grad" : tensor<2x12xf32> "activation" at 0
      loomrt.program "backward" {
        loomrt.instr "slice_grad" [2] -> [3] {axis = 1 : i64, size = 4 : i64, start = 8 : i64}
        loomrt.instr "slice_grad" [1] -> [4] {axis = 1 : i64, size = 4 : i64, start = 4 : i64}
        loomrt.instr "add" [3, 4] -> [5]
        loomrt.instr "slice_grad" [0] -> [6] {axis = 1 : i64, size = 4 : i64, start = 0 : i64}
        loomrt.instr "add" [5, 6] -> [7]
        loomrt.instr "slice_grad" [0] -> [8] {axis = 1 : i64, size = 4 : i64, start = 0 : i64}
        loomrt.instr "slice_grad" [1] -> [9] {axis = 1 : i64, size = 4 : i64, start = 8 : i64}
        loomrt.instr "add" [8, 9] -> [10]
      }
    }
  }
}

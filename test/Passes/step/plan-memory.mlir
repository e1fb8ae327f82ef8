// RUN: loom-opt %s --loom-plan-memory | FileCheck %s
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-bf16-step-casts" | loom-opt --loom-plan-memory | FileCheck %s --check-prefix=MLP

// loom-plan-memory packs each rank's buffers into one arena (64-byte
// aligned): persistent buffers (parameters, inputs, outputs, state) first in
// id order, then activations, largest first, each at the lowest offset
// that overlaps no placed activation whose lifetime intersects its own. A
// view shares its buffer's offset.

// Persistent: x [0, 32), w [64, 128), y [128, 160): activations start at 192.
// wide (128 bytes, live at instructions 2-3) goes first, at 192; h0 (live
// 0-1) reuses it; h1 (live 1-2) and h2 (live 3-4, through its view) overlap
// wide's lifetime but not each other's, so they share 320.
// CHECK: loomrt.rank 0 "cpu" attributes {arena_bytes = 384 : i64, coords = {}, peak_bytes = 192 : i64}
// CHECK-NEXT: loomrt.buffer 0 "x" : tensor<2x4xf32> "input" at 0
// CHECK-NEXT: loomrt.buffer 1 "w" : tensor<4x4xf32> "param" at 64
// CHECK-NEXT: loomrt.buffer 2 "h0" : tensor<2x4xf32> "activation" at 192
// CHECK-NEXT: loomrt.buffer 3 "h1" : tensor<2x4xf32> "activation" at 320
// CHECK-NEXT: loomrt.buffer 4 "wide" : tensor<2x16xf32> "activation" at 192
// CHECK-NEXT: loomrt.buffer 5 "h2" : tensor<2x4xf32> "activation" at 320
// CHECK-NEXT: loomrt.buffer 6 "flat" : tensor<8xf32> "activation" at 320 {view_of = 5 : i64}
// CHECK-NEXT: loomrt.buffer 7 "y" : tensor<8xf32> "output" at 128

// Training: the parameters come first, packed in id order; the arena is set.
// MLP: loomrt.rank 0 "cpu" attributes {arena_bytes = {{[1-9][0-9]*}} : i64, coords = {}, peak_bytes = {{[1-9][0-9]*}} : i64}
// MLP-NEXT: loomrt.buffer 0 "input" : tensor<4x784xf32> "input" at 0
// MLP-NEXT: loomrt.buffer 1 "labels" : tensor<4xi32> "input" at 12544
// MLP-NEXT: loomrt.buffer 2 "in.w" : tensor<784x256xf32> "param" at 12608
// MLP-NEXT: loomrt.buffer 3 "in.b" : tensor<256xf32> "param" at 815424
module attributes {loom.options = {batch = 2 : i64}} {
  loomrt.bundle "model" "infer" batch 2 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<2x4xf32> "input" at 0
      loomrt.buffer 1 "w" : tensor<4x4xf32> "param" at 0
      loomrt.buffer 2 "h0" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 3 "h1" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 4 "wide" : tensor<2x16xf32> "activation" at 0
      loomrt.buffer 5 "h2" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 6 "flat" : tensor<8xf32> "activation" at 0 {view_of = 5 : i64}
      loomrt.buffer 7 "y" : tensor<8xf32> "output" at 0
      loomrt.param "w" = 1 "normal"(1.0e-01)
      loomrt.input "x" = 0
      loomrt.output "y" = 7
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 1] -> [2]
        loomrt.instr "relu" [2] -> [3]
        loomrt.instr "concat" [3, 3, 3, 3] -> [4] {axis = 1 : i64}
        loomrt.instr "slice" [4] -> [5] {axis = 1 : i64, size = 4 : i64, start = 0 : i64}
        loomrt.instr "relu" [6] -> [7]
      }
    }
  }
}

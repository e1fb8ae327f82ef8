// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 pp=2 mb=2 optimizer=none until=loom-bf16-step-casts" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 pp=2 mb=2 optimizer=none until=loom-bf16-step-casts" | loom-opt --loom-compact-ranks | FileCheck %s

// loom-compact-ranks drops the buffers and parameters a rank never touches
// and renumbers the rest from 0 (parameters, then inputs and outputs, then
// the rest), rewriting every reference.

// Before: the last stage still declares the first stage's parameters
// (without gradients) and the whole model's buffers.
// BEFORE-LABEL: loomrt.rank 1
// BEFORE: loomrt.buffer 2 "in.w" : tensor<784x256xf32> "param" at 0
// BEFORE: loomrt.buffer 12 "layer.1.w" : tensor<256x256xf32> "param" at 0
// BEFORE: loomrt.param "in.w" = 2 "normal"(3.571430e-02){{$}}
// BEFORE: loomrt.param "layer.1.w" = 12 "normal"(6.250000e-02) {grad = 45 : i64}
// BEFORE: loomrt.input "labels" = 43 {limit = 10 : i64}
// BEFORE-NEXT: loomrt.output "loss" = 44
// BEFORE: loomrt.instr "recv" [] -> [49] {peer = 0 : i64, tag = 22 : i64}
// BEFORE-NEXT: loomrt.instr "matmul" [49, 12] -> [50]

// Stage 0 keeps its four parameters, renumbered 0-3.
// CHECK-LABEL: loomrt.rank 0
// CHECK-NEXT: loomrt.group "all"
// CHECK: loomrt.buffer 0 "in.w" : tensor<784x256xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 1 "in.b" : tensor<256xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 2 "layer.0.w" : tensor<256x256xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 3 "layer.0.b" : tensor<256xf32> "param" at 0
// CHECK-NOT: "layer.1.w"
// CHECK: loomrt.param "in.w" = 0 "normal"(3.571430e-02) {grad = [[G:[0-9]+]] : i64}
// CHECK-NEXT: loomrt.param "in.b" = 1
// CHECK-NEXT: loomrt.param "layer.0.w" = 2
// CHECK-NEXT: loomrt.param "layer.0.b" = 3
// CHECK-NEXT: loomrt.input "input" = 4
// CHECK: loomrt.program "step" {
// CHECK: loomrt.instr "matmul" [{{[0-9]+}}, 0] -> [{{[0-9]+}}]
// CHECK: loomrt.instr "cast" [{{[0-9]+}}] -> [[[G]]]

// Stage 1: only layer.1 and the head; every reference follows the new ids.
// CHECK-LABEL: loomrt.rank 1
// CHECK: loomrt.buffer 0 "layer.1.w" : tensor<256x256xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 1 "layer.1.b" : tensor<256xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 2 "out.w" : tensor<256x10xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 3 "out.b" : tensor<10xf32> "param" at 0
// CHECK-NEXT: loomrt.buffer 4 "input" : tensor<4x784xf32> "input" at 0
// CHECK-NEXT: loomrt.buffer 5 "labels" : tensor<4xi32> "input" at 0
// CHECK-NEXT: loomrt.buffer 6 "loss" : tensor<f32> "output" at 0
// CHECK-NEXT: loomrt.buffer 7 "layer.1.w.grad" : tensor<256x256xf32> "activation" at 0
// CHECK: loomrt.buffer 28 "layer.1.grad.reduce.view@0" : tensor<256xf32> "activation" at 0 {view_of = 25 : i64}
// CHECK-NOT: "in.w"
// CHECK: loomrt.param "layer.1.w" = 0 "normal"(6.250000e-02) {grad = 7 : i64}
// CHECK-NEXT: loomrt.param "layer.1.b" = 1 "zeros"(0.000000e+00) {grad = 8 : i64}
// CHECK-NEXT: loomrt.param "out.w" = 2 "normal"(6.250000e-02) {grad = 9 : i64}
// CHECK-NEXT: loomrt.param "out.b" = 3 "zeros"(0.000000e+00) {grad = 10 : i64}
// CHECK-NEXT: loomrt.input "input" = 4
// CHECK-NEXT: loomrt.input "labels" = 5 {limit = 10 : i64}
// CHECK-NEXT: loomrt.output "loss" = 6
// CHECK-NEXT: loomrt.program "step" {
// CHECK-NEXT: loomrt.instr "recv" [] -> [11] {peer = 0 : i64, tag = 22 : i64}
// CHECK-NEXT: loomrt.instr "matmul" [11, 0] -> [12]
// CHECK-NEXT: loomrt.instr "add" [12, 1] -> [13]
// CHECK: loomrt.instr "slice" [5] -> [17] {axis = 0 : i64, size = 2 : i64, start = 0 : i64}
// CHECK-NEXT: loomrt.instr "cross_entropy" [16, 17] -> [18]
// CHECK-NEXT: loomrt.instr "cast" [18] -> [6]

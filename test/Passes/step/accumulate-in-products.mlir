// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 fuse=true mb=2 until=loom-fuse-elementwise" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 fuse=true mb=2 until=loom-fuse-elementwise" | loom-opt --loom-accumulate-in-products | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 fuse=true until=loom-fuse-elementwise" | loom-opt --loom-accumulate-in-products | FileCheck %s --check-prefix=ONE

// loom-accumulate-in-products: a microbatch's weight gradient goes into its
// f32 sum through the product's own C (beta = 1) instead of a bf16 result
// that a later add reads back.

// Before: the first microbatch's product writes a bf16 gradient that a cast
// copies into the sum; the second's, one that an add adds to it.
// BEFORE: loomrt.buffer [[SUM:[0-9]+]] "layer.1.mlp.proj.w.grad" : tensor<256x64xf32>
// BEFORE: loomrt.buffer [[BIAS0:[0-9]+]] "layer.1.grad.reduce@0" : tensor<1x1x64xbf16>
// BEFORE: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}] -> [[[G0:[0-9]+]], [[BIAS0]]] {epilogue = "bgrad", transpose_a = true}
// BEFORE: loomrt.instr "cast" [[[G0]]] -> [[[SUM]]]
// BEFORE: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}] -> [[[G1:[0-9]+]], {{[0-9]+}}] {epilogue = "bgrad", transpose_a = true}
// BEFORE: loomrt.instr "add" [[[SUM]], [[G1]]] -> [[[SUM]]]

// After: the first product writes the sum (its bias gradient widened to f32:
// cuBLASLt writes it in the result's type); the second adds into it in place.
// CHECK: loomrt.buffer [[SUM:[0-9]+]] "layer.1.mlp.proj.w.grad" : tensor<256x64xf32>
// CHECK: loomrt.buffer [[BIAS0:[0-9]+]] "layer.1.grad.reduce@0" : tensor<1x1x64xf32>
// CHECK: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}] -> [[[SUM]], [[BIAS0]]] {epilogue = "bgrad", transpose_a = true}
// CHECK-NOT: loomrt.instr "cast" [{{[0-9]+}}] -> [[[SUM]]]
// CHECK: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}, [[SUM]]] -> [[[SUM]], {{[0-9]+}}] {epilogue = "bgrad_residual", transpose_a = true}
// CHECK-NOT: loomrt.instr "add" [[[SUM]], {{[0-9]+}}] -> [[[SUM]]]
// CHECK: loomrt.program "update"

// One microbatch: the backward writes the gradients themselves; nothing to fold.
// ONE-NOT: epilogue = "residual"
// ONE-NOT: bgrad_residual

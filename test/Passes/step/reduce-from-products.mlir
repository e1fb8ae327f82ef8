// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 fuse=true dp=2 until=loom-fuse-elementwise" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 fuse=true dp=2 until=loom-fuse-elementwise" | loom-opt --loom-reduce-from-products | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 fuse=true dp=2 zero=1 until=loom-fuse-elementwise" | loom-opt --loom-reduce-from-products | FileCheck %s --check-prefix=ZERO

// loom-reduce-from-products: a data-parallel bucket's weight gradient is
// written in f32 by its product and reduced in place, instead of a bf16
// result that the bucket widens into the f32 gradient.

// Before: the product writes a bf16 gradient (and a bf16 bias gradient);
// the bucket reads both and writes their f32 means.
// BEFORE: loomrt.buffer [[BIAS:[0-9]+]] "layer.1.grad.reduce" : tensor<1x1x64xbf16>
// BEFORE: loomrt.buffer [[G:[0-9]+]] "layer.1.grad.matmul" : tensor<256x64xbf16>
// BEFORE: loomrt.buffer [[W:[0-9]+]] "layer.1.grad.cast" : tensor<256x64xf32>
// BEFORE: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}] -> [[[G]], [[BIAS]]] {epilogue = "bgrad", transpose_a = true}
// BEFORE: loomrt.instr "all_reduce" [{{.*}}[[G]], {{.*}}] -> [{{.*}}[[W]], {{.*}}] {async = true

// After: the product writes the f32 gradient itself (its bias gradient in
// f32 too: cuBLASLt writes it in the result's type), which the bucket
// reduces in place.
// CHECK: loomrt.buffer [[BIAS:[0-9]+]] "layer.1.grad.reduce" : tensor<1x1x64xf32>
// CHECK: loomrt.buffer [[W:[0-9]+]] "layer.1.grad.cast" : tensor<256x64xf32>
// CHECK: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}] -> [[[W]], [[BIAS]]] {epilogue = "bgrad", transpose_a = true}
// CHECK: loomrt.instr "all_reduce" [{{.*}}[[W]], {{.*}}] -> [{{.*}}[[W]], {{.*}}] {async = true
// CHECK: loomrt.program "update"

// ZeRO-1's reduce-scatters are left alone: the products keep their bf16 results.
// ZERO-NOT: tensor<1x1x64xf32>
// ZERO: loomrt.instr "reduce_scatter"

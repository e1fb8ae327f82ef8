// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 fuse=true tp=2 until=loom-fuse-elementwise" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 fuse=true tp=2 until=loom-fuse-elementwise" | loom-opt --loom-overlap-tensor-reduce | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 dp=2 tp=2 until=loom-fuse-elementwise" | loom-opt --loom-overlap-tensor-reduce | FileCheck %s --check-prefix=DP

// loom-overlap-tensor-reduce: a layer's backward all-reduces its input
// gradient over the tensor-parallel group while its weight gradient's
// product runs.

// Before: the input gradient's product, the weight gradient's, then the
// all-reduce, which the layer norm's gradient reads at once.
// BEFORE: loomrt.program "backward" {
// BEFORE: loomrt.instr "matmul" [[[DY:[0-9]+]], {{[0-9]+}}] -> [{{[0-9]+}}] {transpose_b = true}
// BEFORE-NEXT: loomrt.instr "matmul" [{{[0-9]+}}, [[DY]]] -> [{{[0-9]+}}, {{[0-9]+}}] {epilogue = "bgrad", transpose_a = true}
// BEFORE-NEXT: loomrt.instr "all_reduce" [[[DX:[0-9]+]]] -> [[[SUM:[0-9]+]]] {group = "tp", reduction = "sum"}
// BEFORE-NEXT: loomrt.instr "layernorm_grad" [{{[0-9]+}}, {{[0-9]+}}, [[SUM]], {{[0-9]+}}]

// After: the all-reduce right after the product that writes its input, on
// the communication stream; the weight gradient runs beside it and the
// layer norm's gradient waits for it.
// CHECK: loomrt.program "backward" {
// CHECK: loomrt.instr "matmul" [[[DY:[0-9]+]], {{[0-9]+}}] -> [{{[0-9]+}}] {transpose_b = true}
// CHECK-NEXT: loomrt.instr "all_reduce" [[[DX:[0-9]+]]] -> [[[SUM:[0-9]+]]] {async = true, event = [[E:[0-9]+]] : i64, group = "tp", reduction = "sum"}
// CHECK-NEXT: loomrt.instr "matmul" [{{[0-9]+}}, [[DY]]] -> [{{[0-9]+}}, {{[0-9]+}}] {epilogue = "bgrad", transpose_a = true}
// CHECK-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[E]] : i64}
// CHECK-NEXT: loomrt.instr "layernorm_grad" [{{[0-9]+}}, {{[0-9]+}}, [[SUM]], {{[0-9]+}}]
// The forward's all-reduces, read at once by the residual's add, stay as they were.
// CHECK: loomrt.program "forward" {
// CHECK-NOT: async
// CHECK: loomrt.program "prepare"

// With data-parallel buckets on the communication stream, the tensor-parallel
// all-reduces would queue behind them: nothing moves.
// DP: loomrt.program "backward" {
// DP-NOT: {async = true, event = {{[0-9]+}} : i64, group = "tp"
// DP: loomrt.program "forward" {

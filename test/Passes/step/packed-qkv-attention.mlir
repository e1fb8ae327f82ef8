// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 precision=bf16 until=loom-join-slice-gradients" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 precision=bf16 until=loom-join-slice-gradients" | loom-opt --loom-packed-qkv-attention | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 until=loom-join-slice-gradients" | loom-opt --loom-packed-qkv-attention | FileCheck %s --check-prefix=F32

// loom-packed-qkv-attention: where attention's q, k and v are slices of one
// q|k|v projection read by nothing else, bf16 attention reads the
// projection in place (`packed` gives each part's start column) and its
// gradient writes the concat's result; the slices and the concat go.

// Before: three slices feed attention, its gradient feeds a concat.
// BEFORE: loomrt.instr "attention_grad" [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}] -> [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}] {causal = true, num_heads = 4 : i64}
// BEFORE-NEXT: loomrt.instr "concat"
// BEFORE: loomrt.program "forward"
// BEFORE: loomrt.instr "slice" [[[QKV:[0-9]+]]] -> [{{[0-9]+}}] {axis = 2 : i64, size = 64 : i64, start = 0 : i64}
// BEFORE-NEXT: loomrt.instr "slice" [[[QKV]]] -> [{{[0-9]+}}] {axis = 2 : i64, size = 64 : i64, start = 64 : i64}
// BEFORE-NEXT: loomrt.instr "slice" [[[QKV]]] -> [{{[0-9]+}}] {axis = 2 : i64, size = 64 : i64, start = 128 : i64}
// BEFORE-NEXT: loomrt.instr "attention" [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}] -> [{{[0-9]+}}] {causal = true, num_heads = 4 : i64}

// CHECK: loomrt.program "backward"
// CHECK-NOT: "concat"
// CHECK: loomrt.instr "attention_grad" [[[QKV1:[0-9]+]], {{[0-9]+}}] -> [{{[0-9]+}}] {causal = true, num_heads = 4 : i64, packed = array<i64: 0, 64, 128>}
// CHECK-NOT: "concat"
// CHECK: loomrt.instr "attention_grad" [[[QKV0:[0-9]+]], {{[0-9]+}}] -> [{{[0-9]+}}] {causal = true, num_heads = 4 : i64, packed = array<i64: 0, 64, 128>}
// CHECK-NOT: "concat"
// CHECK: loomrt.program "forward"
// CHECK-NOT: "slice"
// CHECK: loomrt.instr "attention" [[[QKV0]]] -> [{{[0-9]+}}] {causal = true, num_heads = 4 : i64, packed = array<i64: 0, 64, 128>}
// CHECK-NOT: "slice"
// CHECK: loomrt.instr "attention" [[[QKV1]]] -> [{{[0-9]+}}] {causal = true, num_heads = 4 : i64, packed = array<i64: 0, 64, 128>}
// CHECK-NOT: "slice"

// f32 training keeps the slices (bf16 bundles only).
// F32-NOT: packed
// F32: loomrt.instr "slice"
// F32-NOT: packed

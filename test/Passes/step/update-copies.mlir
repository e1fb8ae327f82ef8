// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 until=loom-bf16-step-casts" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 until=loom-bf16-step-casts" | loom-opt --loom-update-copies | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 pp=2 mb=4 schedule=zb-h1 until=loom-update-copies" | FileCheck %s --check-prefix=PIPE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 precision=bf16 optimizer=sgd until=loom-update-copies" | FileCheck %s --check-prefix=SGD
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 dp=2 zero=1 until=loom-update-copies" | FileCheck %s --check-prefix=ZERO
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 until=loom-bf16-step-casts" | loom-opt --loom-update-copies | FileCheck %s --check-prefix=F32

// loom-update-copies: mixed-precision training stops casting the f32
// masters to bf16 in every step; the update writes the copies.

// Before: the forward casts wte (buffer 2) twice, once for the lookup and
// once for the tied head, and AdamW updates the master alone.
// BEFORE-LABEL: loomrt.rank 0
// BEFORE: loomrt.program "forward" {
// BEFORE: loomrt.instr "cast" [2] -> [5]
// BEFORE: loomrt.instr "cast" [2] -> [95]
// BEFORE: loomrt.program "update" {
// BEFORE: loomrt.instr "adamw" [2, {{[0-9]+}}, [[M:[0-9]+]], [[V:[0-9]+]], {{[0-9]+}}, {{[0-9]+}}] -> [2, [[M]], [[V]]] {

// After: one copy, kept across steps (role cache) and named for its master;
// the head reads the lookup's copy; no weight is cast in the forward.
// CHECK-LABEL: loomrt.rank 0
// CHECK: loomrt.buffer 5 "wte.bf16" : tensor<256x64xbf16> "cache"
// CHECK: loomrt.program "forward" {
// CHECK-NOT: "cast"
// CHECK: loomrt.instr "embedding" [5, 0]
// CHECK-NOT: "cast"
// CHECK: loomrt.instr "matmul" [{{[0-9]+}}, 5] {{.*}}transpose_b = true
// CHECK-NOT: "cast"
// CHECK: }
// "prepare" casts every master once, when weights are written.
// CHECK: loomrt.program "prepare" {
// CHECK-NEXT: loomrt.instr "cast" [2] -> [5]
// CHECK-NEXT: loomrt.instr "cast" [3] -> [4]
// The update's AdamW writes the copy as its fourth output.
// CHECK: loomrt.program "update" {
// CHECK: loomrt.instr "adamw" [2, {{[0-9]+}}, [[M:[0-9]+]], [[V:[0-9]+]], {{[0-9]+}}, {{[0-9]+}}] -> [2, [[M]], [[V]], 5] {
// CHECK: loomrt.instr "adamw" [3, {{.*}}] -> [3, {{[0-9]+}}, {{[0-9]+}}, 4] {

// Pipelined: each stage keeps its own copy of the tied embedding, written by
// its own update.
// PIPE-LABEL: loomrt.rank 0
// PIPE: loomrt.buffer [[C0:[0-9]+]] "wte.bf16" : tensor<256x64xbf16> "cache"
// PIPE: loomrt.program "prepare" {
// PIPE-NEXT: loomrt.instr "cast" [2] -> [[[C0]]]
// PIPE: loomrt.program "step" {
// PIPE-NOT: "cast" [2]
// PIPE: loomrt.program "update" {
// PIPE: loomrt.instr "adamw" [2, {{.*}}] -> [2, {{[0-9]+}}, {{[0-9]+}}, [[C0]]]
// PIPE-LABEL: loomrt.rank 1
// PIPE: loomrt.buffer [[C1:[0-9]+]] "wte.bf16" : tensor<256x64xbf16> "cache"
// PIPE: loomrt.instr "adamw" [2, {{.*}}] -> [2, {{[0-9]+}}, {{[0-9]+}}, [[C1]]]

// SGD writes its copies as its third output.
// SGD: loomrt.program "prepare" {
// SGD-NEXT: loomrt.instr "cast" [3] -> [4]
// SGD: loomrt.instr "sgd" [3, {{[0-9]+}}, [[MOM:[0-9]+]], {{[0-9]+}}, {{[0-9]+}}] -> [3, [[MOM]], 4]

// ZeRO-1 gathers the copies from the master slices at the forward's start
// (loom-zero-gather-copies): nothing here for this pass; no update writes a copy.
// ZERO: loomrt.program "update" {
// ZERO-NOT: "adamw" [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}] -> [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}]
// ZERO: }

// f32 training has no copies: the pass leaves it alone.
// F32-NOT: loomrt.program "prepare"
// F32: loomrt.instr "adamw" [2, {{[0-9]+}}, [[M:[0-9]+]], [[V:[0-9]+]], {{[0-9]+}}, {{[0-9]+}}] -> [2, [[M]], [[V]]] {

// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 precision=bf16 until=loom-packed-qkv-attention" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 precision=bf16 until=loom-packed-qkv-attention" | loom-opt --loom-bf16-step-casts | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 mb=2 precision=bf16 until=loom-packed-qkv-attention" | FileCheck %s --check-prefix=MB-BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 mb=2 precision=bf16 until=loom-packed-qkv-attention" | loom-opt --loom-bf16-step-casts | FileCheck %s --check-prefix=MB
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 dp=2 precision=bf16 until=loom-packed-qkv-attention" | FileCheck %s --check-prefix=DP-BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 dp=2 precision=bf16 until=loom-packed-qkv-attention" | loom-opt --loom-bf16-step-casts | FileCheck %s --check-prefix=DP
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 dp=2 zero=1 precision=bf16 until=loom-packed-qkv-attention" | FileCheck %s --check-prefix=ZERO-BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 dp=2 zero=1 precision=bf16 until=loom-packed-qkv-attention" | loom-opt --loom-bf16-step-casts | FileCheck %s --check-prefix=ZERO

// loom-bf16-step-casts: the optimizer and the clipping norm read bf16
// gradients directly where nothing else reads their f32 copies; the weights'
// casts move to the start of the forward; a pipelined step casts each
// weight once for all microbatches.

// Before: layer.0.ln1.g's gradient is the f32 cast of the bf16
// layernorm_grad result, and the weights are cast where they are read.
// BEFORE: loomrt.buffer 220 "layer.0.grad.layernorm_grad" : tensor<64xbf16> "activation" at 0
// BEFORE: loomrt.buffer 224 "layer.0.grad.cast" : tensor<64xf32> "activation" at 0
// BEFORE: loomrt.param "layer.0.ln1.g" = 8 "ones"(0.000000e+00) {grad = 224 : i64}
// BEFORE: loomrt.instr "cast" [220] -> [224]
// BEFORE: loomrt.program "forward" {
// BEFORE-NEXT: loomrt.instr "cast" [3] -> [4]
// BEFORE-NEXT: loomrt.instr "cast" [2] -> [5]
// BEFORE-NEXT: loomrt.instr "embedding" [5, 0] -> [6]
// BEFORE: loomrt.instr "adamw" [8, 224, {{.*}}] -> [8,

// After: the gradient is the bf16 buffer itself, with no cast to f32; the
// norm and AdamW read it.
// CHECK: loomrt.param "layer.0.ln1.g" = 8 "ones"(0.000000e+00) {grad = 220 : i64}
// CHECK: loomrt.program "backward" {
// CHECK-NOT: loomrt.instr "cast" [220]
// CHECK: loomrt.instr "layernorm_grad" [{{[0-9]+}}, 9, {{[0-9]+}}] -> [{{[0-9]+}}, 220, 221]
// CHECK-NOT: loomrt.instr "cast" [220]
// Every weight (28 parameters, the tied embedding cast twice: once for the
// lookup, once for the head) is cast at the start of the forward.
// CHECK: loomrt.program "forward" {
// CHECK-NEXT: loomrt.instr "cast" [3] -> [4]
// CHECK-NEXT: loomrt.instr "cast" [2] -> [5]
// CHECK-COUNT-27: loomrt.instr "cast"
// CHECK-NEXT: loomrt.instr "embedding" [5, 0] -> [6]
// CHECK-NOT: loomrt.instr "cast"
// CHECK: loomrt.program "update" {
// CHECK: loomrt.instr "global_norm" [{{.*}}, 220, 221, {{.*}}] -> [{{[0-9]+}}]
// CHECK: loomrt.instr "adamw" [8, 220, {{.*}}] -> [8,

// Two microbatches: wte was cast for each microbatch's lookup and head (4
// casts); now once, and both microbatches' lookups read that cast.
// MB-BEFORE: loomrt.program "step" {
// MB-BEFORE-COUNT-4: loomrt.instr "cast" [2] ->
// MB-BEFORE-NOT: loomrt.instr "cast" [2] ->
// MB: loomrt.program "step" {
// MB: loomrt.instr "cast" [2] -> [[[WTE:[0-9]+]]]
// MB-NOT: loomrt.instr "cast" [2] ->
// MB: loomrt.instr "embedding" [[[WTE]], {{[0-9]+}}] ->
// MB-NOT: loomrt.instr "cast" [2] ->
// MB: loomrt.instr "embedding" [[[WTE]], {{[0-9]+}}] ->
// MB-NOT: loomrt.instr "cast" [2] ->

// Data parallelism: the final layernorm's gradients (bf16 108 and 107) were
// cast to f32 (109 and 110) and the first bucket's async all-reduce
// averaged the copies in place. Now it reads the bf16 gradients and writes
// the f32 means, and the casts are gone. So for a bias's gradient, a view
// (112, [64]) of its reduce_sum's [1, 1, 64] result (111): the bucket reads
// the view.
// DP-BEFORE: loomrt.buffer 112 "layer.1.grad.reduce.view" : tensor<64xbf16> "activation" at 0 {view_of = 111 : i64}
// DP-BEFORE: loomrt.program "backward" {
// DP-BEFORE: loomrt.instr "cast" [108] -> [109]
// DP-BEFORE-NEXT: loomrt.instr "cast" [107] -> [110]
// DP-BEFORE: loomrt.instr "cast" [112] -> [118]
// DP-BEFORE: loomrt.instr "all_reduce" [109, 110, 118, {{.*}}] -> [109, 110, 118, {{.*}}] {async = true, event = 0 : i64
// DP: loomrt.program "backward" {
// DP-NOT: loomrt.instr "cast" [108]
// DP: loomrt.instr "layernorm_grad" [89, 91, 103] -> [106, 107, 108]
// DP-NOT: loomrt.instr "cast" [{{107|108|112}}]
// DP: loomrt.instr "all_reduce" [108, 107, 112, {{.*}}] -> [109, 110, 118, {{.*}}] {async = true, event = 0 : i64

// ZeRO-1: each bucket's reduce-scatter read the f32 copies that a cast per
// gradient wrote; it reads the bf16 gradients instead (widened as the
// bucket is packed), and a parameter's gradient is its bf16 one. The tied
// embedding's f32 sum (229) stays as it is.
// ZERO-BEFORE-LABEL: loomrt.rank 0
// ZERO-BEFORE: loomrt.param "wpe" = 3 "normal"(1.000000e-02) {grad = 230 : i64}
// ZERO-BEFORE: loomrt.instr "cast" [108] -> [109]
// ZERO-BEFORE: loomrt.instr "cast" [226] -> [230]
// ZERO-BEFORE-NEXT: loomrt.instr "reduce_scatter" [109, 110, {{.*}}, 229, 230] -> [258, 257, {{.*}}] {async = true
// ZERO-LABEL: loomrt.rank 0
// ZERO: loomrt.param "wpe" = 3 "normal"(1.000000e-02) {grad = 226 : i64}
// ZERO: loomrt.program "backward" {
// ZERO-NOT: "cast"
// ZERO: loomrt.instr "reduce_scatter" [108, 107, {{.*}}, 229, 226] -> [258, 257, {{.*}}] {async = true
// ZERO-NOT: "cast"
// ZERO: loomrt.program "forward" {

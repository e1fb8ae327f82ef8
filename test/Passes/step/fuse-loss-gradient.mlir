// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 fuse=true until=loom-update-copies" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 fuse=true until=loom-update-copies" | loom-opt --loom-fuse-loss-gradient | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 fuse=true pp=2 mb=4 schedule=zb-h1 until=loom-fuse-loss-gradient" | FileCheck %s --check-prefix=PIPE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 fuse=true tp=2 until=loom-fuse-loss-gradient" | FileCheck %s --check-prefix=VOCAB
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 fuse=true" | FileCheck %s --check-prefix=ALL

// loom-fuse-loss-gradient: the loss writes its gradient over the logits.

// Before: the forward's loss and the backward's seed and gradient each
// read the logits (buffer 96); the gradient has a buffer of its own (99),
// read through a view by the head's products.
// BEFORE: loomrt.buffer 101 "grad.cross_entropy_grad.view" : tensor<128x256xbf16> "activation" at 0 {view_of = 99 : i64}
// BEFORE: loomrt.program "backward" {
// BEFORE-NEXT: loomrt.instr "fill" [] -> [98] {value = 1.000000e+00 : f64}
// BEFORE-NEXT: loomrt.instr "cross_entropy_grad" [96, 1, 98] -> [99]
// BEFORE: loomrt.program "forward" {
// BEFORE: loomrt.instr "cross_entropy" [96, 1] -> [97]{{$}}

// After: the loss's second output is the logits, scaled by the seed; the
// backward starts with the products that read the gradient, now the logits'
// memory.
// CHECK: loomrt.buffer 101 "grad.cross_entropy_grad.view" : tensor<128x256xbf16> "activation" at 0 {view_of = 96 : i64}
// CHECK: loomrt.program "backward" {
// CHECK-NOT: "fill" [] -> [98]
// CHECK-NOT: cross_entropy_grad
// CHECK-NEXT: loomrt.instr "matmul" [101, {{[0-9]+}}]
// CHECK: loomrt.program "forward" {
// CHECK: loomrt.instr "cross_entropy" [96, 1] -> [97, 96] {grad_scale = 1.000000e+00 : f64}

// Pipelined: each microbatch's loss on the last stage writes its gradient,
// scaled by the microbatch's share.
// PIPE-LABEL: loomrt.rank 1
// PIPE: loomrt.program "step" {
// PIPE-NOT: cross_entropy_grad
// PIPE: loomrt.instr "cross_entropy" [[[L0:[0-9]+]], {{[0-9]+}}] -> [{{[0-9]+}}, [[L0]]] {grad_scale = 2.500000e-01 : f64}
// PIPE: loomrt.instr "cross_entropy" [[[L1:[0-9]+]], {{[0-9]+}}] -> [{{[0-9]+}}, [[L1]]] {grad_scale = 2.500000e-01 : f64}
// PIPE: loomrt.instr "cross_entropy" [[[L2:[0-9]+]], {{[0-9]+}}] -> [{{[0-9]+}}, [[L2]]] {grad_scale = 2.500000e-01 : f64}
// PIPE: loomrt.instr "cross_entropy" [[[L3:[0-9]+]], {{[0-9]+}}] -> [{{[0-9]+}}, [[L3]]] {grad_scale = 2.500000e-01 : f64}
// PIPE: loomrt.program "update" {

// A vocabulary split over tensor-parallel ranks too: the loss combines the
// group's statistics, then writes each rank's part of the gradient over its
// part of the logits (the backward's gradient, its seed fill gone).
// VOCAB-LABEL: loomrt.rank 0
// VOCAB: loomrt.program "backward" {
// VOCAB-NOT: cross_entropy_grad
// VOCAB: loomrt.program "forward" {
// VOCAB: loomrt.instr "cross_entropy" [[[L:[0-9]+]], 1] -> [{{[0-9]+}}, [[L]]] {grad_scale = 1.000000e+00 : f64, vocab_group = "tp"}

// In the whole pipeline, the loss runs the runtime's fused kernel: no
// generated kernel is named for it.
// ALL: loomrt.instr "cross_entropy" [{{[0-9]+}}, 1] -> [{{[0-9]+}}, {{[0-9]+}}] {grad_scale = 1.000000e+00 : f64}{{$}}

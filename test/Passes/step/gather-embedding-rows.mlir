// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 fuse=true dp=2 until=loom-reduce-from-products" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 fuse=true dp=2 until=loom-reduce-from-products" | loom-opt --loom-gather-embedding-rows | FileCheck %s
// RUN: loom-opt %models/llama-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 fuse=true dp=2 until=loom-reduce-from-products" | loom-opt --loom-gather-embedding-rows | FileCheck %s --check-prefix=UNTIED
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 fuse=true dp=2 zero=1 until=loom-reduce-from-products" | loom-opt --loom-gather-embedding-rows | FileCheck %s --check-prefix=ZERO
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 precision=bf16 fuse=true dp=2 zero=2 until=loom-reduce-from-products" | loom-opt --loom-gather-embedding-rows | FileCheck %s --check-prefix=ZERO2
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=16 dp=2 until=loom-update-copies" | loom-opt --loom-gather-embedding-rows | FileCheck %s --check-prefix=LARGER

// loom-gather-embedding-rows: a data-parallel bucket's embedding gradient
// is no longer reduced whole after the backward's last instruction. A tied
// table's head product writes the f32 gradient and reduces it in a bucket
// of its own at once; the update adds every replica's lookup rows into it,
// from their token ids and output gradients gathered over dp.

// Before: the head's product (bf16), the lookup's table gradient last, their
// f32 sum in the last bucket.
// BEFORE: loomrt.buffer [[HEAD:[0-9]+]] "grad.matmul" : tensor<256x64xbf16>
// BEFORE: loomrt.buffer [[G:[0-9]+]] "grad.sum" : tensor<256x64xf32>
// BEFORE: loomrt.program "backward"
// BEFORE: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}] -> [[[HEAD]]] {transpose_a = true}
// BEFORE: loomrt.instr "embedding_grad" [0, [[DY:[0-9]+]]] -> [[[E:[0-9]+]]]
// BEFORE-NEXT: loomrt.instr "add" [[[HEAD]], [[E]]] -> [[[G]]]
// BEFORE-NEXT: loomrt.instr "all_reduce" [{{.*}}[[G]]{{.*}}] {async = true, event = 0

// After: the product writes the f32 gradient and reduces it right away.
// CHECK: loomrt.buffer [[G:[0-9]+]] "grad.sum" : tensor<256x64xf32>
// CHECK: loomrt.buffer [[IDS:[0-9]+]] "tokens.gathered" : tensor<8x32xi32>
// CHECK: loomrt.buffer [[ROWS:[0-9]+]] "layer.0.grad.sum.gathered" : tensor<8x32x64xbf16>
// CHECK: loomrt.program "backward"
// CHECK-NEXT: loomrt.instr "matmul"
// CHECK-NEXT: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}] -> [[[G]]] {transpose_a = true}
// CHECK-NEXT: loomrt.instr "all_reduce" [[[G]]] -> [[[G]]] {async = true, event = 1 : i64, group = "dp", reduction = "mean"}
// CHECK-NOT: "embedding_grad"
// CHECK: loomrt.instr "all_reduce" [{{[0-9, ]+}}] -> [{{[0-9, ]+}}] {async = true, event = 0
// CHECK-NOT: [[G]]
// CHECK: loomrt.program "forward"
// The update adds the rows, scaled by 1 / dp, after the buckets' wait.
// CHECK: loomrt.program "update"
// CHECK-NEXT: loomrt.instr "event_wait" [] -> [] {event = 0 : i64}
// CHECK-NEXT: loomrt.instr "all_gather" [0] -> [[[IDS]]] {axis = 0 : i64, group = "dp"}
// CHECK-NEXT: loomrt.instr "all_gather" [[[DY:[0-9]+]]] -> [[[ROWS]]] {axis = 0 : i64, group = "dp"}
// CHECK-NEXT: loomrt.instr "embedding_grad" [[[IDS]], [[ROWS]]] -> [[[G]]] {accumulate = true, scale = 5.000000e-01 : f64}

// Untied (Llama): the lookup's gradient leaves its bucket and the update
// writes it from the gathered rows (no accumulate).
// UNTIED: loomrt.program "backward"
// UNTIED-NOT: "embedding_grad"
// UNTIED: loomrt.program "update"
// UNTIED: loomrt.instr "embedding_grad" [{{[0-9]+}}, {{[0-9]+}}] -> [{{[0-9]+}}] {scale = 5.000000e-01 : f64}

// ZeRO-1: the head's gradient is reduce-scattered into this rank's slice at
// once, and the update adds the rows of this rank's part of the vocabulary
// into a [vocab / dp, hidden] view of the slice.
// ZERO: loomrt.buffer [[G:[0-9]+]] "grad.sum" : tensor<256x64xf32>
// ZERO: loomrt.buffer [[SHARD:[0-9]+]] "wte.grad_shard" : tensor<8192xf32>
// ZERO: loomrt.buffer [[ROWS:[0-9]+]] "wte.grad_shard.rows" : tensor<128x64xf32> "activation" at 0 {view_of = [[SHARD]] : i64}
// ZERO: loomrt.program "backward"
// ZERO-NEXT: loomrt.instr "matmul"
// ZERO-NEXT: loomrt.instr "matmul" [{{[0-9]+}}, {{[0-9]+}}] -> [[[G]]] {transpose_a = true}
// ZERO-NEXT: loomrt.instr "reduce_scatter" [[[G]]] -> [[[SHARD]]] {async = true
// ZERO-NOT: "embedding_grad"
// ZERO: loomrt.program "update"
// ZERO: loomrt.instr "embedding_grad" [{{[0-9]+}}, {{[0-9]+}}] -> [[[ROWS]]] {accumulate = true, scale = 5.000000e-01 : f64, vocab_group = "dp"}

// ZeRO-2 (its buckets free their gradients as they go) is left alone.
// ZERO2-NOT: gathered
// ZERO2: loomrt.program "backward"
// ZERO2: loomrt.instr "embedding_grad"
// ZERO2-NOT: gathered

// f32 at 8 sequences a replica: 2 x (8 x 32 ids + 8 x 32 x 64 rows) in
// 4-byte elements is more than the 256 x 64 table, so it is left alone.
// LARGER-NOT: gathered
// LARGER: loomrt.program "backward"
// LARGER: loomrt.instr "embedding_grad"
// LARGER-NOT: gathered

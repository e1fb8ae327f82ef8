// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="serve=true max-batch=2 prefill-chunk=4 until=loom-lower-to-step" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="serve=true max-batch=2 prefill-chunk=4 until=loom-serve-programs" | FileCheck %s
// RUN: loom-opt %models/llama-tiny.mlir --loom-compile="serve=true max-batch=2 block-size=4 precision=bf16 until=loom-serve-programs" | FileCheck %s --check-prefix=LLAMA
// RUN: loom-opt %models/llama-tiny.mlir --loom-compile="serve=true max-batch=2 precision=bf16 weight-layout=kn until=loom-serve-programs" | FileCheck %s --check-prefix=KN
// RUN: not loom-opt %models/bert-tiny.mlir --loom-compile="serve=true until=loom-serve-programs" 2>&1 | FileCheck %s --check-prefix=BERT
// RUN: not loom-opt %models/gpt-tiny.mlir --loom-compile="serve=true max-seq=64 until=loom-serve-programs" 2>&1 | FileCheck %s --check-prefix=LONG

// loom-serve-programs: the forward pass over [1, seq] becomes step programs
// serve.N over N token slots (1, 2 = max-batch, 4 = the prefill chunk), each
// attention a kv_write into the layer's paged cache and a paged_attention
// over it, the learned positions read at each token's position, and the
// final norm and head run on the sampled rows only.

// BEFORE: loomrt.bundle "model" "infer"
// BEFORE: loomrt.program "forward" {
// BEFORE: loomrt.instr "add" [3, 2] -> [4]
// BEFORE: loomrt.instr "attention" [12, 13, 14] -> [15] {causal = true, num_heads = 4 : i64}

// CHECK: loomrt.bundle "model" "serve" batch 1
// CHECK-SAME: serve = {block_size = 16 : i64, max_batch = 2 : i64, max_blocks_per_seq = 2 : i64, max_seq = 32 : i64, num_blocks = 4 : i64, programs = [{name = "serve.1", rows = 1 : i64, tokens = 1 : i64}, {name = "serve.2", rows = 2 : i64, tokens = 2 : i64}, {name = "serve.4", rows = 2 : i64, tokens = 4 : i64}], vocab = 256 : i64}
// One cache pair per layer, [blocks x block size, kv width], never saved.
// CHECK: loomrt.buffer [[K0:[0-9]+]] "layer.0.attention.8.k_cache" : tensor<64x64xf32> "cache"
// CHECK: loomrt.buffer [[V0:[0-9]+]] "layer.0.attention.8.v_cache" : tensor<64x64xf32> "cache"
// CHECK: loomrt.buffer [[TOK:[0-9]+]] "serve.1.tokens" : tensor<1x1xi32> "input"
// CHECK: loomrt.buffer [[POS:[0-9]+]] "serve.1.positions" : tensor<1x1xi32> "input"
// CHECK: loomrt.buffer [[SLOTS:[0-9]+]] "serve.1.slots" : tensor<1xi32> "input"
// CHECK: loomrt.buffer [[TABLE:[0-9]+]] "serve.1.block_table" : tensor<1x2xi32> "input"
// CHECK: loomrt.buffer [[ROWS:[0-9]+]] "serve.1.rows" : tensor<1xi32> "input"
// CHECK: "serve.4.logits" : tensor<1x2x256xf32> "output"
// CHECK: loomrt.input "serve.1.tokens" = [[TOK]] {limit = 256 : i64}
// CHECK: loomrt.input "serve.1.positions" = [[POS]] {limit = 32 : i64}
// CHECK: loomrt.program "serve.1" {
// CHECK-NEXT: loomrt.instr "embedding" [0, [[TOK]]]
// CHECK-NEXT: loomrt.instr "embedding" [1, [[POS]]] -> [[[PE:[0-9]+]]]
// CHECK-NEXT: loomrt.instr "add" [{{[0-9]+}}, [[PE]]]
// CHECK: loomrt.instr "kv_write" [{{[0-9]+}}, {{[0-9]+}}, [[SLOTS]]] -> [[[K0]], [[V0]]]
// CHECK-NEXT: loomrt.instr "paged_attention" [{{[0-9]+}}, [[K0]], [[V0]], [[POS]], [[TABLE]]] -> [{{[0-9]+}}] {block_size = 16 : i64, num_heads = 4 : i64, num_kv_heads = 4 : i64}
// CHECK: loomrt.instr "embedding" [{{[0-9]+}}, [[ROWS]]]
// CHECK-NEXT: loomrt.instr "layernorm"
// CHECK-NEXT: loomrt.instr "matmul" {{.*}} {transpose_b = true}
// CHECK-NEXT: }
// CHECK: loomrt.program "serve.2" {
// CHECK: loomrt.program "serve.4" {
// CHECK-NOT: loomrt.program "forward"

// Llama in bf16: the parameter casts run once in `prepare`, into persistent
// copies, those of the products' weights transposed to [N, K] (read with
// transpose_b; weight-layout=kn keeps [K, N]); rotary embeddings rotate by
// the tokens' positions; grouped kv heads.
// LLAMA: loomrt.bundle "model" "serve"
// LLAMA-SAME: block_size = 4 : i64
// LLAMA-SAME: prepare = "prepare"
// LLAMA: "layer.0.attention.{{[0-9]+}}.k_cache" : tensor<{{[0-9]+}}x32xbf16> "cache"
// LLAMA: loomrt.program "prepare" {
// LLAMA-NEXT: loomrt.instr "cast"
// LLAMA: loomrt.instr "cast" [4] -> [[[CAST:[0-9]+]]]
// LLAMA-NEXT: loomrt.instr "transpose" [[[CAST]]] -> [5] {permutation = array<i64: 1, 0>}
// LLAMA: loomrt.program "serve.1" {
// LLAMA: loomrt.instr "matmul" [{{[0-9]+}}, 5] -> [{{[0-9]+}}] {transpose_b = true}
// LLAMA: loomrt.instr "rotary" [{{[0-9]+}}, [[LPOS:[0-9]+]]] -> [{{[0-9]+}}] {num_heads = 4 : i64
// LLAMA-NEXT: loomrt.instr "rotary" [{{[0-9]+}}, [[LPOS]]] -> [{{[0-9]+}}] {num_heads = 2 : i64
// LLAMA: loomrt.instr "paged_attention" {{.*}} {block_size = 4 : i64, num_heads = 4 : i64, num_kv_heads = 2 : i64}
// LLAMA-NOT: loomrt.instr "cast" [{{[0-9]+}}] -> [{{[0-9]+}}]{{$}}

// KN: loomrt.program "prepare" {
// KN-NOT: "transpose"
// KN: loomrt.program "serve.1" {
// KN: loomrt.instr "matmul" [{{[0-9]+}}, 5] -> [{{[0-9]+}}]{{$}}

// BERT: cannot compile for serving: serving needs causal attention over q, k, v
// LONG: cannot compile for serving: --max-seq 64 is longer than the model's 32 learned positions

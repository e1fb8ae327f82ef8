// RUN: loom-opt %models/gpt-tiny.mlir --loom-specialize-batch=batch=2 --loom-partition-tp=tp=2 | FileCheck %s
// RUN: loom-opt %models/llama-tiny.mlir --loom-specialize-batch=batch=2 --loom-partition-tp=tp=2 | FileCheck %s --check-prefix=LLAMA
// RUN: not loom-opt %models/llama-tiny.mlir --loom-specialize-batch=batch=2 --loom-partition-tp=tp=4 2>&1 | FileCheck %s --check-prefix=HEADS
// RUN: not loom-opt %models/mlp.mlir --loom-specialize-batch=batch=2 --loom-partition-tp=tp=2 2>&1 | FileCheck %s --check-prefix=NORULE
// RUN: not loom-opt %models/gpt-tiny.mlir --loom-partition-tp=tp=2 2>&1 | FileCheck %s --check-prefix=DYNAMIC
// RUN: loom-opt %models/gpt-tiny.mlir --loom-specialize-batch=batch=2 --loom-partition-tp="tp=2 gather-outputs=1" | FileCheck %s --check-prefix=GATHER
// RUN: not loom-opt %models/gpt-tiny.mlir --loom-specialize-batch=batch=2 --loom-mixed-precision --loom-partition-tp=tp=2 2>&1 | FileCheck %s --check-prefix=NOTHING

// Nothing to split (here: weights read through mixed precision's casts) is
// an error, never every rank silently computing the whole model.
// NOTHING: error: tensor parallelism (tp = 2) found no matrix product of a parameter to split

// Megatron's pattern: the vocabulary-parallel embedding and head, the fused
// q|k|v projection split per block, column- then row-parallel pairs.
// CHECK: loom.mesh = #loom.mesh<["tp" = 2]>
// CHECK: loom.param @wte : tensor<128x64xf32> {{.*}}loom.shard = {axis = 0 : i64, blocks = 1 : i64, group = "tp", parts = 2 : i64}
// CHECK: loom.param @wpe : tensor<32x64xf32> init <normal(0.01)>
// CHECK-NOT: loom.shard
// CHECK: loom.param @ln_f.g

// One layer: exactly two all-reduces forward (after each row-parallel
// projection), and two grad_all_reduce ops whose backward all-reduces.
// CHECK-LABEL: loom.block @layer
// CHECK: loom.param @attn.qkv.w : tensor<64x96xf32> {{.*}}axis = 1 : i64, blocks = 3 : i64
// CHECK: loom.param @attn.qkv.b : tensor<96xf32> {{.*}}axis = 0 : i64, blocks = 3 : i64
// CHECK: loom.param @attn.proj.w : tensor<32x64xf32> {{.*}}axis = 0 : i64, blocks = 1 : i64
// CHECK: loom.param @attn.proj.b : tensor<64xf32> init <zeros>
// CHECK-NOT: loom.shard
// CHECK: loom.param @ln2.g
// CHECK: loom.param @mlp.fc.w : tensor<64x128xf32> {{.*}}axis = 1 : i64
// CHECK: loom.param @mlp.proj.w : tensor<128x64xf32> {{.*}}axis = 0 : i64
// CHECK: %[[H1:.*]] = loom.layernorm
// CHECK-NEXT: %[[IN1:.*]] = loom.grad_all_reduce %[[H1]] {group = "tp"} : tensor<2x32x64xf32>
// CHECK: loom.matmul %[[IN1]], %{{.*}} : tensor<2x32x64xf32>, tensor<64x96xf32>
// CHECK: loom.slice %{{.*}} {axis = 2 : i64, size = 32 : i64, start = 0 : i64}
// CHECK: loom.slice %{{.*}} {axis = 2 : i64, size = 32 : i64, start = 32 : i64}
// CHECK: loom.slice %{{.*}} {axis = 2 : i64, size = 32 : i64, start = 64 : i64}
// CHECK: loom.attention {{.*}}num_heads = 2 : i64
// CHECK: %[[P:.*]] = loom.matmul %{{.*}} : tensor<2x32x32xf32>, tensor<32x64xf32>
// CHECK-NEXT: %[[R:.*]] = loom.all_reduce %[[P]] {group = "tp"}
// CHECK-NEXT: loom.add %[[R]]
// CHECK: loom.grad_all_reduce
// CHECK: loom.gelu {{.*}} : tensor<2x32x128xf32>
// CHECK: loom.all_reduce
// CHECK-NOT: loom.all_reduce
// CHECK-NOT: loom.grad_all_reduce
// CHECK: loom.yield

// CHECK-LABEL: func.func @forward
// CHECK: loom.embedding %{{.*}}, %{{.*}} {vocab_group = "tp"}
// CHECK-NEXT: loom.all_reduce
// CHECK: loom.grad_all_reduce
// CHECK-NEXT: loom.matmul {{.*}}transpose_b{{.*}} : tensor<2x32x64xf32>, tensor<128x64xf32>
// CHECK-LABEL: func.func @loss
// CHECK: loom.cross_entropy %{{.*}}, %{{.*}} {vocab_group = "tp"} : tensor<2x32x128xf32>

// Llama: separate q, k, v projections share one grad_all_reduce; grouped
// key/value heads split with the query heads; SwiGLU's gate and up are both
// column-parallel.
// LLAMA-LABEL: loom.block @layer
// LLAMA: loom.rmsnorm
// LLAMA-NEXT: loom.grad_all_reduce
// LLAMA-NOT: loom.grad_all_reduce
// LLAMA: loom.rotary {{.*}}num_heads = 2 : i64
// LLAMA: loom.rotary {{.*}}num_heads = 1 : i64
// LLAMA: loom.attention {{.*}}num_heads = 2 : i64, num_kv_heads = 1 : i64
// LLAMA: loom.all_reduce
// LLAMA: loom.grad_all_reduce
// LLAMA: loom.silu {{.*}} : tensor<2x32x88xf32>
// LLAMA: loom.all_reduce
// LLAMA-NOT: loom.all_reduce
// LLAMA: loom.yield

// HEADS: error: has 2 heads; tp = 4 must divide them
// NORULE: error: has no tensor-parallel rule for an input split over tp
// DYNAMIC: error: specialise the batch (loom-specialize-batch) before partitioning

// For inference the split logits come back whole.
// GATHER-LABEL: func.func @forward
// GATHER: %[[L:.*]] = loom.matmul {{.*}}transpose_b
// GATHER-NEXT: %[[G:.*]] = loom.all_gather %[[L]] {axis = 2 : i64, group = "tp", parts = 2 : i64} : tensor<2x32x128xf32>
// GATHER-NEXT: return %[[G]] : tensor<2x32x256xf32>

// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 dp=2 until=loom-pipeline-schedule" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 dp=2 until=loom-pipeline-schedule" | loom-opt --loom-data-parallel | FileCheck %s --check-prefix=ONE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 dp=2 until=loom-pipeline-schedule" | sed 's/bucket_bytes = 0 /bucket_bytes = 262144 /' | loom-opt --loom-data-parallel | FileCheck %s --check-prefix=BUCKETS
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 dp=2 zero=1 until=loom-pipeline-schedule" | loom-opt --loom-data-parallel | FileCheck %s --check-prefix=ZERO
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 pp=2 mb=2 until=loom-pipeline-schedule" | loom-opt --loom-data-parallel | FileCheck %s --check-prefix=TIED
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 dp=2 until=loom-pipeline-schedule" | sed 's/bucket_bytes = 0 /bucket_bytes = 131072 /' | loom-opt --loom-data-parallel | FileCheck %s --check-prefix=GIANT

// loom-data-parallel: every gradient is averaged over the data-parallel
// replicas in buckets of about bucket_bytes, each an async all_reduce on the
// communication stream issued right after backward finishes its last
// gradient (reduce_scatter into this rank's slice with ZeRO-1); the `update`
// program opens by waiting for them and averages the loss. A parameter held
// by several stages sums its gradient over them.

// BEFORE-NOT: "all_reduce"
// BEFORE-NOT: "update"

// One bucket (25 MiB holds the whole MLP), issued at the end of backward.
// ONE-LABEL: loomrt.rank 0
// ONE: loomrt.param "in.w" = 2 "normal"(3.571430e-02) {grad = 41 : i64}
// ONE: loomrt.program "backward" {
// ONE-NOT: "all_reduce"
// ONE: loomrt.instr "matmul" [0, 38] -> [41] {transpose_a = true}
// ONE-NEXT: loomrt.instr "all_reduce" [25, 27, 30, 32, 35, 37, 40, 41] -> [25, 27, 30, 32, 35, 37, 40, 41] {async = true, event = 0 : i64, group = "dp", reduction = "mean"}
// ONE-NEXT: {{^ *}}}
// ONE: loomrt.program "update" {
// ONE-NEXT: loomrt.instr "event_wait" [] -> [] {event = 0 : i64}
// ONE-NEXT: loomrt.instr "all_reduce" [21] -> [21] {group = "dp", reduction = "mean"}
// ONE-NEXT: {{^ *}}}
// ONE-LABEL: loomrt.rank 1
// ONE: "all_reduce" [25, 27, 30, 32, 35, 37, 40, 41] {{.*}}async = true
// ONE: loomrt.program "update" {
// ONE-NEXT: loomrt.instr "event_wait"

// 256 KiB buckets, each issued as soon as its last gradient is done (a
// layer weight is 256 KiB, so the first closes at a weight gradient); the
// last two runs are split from their end into buckets of at most a
// sixteenth of a bucket (or one gradient), then an eighth, a quarter, a
// half, so that only the final gradient waits for the end of backward and
// each before it goes out as soon as it is done.
// BUCKETS-LABEL: loomrt.rank 0
// BUCKETS: loomrt.program "backward" {
// BUCKETS: loomrt.instr "matmul" [11, 28] -> [32] {transpose_a = true}
// BUCKETS-NEXT: loomrt.instr "all_reduce" [25, 27, 30, 32] -> [25, 27, 30, 32] {async = true, event = 0 : i64, group = "dp", reduction = "mean"}
// BUCKETS: loomrt.instr "reduce_sum" [33] -> [34]
// BUCKETS-NEXT: loomrt.instr "all_reduce" [35] -> [35] {async = true, event = 1 : i64, group = "dp", reduction = "mean"}
// BUCKETS: loomrt.instr "matmul" [6, 33] -> [37] {transpose_a = true}
// BUCKETS-NEXT: loomrt.instr "all_reduce" [37] -> [37] {async = true, event = 2 : i64, group = "dp", reduction = "mean"}
// BUCKETS: loomrt.instr "reduce_sum" [38] -> [39]
// BUCKETS-NEXT: loomrt.instr "all_reduce" [40] -> [40] {async = true, event = 3 : i64, group = "dp", reduction = "mean"}
// BUCKETS-NEXT: loomrt.instr "matmul" [0, 38] -> [41] {transpose_a = true}
// BUCKETS-NEXT: loomrt.instr "all_reduce" [41] -> [41] {async = true, event = 4 : i64, group = "dp", reduction = "mean"}
// BUCKETS-NEXT: {{^ *}}}
// BUCKETS: loomrt.program "update" {
// BUCKETS-NEXT: loomrt.instr "event_wait" [] -> [] {event = 4 : i64}
// BUCKETS-NEXT: loomrt.instr "all_reduce" [21] -> [21] {group = "dp", reduction = "mean"}

// ZeRO-1: each gradient is reduce-scattered into a flat slice of half its
// size (loomrt.zero_shard), not all-reduced.
// ZERO-LABEL: loomrt.rank 0
// ZERO: loomrt.buffer 42 "in.w.grad_shard" : tensor<100352xf32> "activation" at 0
// ZERO: loomrt.buffer 49 "out.b.grad_shard" : tensor<5xf32> "activation" at 0
// ZERO: loomrt.zero_shard 2 = 42
// ZERO-COUNT-6: loomrt.zero_shard
// ZERO-NEXT: loomrt.zero_shard 18 = 49
// ZERO: loomrt.program "backward" {
// ZERO-NOT: "all_reduce"
// ZERO: loomrt.instr "reduce_scatter" [25, 27, 30, 32, 35, 37, 40, 41] -> [49, 48, 47, 46, 45, 44, 43, 42] {async = true, event = 0 : i64, group = "dp", reduction = "mean"}
// ZERO-NEXT: {{^ *}}}
// ZERO: loomrt.program "update" {
// ZERO-NEXT: loomrt.instr "event_wait" [] -> [] {event = 0 : i64}
// ZERO-NEXT: loomrt.instr "all_reduce" [21] -> [21] {group = "dp", reduction = "mean"}

// GPT over two stages: the tied embedding's gradient is summed over the
// stages that hold it (a new group), and the loss is broadcast from the last
// stage; with dp = 1 there is nothing to average.
// TIED-LABEL: loomrt.rank 0
// TIED: loomrt.group "pp" = [0, 1]
// TIED-NEXT: loomrt.group "stages.0.1" = [0, 1]
// TIED: loomrt.param "wte" = 2 "normal"(2.000000e-02) {grad = [[WTE:[0-9]+]] : i64}
// TIED: loomrt.output "loss" = [[LOSS:[0-9]+]]
// TIED-NOT: "event_wait"
// TIED: loomrt.program "update" {
// TIED-NEXT: loomrt.instr "all_reduce" [[[WTE]]] -> [[[WTE]]] {group = "stages.0.1", reduction = "sum"}
// TIED-NEXT: loomrt.instr "broadcast_from" [[[LOSS]]] -> [[[LOSS]]] {group = "pp", root = 1 : i64}
// TIED-NEXT: {{^ *}}}
// TIED-LABEL: loomrt.rank 1
// TIED: loomrt.group "stages.0.1" = [0, 1]
// TIED: loomrt.program "update" {
// TIED-NEXT: loomrt.instr "all_reduce" [[[WTE]]] -> [[[WTE]]] {group = "stages.0.1", reduction = "sum"}

// The tail's levels when a gradient of half a bucket or more comes last (the
// tied embedding's, 64 KiB of a 128 KiB bucket): it goes alone and leaves
// the sixteenth's level (8 KiB) to the position embedding's gradient before
// it, then the first layer's norms at 16 KiB, its QKV weight at 32, and the
// rest of the layer at 64, each right after its last gradient. (Before,
// the embedding took the sixteenth's level and the position embedding's
// went out with the norms'.)
// GIANT-LABEL: loomrt.rank 0
// GIANT: loomrt.buffer 164 "layer.0.grad.matmul" : tensor<64x192xf32>
// GIANT: loomrt.buffer 170 "grad.reduce.view" : tensor<32x64xf32>
// GIANT: loomrt.buffer 172 "grad.sum" : tensor<256x64xf32>
// GIANT: loomrt.program "backward" {
// GIANT: "all_reduce" [140, 141, 144, 149, 159] -> [140, 141, 144, 149, 159] {async = true, event = 3
// GIANT: "all_reduce" [164] -> [164] {async = true, event = 4
// GIANT: "all_reduce" [166, 167] -> [166, 167] {async = true, event = 5
// GIANT: "all_reduce" [170] -> [170] {async = true, event = 6
// GIANT-NEXT: loomrt.instr
// GIANT: "all_reduce" [172] -> [172] {async = true, event = 7
// GIANT: loomrt.program "update" {

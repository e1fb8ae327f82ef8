// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 dp=2 zero=1 until=loom-bf16-step-casts" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 precision=bf16 dp=2 zero=1 until=loom-bf16-step-casts" | loom-opt --loom-zero-gather-copies | FileCheck %s
// RUN: loom-opt %models/gpt2-124m.mlir --loom-compile="train=true batch=2 precision=bf16 dp=2 zero=1 until=loom-zero-gather-copies" | FileCheck %s --check-prefix=BUCKETS
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 dp=2 zero=1 until=loom-bf16-step-casts" | loom-opt --loom-zero-gather-copies | FileCheck %s --check-prefix=F32
// RUN: loom-opt %models/gpt2-124m.mlir --loom-compile="train=true batch=2 precision=bf16 dp=2 zero=3 until=loom-zero-gather-copies" | FileCheck %s --check-prefix=ZERO3
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 dp=2 zero=3 until=loom-zero-gather-copies" | FileCheck %s --check-prefix=ZERO3F32

// loom-zero-gather-copies: mixed-precision ZeRO-1 keeps each rank's slice of
// the f32 masters and gathers the bf16 copies at the start of the forward,
// instead of gathering f32 masters in the update and casting them.

// Before: the update takes its slice of the master wte (buffer 2), updates
// it and gathers the f32 slices into the masters; the forward casts wte
// twice (the lookup's and the tied head's copies).
// BEFORE-LABEL: loomrt.rank 0
// BEFORE: loomrt.program "forward" {
// BEFORE: loomrt.instr "cast" [2] -> [5]
// BEFORE: loomrt.instr "cast" [2] -> [95]
// BEFORE: loomrt.program "update" {
// BEFORE: loomrt.instr "shard_of" [2] -> [261] {group = "dp"}
// BEFORE: loomrt.instr "adamw" [261, {{.*}}] -> [261,
// BEFORE: loomrt.instr "all_gather" [261, {{.*}}] -> [2, {{.*}}] {group = "dp"}

// After: the slice is the rank's master (role cache: kept, never saved).
// CHECK-LABEL: loomrt.rank 0
// CHECK: loomrt.buffer 261 "wte.master" : tensor<8192xf32> "cache"
// The forward starts with the gather of every slice into the bf16 copies
// (the head's copy is the lookup's), on the communication stream, waited
// for before the first read; no weight is cast any more.
// CHECK: loomrt.program "forward" {
// CHECK-NEXT: loomrt.instr "all_gather" [261, {{.*}}] -> [5, {{.*}}] {async = true, event = [[EV:[0-9]+]] : i64, group = "dp"}
// CHECK-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[EV]] : i64}
// CHECK-NEXT: loomrt.instr "embedding" [5, 0]
// CHECK-NOT: loomrt.instr "cast" [2]
// CHECK: loomrt.instr "matmul" [{{[0-9]+}}, 5] {{.*}}transpose_b = true
// gather_parameters puts whole masters back (before checkpoints); prepare
// takes the slices after weights are written.
// CHECK: loomrt.program "gather_parameters" {
// CHECK-NEXT: loomrt.instr "all_gather" [261, {{.*}}] -> [2, {{.*}}] {group = "dp"}
// CHECK-NEXT: }
// CHECK: loomrt.program "prepare" {
// CHECK-NEXT: loomrt.instr "shard_of" [2] -> [261] {group = "dp"}
// The update only updates the slices: no shard_of, no gather.
// CHECK: loomrt.program "update" {
// CHECK-NOT: shard_of
// CHECK-NOT: all_gather
// CHECK: loomrt.instr "adamw" [261, {{.*}}] -> [261,
// CHECK-NOT: all_gather
// CHECK: }

// GPT-2 124M: buckets of about 25 MB of bf16 copies in the order the
// forward reads them (wte alone, then two layers a bucket), each waited for
// just before its first reader.
// BUCKETS-LABEL: loomrt.rank 0
// BUCKETS: loomrt.program "forward" {
// BUCKETS-NEXT: loomrt.instr "all_gather" [{{[0-9]+}}] -> [5] {async = true, event = [[E0:[0-9]+]] : i64, group = "dp"}
// BUCKETS-NEXT: loomrt.instr "all_gather" {{.*}} {async = true, event = [[E1:[0-9]+]] : i64, group = "dp"}
// BUCKETS-COUNT-6: loomrt.instr "all_gather"
// BUCKETS-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[E0]] : i64}
// BUCKETS-NEXT: loomrt.instr "embedding" [5, 0]
// BUCKETS-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[E1]] : i64}
// BUCKETS-NEXT: loomrt.instr "add"
// BUCKETS: loomrt.instr "event_wait"
// The masters come back in buckets too (one all_gather would stage them all
// in one workspace).
// BUCKETS: loomrt.program "gather_parameters" {
// BUCKETS-NEXT: loomrt.instr "all_gather" {{.*}} {group = "dp"}
// BUCKETS-NEXT: loomrt.instr "all_gather" {{.*}} {group = "dp"}

// f32 training has no copies to gather: the pass leaves it alone.
// F32-NOT: loomrt.program "prepare"
// F32: loomrt.program "update" {
// F32: loomrt.instr "all_gather"

// ZeRO-3: the slice is the parameter (zero_parts: a chunk of the flattened
// whole, which loom-compact-ranks then drops), and both the forward and the
// backward gather the weights, each bucket issued where the bucket before
// it is waited for, so that only about two buckets of weights exist at a
// time. The backward gathers into copies of its own (".backward"), so the
// forward's die after their last forward reader, except those the forward
// reads after its last wait (the last layer, the tied head's wte), which
// the backward reads first: those it reads where the forward left them.
// ZERO3-LABEL: loomrt.rank 0
// ZERO3: loomrt.buffer [[WTE:[0-9]+]] "wte" : tensor<19298688xf32> "param"
// ZERO3-NOT: "cast.1.backward"
// ZERO3: loomrt.param "wte" = [[WTE]] "normal"(2.000000e-02) {full_shape = array<i64: 50257, 768>, grad = {{[0-9]+}} : i64, zero_parts = 2 : i64}
// ZERO3: loomrt.program "backward" {
// ZERO3-NEXT: loomrt.instr "all_gather" {{.*}} {async = true, event = [[B0:[0-9]+]] : i64, group = "dp"}
// ZERO3-NEXT: loomrt.instr "fill"
// ZERO3-NEXT: loomrt.instr "cross_entropy_grad"
// ZERO3-NEXT: loomrt.instr "matmul" [{{[0-9]+}}, 5] -> [{{[0-9]+}}]
// ZERO3: loomrt.instr "all_gather" {{.*}} {async = true, event = [[B1:[0-9]+]] : i64, group = "dp"}
// ZERO3-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[B0]] : i64}
// ZERO3: loomrt.instr "all_gather" {{.*}} {async = true, event = {{[0-9]+}} : i64, group = "dp"}
// ZERO3-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[B1]] : i64}
// ZERO3: loomrt.program "forward" {
// ZERO3-NEXT: loomrt.instr "all_gather" [[[WTE]]] -> [5] {async = true, event = [[F0:[0-9]+]] : i64, group = "dp"}
// ZERO3-NEXT: loomrt.instr "all_gather" {{.*}} {async = true, event = [[F1:[0-9]+]] : i64, group = "dp"}
// ZERO3-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[F0]] : i64}
// ZERO3-NEXT: loomrt.instr "embedding" [5, 0]
// ZERO3-NEXT: loomrt.instr "all_gather" {{.*}} {async = true, event = {{[0-9]+}} : i64, group = "dp"}
// ZERO3-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[F1]] : i64}
// ZERO3-NOT: loomrt.program "gather_parameters"
// ZERO3-NOT: loomrt.program "prepare"
// ZERO3: loomrt.program "update" {
// ZERO3-NOT: shard_of
// ZERO3-NOT: all_gather
// ZERO3: loomrt.instr "adamw" [[[WTE]], {{.*}}] -> [[[WTE]],
// ZERO3-NOT: all_gather
// ZERO3: }

// f32 ZeRO-3 gathers the f32 weights into buffers the forward and the
// backward read instead of the parameter (gpt-tiny's fit one bucket).
// ZERO3F32-LABEL: loomrt.rank 0
// ZERO3F32: loomrt.buffer [[W:[0-9]+]] "wte.gathered" : tensor<256x64xf32> "activation"
// ZERO3F32: loomrt.program "forward" {
// ZERO3F32-NEXT: loomrt.instr "all_gather" [{{[0-9, ]+}}] -> [[[W]], {{.*}}] {async = true
// ZERO3F32-NEXT: loomrt.instr "event_wait"
// ZERO3F32-NEXT: loomrt.instr "embedding" [[[W]], 0]

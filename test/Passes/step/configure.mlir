// RUN: loom-opt %s --loom-configure --split-input-file -verify-diagnostics | FileCheck %s
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=8 dp=2 mb=2 schedule=gpipe until=loom-configure" | FileCheck %s --check-prefix=PIPE
// RUN: not loom-opt %models/mlp.mlir --loom-compile="train=true batch=6 dp=4 until=loom-configure" 2>&1 | FileCheck %s --check-prefix=BADBATCH

// loom-configure writes the compile options (loom.options) and the parallel
// plan (loom.plan) on the module, after checking the plan; run alone it keeps
// what the module says and fills in the defaults.

// Through loom-compile: the pipeline's options become the attributes, and
// configure is the only stage that ran (the model is untouched, no bundle).
// PIPE: module attributes {loom.family = "mlp", loom.options = {batch = 8 : i64, {{.*}}optimizer = "adamw", {{.*}}train = true, {{.*}}}, loom.plan = {bucket_bytes = 0 : i64, dp = 2 : i64, microbatches = 2 : i64, pp = 1 : i64, {{.*}}schedule = "gpipe", {{.*}}tp = 1 : i64, vpp = 1 : i64, zero = 0 : i64}}
// PIPE: func.func @forward(%{{.*}}: tensor<?x784xf32>)
// PIPE-NOT: loomrt.bundle

// BADBATCH: error: the batch (6) must divide evenly over 4 data-parallel ranks x 1 microbatches

// No attributes: the defaults (batch 1, inference, f32, one rank).
// CHECK-LABEL: module attributes
// CHECK-SAME: loom.options = {batch = 1 : i64, {{.*}}bf16 = false, {{.*}}fuse = false, {{.*}}optimizer = "adamw", seed = 0 : i64, {{.*}}train = false
// CHECK-SAME: loom.plan = {bucket_bytes = 0 : i64, dp = 1 : i64, microbatches = 1 : i64, pp = 1 : i64, recompute = array<i64>, record = {}, schedule = "1f1b", stages = array<i64>, tp = 1 : i64, vpp = 1 : i64, zero = 0 : i64}
module {
}

// -----

// A partial plan keeps what it gives and completes the rest.
// CHECK-LABEL: module attributes
// CHECK-SAME: loom.options = {batch = 8 : i64, {{.*}}train = true
// CHECK-SAME: loom.plan = {bucket_bytes = 0 : i64, dp = 2 : i64, microbatches = 2 : i64, pp = 1 : i64, {{.*}}zero = 1 : i64}
module attributes {loom.options = {batch = 8 : i64, train = true}, loom.plan = {dp = 2 : i64, microbatches = 2 : i64, zero = 1 : i64}} {
}

// -----

// expected-error @below {{the batch (6) must divide evenly over 4 data-parallel ranks x 1 microbatches}}
module attributes {loom.options = {batch = 6 : i64, train = true}, loom.plan = {dp = 4 : i64}} {
}

// -----

// expected-error @below {{inference bundles split over tensor parallelism only (tp)}}
module attributes {loom.options = {batch = 4 : i64}, loom.plan = {dp = 2 : i64}} {
}

// -----

// expected-error @below {{parallel degrees and the microbatch count must be at least 1}}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {microbatches = 0 : i64}} {
}

// -----

// expected-error @below {{unknown schedule 'zigzag'; use gpipe, 1f1b, interleaved or zb-h1}}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {pp = 2 : i64, schedule = "zigzag"}} {
}

// -----

// vpp > 1 only with the interleaved schedule.
// expected-error @below {{interleaved 1F1B needs pp > 1 and vpp > 1 (and vpp > 1 needs the interleaved schedule); got pp = 2, vpp = 2, schedule 1f1b}}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {pp = 2 : i64, vpp = 2 : i64}} {
}

// -----

// expected-error @below {{interleaved 1F1B needs the microbatch count (3) to be a multiple of pp (2)}}
module attributes {loom.options = {batch = 6 : i64, train = true}, loom.plan = {pp = 2 : i64, vpp = 2 : i64, microbatches = 3 : i64, schedule = "interleaved"}} {
}

// -----

// expected-error @below {{ZeRO-1 partitions optimizer state over data-parallel ranks: it needs dp >= 2 and an optimizer}}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {zero = 1 : i64}} {
}

// -----

// expected-error @below {{'loom.plan' must be a dictionary on the module}}
module attributes {loom.plan = 2 : i64} {
}

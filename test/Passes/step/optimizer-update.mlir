// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 dp=2 until=loom-data-parallel" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 dp=2 until=loom-data-parallel" | loom-opt --loom-optimizer-update | FileCheck %s --check-prefix=ADAMW
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 optimizer=sgd until=loom-data-parallel" | loom-opt --loom-optimizer-update | FileCheck %s --check-prefix=SGD
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 dp=2 zero=1 until=loom-data-parallel" | loom-opt --loom-optimizer-update | FileCheck %s --check-prefix=ZERO
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 optimizer=none until=loom-data-parallel" | loom-opt --loom-optimizer-update | FileCheck %s --check-prefix=NONE

// loom-optimizer-update appends to `update` the step counter, the global
// gradient norm (for clipping) and one in-place optimizer instruction per
// parameter with its state (loomrt.state); weight decay applies to matrices,
// not to biases.

// BEFORE: loomrt.param_grad 2 chunk 0 = 41
// BEFORE: loomrt.program "update" {
// BEFORE-NEXT: loomrt.instr "event_wait"
// BEFORE-NEXT: loomrt.instr "all_reduce" [21] -> [21]
// BEFORE-NEXT: {{^ *}}}
// BEFORE-NOT: loomrt.state

// ADAMW-LABEL: loomrt.rank 0
// ADAMW: loomrt.buffer 42 "step" : tensor<f32> "state" at 0
// ADAMW-NEXT: loomrt.buffer 43 "grad_norm" : tensor<f32> "activation" at 0
// ADAMW-NEXT: loomrt.buffer 44 "in.w.adam_m" : tensor<784x256xf32> "state" at 0
// ADAMW-NEXT: loomrt.buffer 45 "in.w.adam_v" : tensor<784x256xf32> "state" at 0
// ADAMW: loomrt.buffer 59 "out.b.adam_v" : tensor<10xf32> "state" at 0
// ADAMW: loomrt.state "step" = 42
// ADAMW-NEXT: loomrt.state "in.w.adam_m" = 44
// ADAMW-NEXT: loomrt.state "in.w.adam_v" = 45
// ADAMW-COUNT-14: loomrt.state
// The optimizer is the last reader of the gradients' notes: they are gone.
// ADAMW-NOT: loomrt.param_grad
// ADAMW: loomrt.program "update" {
// ADAMW-NEXT: loomrt.instr "event_wait" [] -> [] {event = 0 : i64}
// ADAMW-NEXT: loomrt.instr "all_reduce" [21] -> [21] {group = "dp", reduction = "mean"}
// ADAMW-NEXT: loomrt.instr "step_increment" [42] -> [42]
// ADAMW-NEXT: loomrt.instr "global_norm" [41, 40, 37, 35, 32, 30, 27, 25] -> [43]{{$}}
// param, grad, m, v, step, norm -> param, m, v
// ADAMW-NEXT: loomrt.instr "adamw" [2, 41, 44, 45, 42, 43] -> [2, 44, 45] {beta1 = 9.000000e-01 : f64, beta2 = 0.94999999999999996 : f64, clip = 1.000000e+00 : f64, eps = 1.000000e-08 : f64, lr = 3.000000e-04 : f64, {{.*}}weight_decay = 1.000000e-01 : f64}
// ADAMW-NEXT: loomrt.instr "adamw" [3, 40, 46, 47, 42, 43] -> [3, 46, 47] {{{.*}}weight_decay = 0.000000e+00 : f64}
// ADAMW-COUNT-6: loomrt.instr "adamw"
// ADAMW-NEXT: {{^ *}}}
// ADAMW-LABEL: loomrt.rank 1
// ADAMW: loomrt.instr "step_increment" [42] -> [42]
// ADAMW-COUNT-8: loomrt.instr "adamw"

// SGD keeps one momentum buffer per parameter.
// SGD: loomrt.buffer 44 "in.w.momentum" : tensor<784x256xf32> "state" at 0
// SGD: loomrt.program "update" {
// SGD-NEXT: loomrt.instr "step_increment" [42] -> [42]
// SGD-NEXT: loomrt.instr "global_norm" [41, 40, 37, 35, 32, 30, 27, 25] -> [43]
// SGD-NEXT: loomrt.instr "sgd" [2, 41, 44, 42, 43] -> [2, 44] {{{.*}}momentum = 9.000000e-01 : f64
// SGD-COUNT-7: loomrt.instr "sgd"
// SGD-NEXT: {{^ *}}}
// SGD-NOT: "adamw"

// ZeRO-1: the norm is over every rank's gradient slices (group "all"); each
// rank takes its slice of a parameter (shard_of), updates it with state of
// the slice's size, and the slices are all-gathered into the parameters.
// ZERO-LABEL: loomrt.rank 0
// ZERO: loomrt.buffer 52 "in.w.shard" : tensor<100352xf32> "activation" at 0
// ZERO-NEXT: loomrt.buffer 53 "in.w.adam_m" : tensor<100352xf32> "state" at 0
// The slices have been consumed: no zero_shard notes are left.
// ZERO-NOT: loomrt.zero_shard
// ZERO: loomrt.program "update" {
// ZERO-NEXT: loomrt.instr "event_wait"
// ZERO-NEXT: loomrt.instr "all_reduce" [21] -> [21]
// ZERO-NEXT: loomrt.instr "step_increment" [50] -> [50]
// ZERO-NEXT: loomrt.instr "global_norm" [42, 43, 44, 45, 46, 47, 48, 49] -> [51] {group = "all"}
// The slices are taken first, together, so the updates are one run.
// ZERO-NEXT: loomrt.instr "shard_of" [2] -> [52] {group = "dp"}
// ZERO-COUNT-7: loomrt.instr "shard_of" {{.*}}{group = "dp"}{{$}}
// ZERO-NEXT: loomrt.instr "adamw" [52, 42, 53, 54, 50, 51] -> [52, 53, 54]
// ZERO-COUNT-7: loomrt.instr "adamw" {{.*}}{{$}}
// ZERO-NEXT: loomrt.instr "all_gather" [52, 55, 58, 61, 64, 67, 70, 73] -> [2, 3, 7, 8, 12, 13, 17, 18] {group = "dp"}
// ZERO-NEXT: {{^ *}}}

// No optimizer: gradients only, no update program, no state.
// NONE-NOT: loomrt.state
// NONE-NOT: "update"
// NONE-NOT: "step_increment"
// NONE: loomrt.program "backward"
// NONE-NOT: "update"

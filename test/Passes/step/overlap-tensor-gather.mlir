// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 tp=2 sp=true until=loom-overlap-tensor-reduce" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 tp=2 sp=true until=loom-overlap-tensor-reduce" | loom-opt --loom-overlap-tensor-gather | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 dp=2 tp=2 sp=true until=loom-overlap-tensor-reduce" | loom-opt --loom-overlap-tensor-gather | FileCheck %s --check-prefix=DP

// loom-overlap-tensor-gather: under sequence parallelism a layer's product
// of the rank's own tokens runs while the all-gather of the other ranks'
// tokens is on the wire.

// Before: the gather of the layer norm's tokens, then the product reads it.
// BEFORE: loomrt.rank 0
// BEFORE: loomrt.program "forward" {
// BEFORE: loomrt.instr "layernorm" [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}] -> [[[S:[0-9]+]]]
// BEFORE-NEXT: loomrt.instr "all_gather" [[[S]]] -> [[[G:[0-9]+]]] {axis = 0 : i64, group = "tp", parts = 2 : i64}
// BEFORE-NEXT: loomrt.instr "matmul" [[[G]], [[W:[0-9]+]]] -> [[[Y:[0-9]+]]]

// After, rank 0: the gather on the communication stream; the product of
// rank 0's rows (the first half) reads its own part, a view of the layer
// norm's result, and writes the first half of the result; the second half
// waits for the gather and reads its second half.
// CHECK: loomrt.rank 0
// CHECK-DAG: loomrt.buffer [[OWN:[0-9]+]] "layer.0.layernorm.3.view" : tensor<2x32x64xf32> "activation" at 0 {view_of = [[S:[0-9]+]] : i64}
// CHECK-DAG: loomrt.buffer [[Y0:[0-9]+]] "layer.0.matmul.5.rows" : tensor<2x32x96xf32> "activation" at 0 {view_of = [[Y:[0-9]+]] : i64}
// CHECK-DAG: loomrt.buffer [[G1:[0-9]+]] "layer.0.all_gather.4.rows" : tensor<2x32x64xf32> "activation" at 0 {view_of = [[G:[0-9]+]] : i64, view_offset = 16384 : i64}
// CHECK-DAG: loomrt.buffer [[Y1:[0-9]+]] "layer.0.matmul.5.rows" : tensor<2x32x96xf32> "activation" at 0 {view_of = [[Y]] : i64, view_offset = 24576 : i64}
// CHECK: loomrt.program "forward" {
// CHECK: loomrt.instr "all_gather" [[[S]]] -> [[[G]]] {async = true, axis = 0 : i64, event = [[E:[0-9]+]] : i64, group = "tp", parts = 2 : i64}
// CHECK-NEXT: loomrt.instr "matmul" [[[OWN]], [[W:[0-9]+]]] -> [[[Y0]]]
// CHECK-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[E]] : i64}
// CHECK-NEXT: loomrt.instr "matmul" [[[G1]], [[W]]] -> [[[Y1]]]

// Rank 1 runs the second half first, from its own part, then the first.
// CHECK: loomrt.rank 1
// CHECK-DAG: loomrt.buffer [[OWN:[0-9]+]] "layer.0.layernorm.3.view" : tensor<2x32x64xf32> "activation" at 0 {view_of = [[S:[0-9]+]] : i64}
// CHECK-DAG: loomrt.buffer [[Y1:[0-9]+]] "layer.0.matmul.5.rows" : tensor<2x32x96xf32> "activation" at 0 {view_of = [[Y:[0-9]+]] : i64, view_offset = 24576 : i64}
// CHECK-DAG: loomrt.buffer [[G0:[0-9]+]] "layer.0.all_gather.4.rows" : tensor<2x32x64xf32> "activation" at 0 {view_of = [[G:[0-9]+]] : i64}
// CHECK-DAG: loomrt.buffer [[Y0:[0-9]+]] "layer.0.matmul.5.rows" : tensor<2x32x96xf32> "activation" at 0 {view_of = [[Y]] : i64}
// CHECK: loomrt.program "forward" {
// CHECK: loomrt.instr "all_gather" [[[S]]] -> [[[G]]] {async = true, axis = 0 : i64, event = [[E:[0-9]+]] : i64, group = "tp", parts = 2 : i64}
// CHECK-NEXT: loomrt.instr "matmul" [[[OWN]], [[W:[0-9]+]]] -> [[[Y1]]]
// CHECK-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[E]] : i64}
// CHECK-NEXT: loomrt.instr "matmul" [[[G0]], [[W]]] -> [[[Y0]]]

// With data-parallel buckets on the communication stream the gathers would
// queue behind them: nothing changes.
// DP: loomrt.program "backward" {
// DP-NOT: "all_gather" {{.*}}async = true
// DP: loomrt.program "forward" {
// DP-NOT: "all_gather" {{.*}}async = true
// DP: loomrt.program "update"

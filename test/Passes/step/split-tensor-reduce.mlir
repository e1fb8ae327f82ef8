// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 tp=2 until=loom-overlap-tensor-reduce" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=4 tp=2 until=loom-overlap-tensor-reduce" | loom-opt --loom-split-tensor-reduce | FileCheck %s
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=8 dp=2 tp=2 until=loom-overlap-tensor-reduce" | loom-opt --loom-split-tensor-reduce | FileCheck %s --check-prefix=DP

// loom-split-tensor-reduce: a row-parallel product and its all-reduce over
// the tensor-parallel group in two halves of the rows, the first half's sum
// beside the second half's product.

// Before: the attention's output projection, then the sum of its partial
// products, which the residual's add reads at once.
// BEFORE: loomrt.rank 0
// BEFORE: loomrt.program "forward" {
// BEFORE: loomrt.instr "attention" [{{.*}}] -> [[[X:[0-9]+]]]
// BEFORE-NEXT: loomrt.instr "matmul" [[[X]], [[W:[0-9]+]]] -> [[[Y:[0-9]+]]]
// BEFORE-NEXT: loomrt.instr "all_reduce" [[[Y]]] -> [[[S:[0-9]+]]] {group = "tp", reduction = "sum"}

// After: each half of the rows (slice views, the second 16384 bytes in),
// its product then its sum on the communication stream; the add waits for both.
// CHECK: loomrt.rank 0
// CHECK-DAG: loomrt.buffer [[X0:[0-9]+]] "layer.0.attention.10.rows" : tensor<2x32x32xf32> "activation" at 0 {view_of = [[X:[0-9]+]] : i64}
// CHECK-DAG: loomrt.buffer [[Y0:[0-9]+]] "layer.0.matmul.11.rows" : tensor<2x32x64xf32> "activation" at 0 {view_of = [[Y:[0-9]+]] : i64}
// CHECK-DAG: loomrt.buffer [[S0:[0-9]+]] "layer.0.all_reduce.12.rows" : tensor<2x32x64xf32> "activation" at 0 {view_of = [[S:[0-9]+]] : i64}
// CHECK-DAG: loomrt.buffer [[X1:[0-9]+]] "layer.0.attention.10.rows" : tensor<2x32x32xf32> "activation" at 0 {view_of = [[X]] : i64, view_offset = 8192 : i64}
// CHECK-DAG: loomrt.buffer [[Y1:[0-9]+]] "layer.0.matmul.11.rows" : tensor<2x32x64xf32> "activation" at 0 {view_of = [[Y]] : i64, view_offset = 16384 : i64}
// CHECK-DAG: loomrt.buffer [[S1:[0-9]+]] "layer.0.all_reduce.12.rows" : tensor<2x32x64xf32> "activation" at 0 {view_of = [[S]] : i64, view_offset = 16384 : i64}
// CHECK: loomrt.program "forward" {
// CHECK: loomrt.instr "matmul" [[[X0]], [[W:[0-9]+]]] -> [[[Y0]]]
// CHECK-NEXT: loomrt.instr "all_reduce" [[[Y0]]] -> [[[S0]]] {async = true, event = [[E0:[0-9]+]] : i64, group = "tp", reduction = "sum"}
// CHECK-NEXT: loomrt.instr "matmul" [[[X1]], [[W]]] -> [[[Y1]]]
// CHECK-NEXT: loomrt.instr "all_reduce" [[[Y1]]] -> [[[S1]]] {async = true, event = [[E1:[0-9]+]] : i64, group = "tp", reduction = "sum"}
// CHECK-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[E0]] : i64}
// CHECK-NEXT: loomrt.instr "event_wait" [] -> [] {event = [[E1]] : i64}
// CHECK-NEXT: loomrt.instr "add" [[[S]], {{[0-9]+}}] -> [{{[0-9]+}}]

// With data-parallel buckets on the communication stream the sums would
// queue behind them: nothing changes.
// DP: loomrt.program "forward" {
// DP-NOT: "all_reduce" {{.*}}async = true
// DP: loomrt.program "update"

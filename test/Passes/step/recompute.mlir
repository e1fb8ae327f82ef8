// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-autodiff" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-autodiff" | sed 's/recompute = array<i64>/recompute = \["layer.1"\]/' | loom-opt --loom-recompute | FileCheck %s
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-autodiff" | loom-opt --loom-recompute | FileCheck %s --check-prefix=NONE
// RUN: loom-opt %models/gpt-tiny.mlir --loom-compile="train=true batch=2 until=loom-autodiff" | sed 's/recompute = array<i64>/recompute = \["all"\]/' | loom-opt --loom-recompute | FileCheck %s --check-prefix=VIEWS
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-autodiff" | sed 's/recompute = array<i64>/recompute = \["layer.7"\]/' | not loom-opt --loom-recompute 2>&1 | FileCheck %s --check-prefix=UNKNOWN

// loom-recompute: the forward instructions of each layer the plan
// recomputes run again, into new buffers, right before the layer's first
// gradient instruction, and backward reads the copies from there on; the
// layer notes autodiff left are dropped.

// Before: autodiff noted each instruction's layer; layer.1's gradient reads
// its forward activations 15 and 16.
// BEFORE: loomrt.program "backward" {
// BEFORE: loomrt.instr "matmul" [16, 23] -> [27] {transpose_a = true}
// BEFORE-NEXT: loomrt.instr "unary_grad" [15, 16, 26] -> [28] {fn = "relu", loom.layer = "layer.1."}

// After: layer.1's matmul, add and relu run again into 42, 43 and 44 before
// its first gradient, which reads those; the head's weight gradient before
// them still reads the forward pass's 16.
// CHECK: loomrt.buffer 42 "layer.1.matmul.6.recomputed" : tensor<4x256xf32>
// CHECK-NEXT: loomrt.buffer 43 "layer.1.add.7.recomputed"
// CHECK-NEXT: loomrt.buffer 44 "layer.1.relu.8.recomputed"
// CHECK: loomrt.program "backward" {
// CHECK: loomrt.instr "matmul" [16, 23] -> [27] {transpose_a = true}
// CHECK-NEXT: loomrt.instr "matmul" [11, 12] -> [42]{{$}}
// CHECK-NEXT: loomrt.instr "add" [42, 13] -> [43]{{$}}
// CHECK-NEXT: loomrt.instr "relu" [43] -> [44]{{$}}
// CHECK-NEXT: loomrt.instr "unary_grad" [43, 44, 26] -> [28] {fn = "relu"}
// CHECK-NOT: loomrt.instr "relu"
// CHECK-NOT: loom.layer
// CHECK: loomrt.program "forward"
// CHECK-NOT: loom.layer

// Without recomputation only the notes go.
// NONE-NOT: recomputed
// NONE-NOT: loom.layer

// Recomputing every layer of GPT: views of recomputed activations (the
// flattened inputs of the weight gradients) become views of the copies.
// VIEWS: loomrt.buffer [[COPY:[0-9]+]] "layer.1.gelu.{{[0-9]+}}.recomputed"
// VIEWS: loomrt.buffer {{[0-9]+}} "layer.1.gelu.{{[0-9]+}}.view.recomputed" : tensor<64x256xf32> "activation" at 0 {view_of = [[COPY]] : i64}
// VIEWS: loomrt.program "backward"
// VIEWS-COUNT-2: loomrt.instr "attention" {{.*}}causal = true
// VIEWS-NOT: loomrt.instr "attention"
// VIEWS: loomrt.program "forward"

// UNKNOWN: error: --recompute names 'layer.7', which is no layer of this model; use 'all', 'layer' or one of its applications 'layer.0' to 'layer.1'

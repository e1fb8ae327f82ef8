// RUN: loom-opt %s --split-input-file --loom-distribute-ranks -verify-diagnostics | FileCheck %s
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 dp=2 until=loom-autodiff" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 dp=2 until=loom-autodiff" | loom-opt --loom-distribute-ranks | FileCheck %s --check-prefix=MLP

// loom-distribute-ranks copies the one lowered rank to every rank of the
// dp x tp x pp grid (tp fastest, then dp, then pp), with its coordinates,
// its communication groups and its shard of each split parameter.

// BEFORE: loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64}
// BEFORE-NOT: loomrt.group
// BEFORE-NOT: loomrt.rank 1
// MLP: loomrt.rank 0 "cpu" attributes {{{.*}}coords = {dp = 0 : i64, pp = 0 : i64, tp = 0 : i64}
// MLP-NEXT: loomrt.group "all" = [0, 1]
// MLP-NEXT: loomrt.group "dp" = [0, 1]
// MLP: loomrt.program "backward"
// MLP: loomrt.rank 1 "cpu" attributes {{{.*}}coords = {dp = 1 : i64, pp = 0 : i64, tp = 0 : i64}
// MLP: loomrt.program "backward"
// MLP-NOT: loomrt.rank 2

// dp = 2, tp = 2: ranks 0 and 1 form the first tensor-parallel pair; the
// split parameter gets shard_index 1 on the odd ranks.
// CHECK-LABEL: loomrt.bundle "model" "train"
// CHECK-NEXT: loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {dp = 0 : i64, pp = 0 : i64, tp = 0 : i64}, peak_bytes = 0 : i64}
// CHECK-NEXT: loomrt.group "all" = [0, 1, 2, 3]
// CHECK-NEXT: loomrt.group "dp" = [0, 2]
// CHECK-NEXT: loomrt.group "mp" = [0, 1]
// CHECK-NEXT: loomrt.group "pp" = [0]
// CHECK-NEXT: loomrt.group "tp" = [0, 1]
// CHECK: loomrt.param "w" = 1 "normal"(1.000000e-01) {full_shape = array<i64: 8, 8>, shard_axis = 1 : i64, shard_parts = 2 : i64}
// CHECK: loomrt.instr "add" [3, 2] -> [4]
// CHECK: loomrt.rank 1 "cpu" attributes {{{.*}}coords = {dp = 0 : i64, pp = 0 : i64, tp = 1 : i64}
// CHECK-NEXT: loomrt.group "all" = [0, 1, 2, 3]
// CHECK-NEXT: loomrt.group "dp" = [1, 3]
// CHECK-NEXT: loomrt.group "mp" = [0, 1]
// CHECK-NEXT: loomrt.group "pp" = [1]
// CHECK-NEXT: loomrt.group "tp" = [0, 1]
// CHECK: loomrt.param "w" = 1 "normal"(1.000000e-01) {full_shape = array<i64: 8, 8>, shard_axis = 1 : i64, shard_index = 1 : i64, shard_parts = 2 : i64}
// CHECK: loomrt.instr "add" [3, 2] -> [4]
// CHECK: loomrt.rank 2 "cpu" attributes {{{.*}}coords = {dp = 1 : i64, pp = 0 : i64, tp = 0 : i64}
// CHECK-NEXT: loomrt.group "all" = [0, 1, 2, 3]
// CHECK-NEXT: loomrt.group "dp" = [0, 2]
// CHECK-NEXT: loomrt.group "mp" = [2, 3]
// CHECK-NEXT: loomrt.group "pp" = [2]
// CHECK-NEXT: loomrt.group "tp" = [2, 3]
// CHECK: loomrt.param "w" = 1 "normal"(1.000000e-01) {full_shape = array<i64: 8, 8>, shard_axis = 1 : i64, shard_parts = 2 : i64}
// CHECK: loomrt.rank 3 "cpu" attributes {{{.*}}coords = {dp = 1 : i64, pp = 0 : i64, tp = 1 : i64}
// CHECK-NEXT: loomrt.group "all" = [0, 1, 2, 3]
// CHECK-NEXT: loomrt.group "dp" = [1, 3]
// CHECK-NEXT: loomrt.group "mp" = [2, 3]
// CHECK-NEXT: loomrt.group "pp" = [3]
// CHECK-NEXT: loomrt.group "tp" = [2, 3]
// CHECK: loomrt.param "w" = 1 "normal"(1.000000e-01) {full_shape = array<i64: 8, 8>, shard_axis = 1 : i64, shard_index = 1 : i64, shard_parts = 2 : i64}
// CHECK-NOT: loomrt.rank 4
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {dp = 2 : i64, tp = 2 : i64}} {
  loomrt.bundle "model" "train" batch 2 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<2x8xf32> "input" at 0
      loomrt.buffer 1 "w" : tensor<8x4xf32> "param" at 0
      loomrt.buffer 2 "b" : tensor<4xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 4 "y" : tensor<2x4xf32> "output" at 0
      loomrt.param "w" = 1 "normal"(1.0e-01) {shard_axis = 1 : i64, shard_parts = 2 : i64, full_shape = array<i64: 8, 8>}
      loomrt.param "b" = 2 "zeros"(0.0)
      loomrt.input "x" = 0
      loomrt.output "y" = 4
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 1] -> [3]
        loomrt.instr "add" [3, 2] -> [4]
      }
    }
  }
}

// -----

// dp = 2, pp = 2: dp is faster than pp; the model-parallel group is the
// pipeline.
// CHECK-LABEL: loomrt.bundle "model" "train"
// CHECK-NEXT: loomrt.rank 0 "cpu" attributes {{{.*}}coords = {dp = 0 : i64, pp = 0 : i64, tp = 0 : i64}
// CHECK-NEXT: loomrt.group "all" = [0, 1, 2, 3]
// CHECK-NEXT: loomrt.group "dp" = [0, 1]
// CHECK-NEXT: loomrt.group "mp" = [0, 2]
// CHECK-NEXT: loomrt.group "pp" = [0, 2]
// CHECK-NEXT: loomrt.group "tp" = [0]
// CHECK: loomrt.rank 1 "cpu" attributes {{{.*}}coords = {dp = 1 : i64, pp = 0 : i64, tp = 0 : i64}
// CHECK: loomrt.rank 2 "cpu" attributes {{{.*}}coords = {dp = 0 : i64, pp = 1 : i64, tp = 0 : i64}
// CHECK-NEXT: loomrt.group "all" = [0, 1, 2, 3]
// CHECK-NEXT: loomrt.group "dp" = [2, 3]
// CHECK-NEXT: loomrt.group "mp" = [0, 2]
// CHECK-NEXT: loomrt.group "pp" = [0, 2]
// CHECK: loomrt.rank 3 "cpu" attributes {{{.*}}coords = {dp = 1 : i64, pp = 1 : i64, tp = 0 : i64}
// CHECK-NOT: loomrt.rank 4
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {dp = 2 : i64, pp = 2 : i64, microbatches = 2 : i64}} {
  loomrt.bundle "model" "train" batch 2 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<2x8xf32> "input" at 0
      loomrt.buffer 1 "w" : tensor<8x4xf32> "param" at 0
      loomrt.buffer 2 "b" : tensor<4xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 4 "y" : tensor<2x4xf32> "output" at 0
      loomrt.param "w" = 1 "normal"(1.0e-01)
      loomrt.param "b" = 2 "zeros"(0.0)
      loomrt.input "x" = 0
      loomrt.output "y" = 4
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 1] -> [3]
        loomrt.instr "add" [3, 2] -> [4]
      }
    }
  }
}

// -----

// Inference splits over tp only.
// CHECK-LABEL: loomrt.bundle "model" "infer"
// CHECK-NEXT: loomrt.rank 0 "cpu" attributes {{{.*}}coords = {dp = 0 : i64, pp = 0 : i64, tp = 0 : i64}
// CHECK: loomrt.group "tp" = [0, 1]
// CHECK: loomrt.rank 1 "cpu" attributes {{{.*}}coords = {dp = 0 : i64, pp = 0 : i64, tp = 1 : i64}
// CHECK-NOT: loomrt.rank 2
module attributes {loom.options = {batch = 2 : i64}, loom.plan = {tp = 2 : i64}} {
  loomrt.bundle "model" "infer" batch 2 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<2x8xf32> "input" at 0
      loomrt.buffer 1 "w" : tensor<8x4xf32> "param" at 0
      loomrt.buffer 2 "b" : tensor<4xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 4 "y" : tensor<2x4xf32> "output" at 0
      loomrt.param "w" = 1 "normal"(1.0e-01) {shard_axis = 1 : i64, shard_parts = 2 : i64, full_shape = array<i64: 8, 8>}
      loomrt.param "b" = 2 "zeros"(0.0)
      loomrt.input "x" = 0
      loomrt.output "y" = 4
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 1] -> [3]
        loomrt.instr "add" [3, 2] -> [4]
      }
    }
  }
}

// -----

// expected-error @+1 {{loom-distribute-ranks copies one lowered rank; the step has 2}}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {dp = 2 : i64, tp = 2 : i64}} {
  loomrt.bundle "model" "train" batch 2 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<2x8xf32> "input" at 0
      loomrt.buffer 1 "w" : tensor<8x4xf32> "param" at 0
      loomrt.buffer 2 "b" : tensor<4xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<2x4xf32> "activation" at 0
      loomrt.buffer 4 "y" : tensor<2x4xf32> "output" at 0
      loomrt.param "w" = 1 "normal"(1.0e-01) {shard_axis = 1 : i64, shard_parts = 2 : i64, full_shape = array<i64: 8, 8>}
      loomrt.param "b" = 2 "zeros"(0.0)
      loomrt.input "x" = 0
      loomrt.output "y" = 4
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 1] -> [3]
        loomrt.instr "add" [3, 2] -> [4]
      }
    }
    loomrt.rank 1 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    }
  }
}

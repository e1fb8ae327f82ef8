// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 pp=2 vpp=2 mb=2 schedule=interleaved until=loom-lower-to-step" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 pp=2 vpp=2 mb=2 schedule=interleaved until=loom-lower-to-step" | loom-opt --loom-pipeline-split | FileCheck %s --check-prefix=MLP
// RUN: loom-opt %s --split-input-file --loom-pipeline-split -verify-diagnostics | FileCheck %s

// loom-pipeline-split notes each forward record with its pipeline chunk
// (loom.chunk). Units are what precedes the first layer, each layer, and what
// follows the last; they go to pp x vpp chunks, evenly unless the plan's
// `stages` says otherwise.

// mlp.mlir has four units (input layer, layer.0, layer.1, head + loss); with
// pp = 2, vpp = 2 each of the four chunks gets one.
// BEFORE: loomrt.program "forward"
// BEFORE-NOT: loom.chunk
// MLP: loomrt.program "forward"
// MLP-COUNT-3: loomrt.instr {{.*}}loom.chunk = 0 : i64, loom.source
// MLP-COUNT-3: loomrt.instr {{.*}}loom.chunk = 1 : i64, loom.layer = "layer.0."
// MLP-COUNT-3: loomrt.instr {{.*}}loom.chunk = 2 : i64, loom.layer = "layer.1."
// MLP-NEXT: loomrt.instr "matmul" {{.*}}loom.chunk = 3 : i64, loom.source
// MLP-NEXT: loomrt.instr "add" {{.*}}loom.chunk = 3 : i64, loom.source
// MLP-NEXT: loomrt.instr "cross_entropy" {{.*}}loom.chunk = 3 : i64, loom.source
// MLP-NEXT: {{^ *}}}

// The plan's stages put one unit in chunk 0 and three in chunk 1.
// CHECK-LABEL: loomrt.program "forward"
// CHECK-NEXT: loomrt.instr "matmul" [0, 2] -> [3] {loom.chunk = 0 : i64}
// CHECK-NEXT: loomrt.instr "matmul" [3, 4] -> [5] {loom.chunk = 1 : i64, loom.layer = "layer.0."}
// CHECK-NEXT: loomrt.instr "matmul" [5, 6] -> [7] {loom.chunk = 1 : i64, loom.layer = "layer.1."}
// CHECK-NEXT: loomrt.instr "cross_entropy" [7, 1] -> [8] {loom.chunk = 1 : i64}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {pp = 2 : i64, microbatches = 2 : i64, stages = array<i64: 1, 3>}} {
  loomrt.bundle "model" "train" batch 4 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<4x8xf32> "input" at 0
      loomrt.buffer 1 "labels" : tensor<4xi32> "input" at 0
      loomrt.buffer 2 "in.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 4 "layer.0.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 5 "layer.0.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 6 "layer.1.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 7 "layer.1.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 8 "loss" : tensor<f32> "output" at 0
      loomrt.param "in.w" = 2 "normal"(1.0e-01)
      loomrt.param "layer.0.w" = 4 "normal"(1.0e-01)
      loomrt.param "layer.1.w" = 6 "normal"(1.0e-01)
      loomrt.input "x" = 0
      loomrt.input "labels" = 1 {limit = 8 : i64}
      loomrt.output "loss" = 8
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 2] -> [3]
        loomrt.instr "matmul" [3, 4] -> [5] {loom.layer = "layer.0."}
        loomrt.instr "matmul" [5, 6] -> [7] {loom.layer = "layer.1."}
        loomrt.instr "cross_entropy" [7, 1] -> [8]
      }
    }
  }
}

// -----

// Even split of the four units over pp = 2.
// CHECK-LABEL: loomrt.program "forward"
// CHECK-NEXT: loomrt.instr "matmul" [0, 2] -> [3] {loom.chunk = 0 : i64}
// CHECK-NEXT: loomrt.instr "matmul" [3, 4] -> [5] {loom.chunk = 0 : i64, loom.layer = "layer.0."}
// CHECK-NEXT: loomrt.instr "matmul" [5, 6] -> [7] {loom.chunk = 1 : i64, loom.layer = "layer.1."}
// CHECK-NEXT: loomrt.instr "cross_entropy" [7, 1] -> [8] {loom.chunk = 1 : i64}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {pp = 2 : i64, microbatches = 2 : i64}} {
  loomrt.bundle "model" "train" batch 4 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<4x8xf32> "input" at 0
      loomrt.buffer 1 "labels" : tensor<4xi32> "input" at 0
      loomrt.buffer 2 "in.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 4 "layer.0.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 5 "layer.0.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 6 "layer.1.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 7 "layer.1.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 8 "loss" : tensor<f32> "output" at 0
      loomrt.param "in.w" = 2 "normal"(1.0e-01)
      loomrt.param "layer.0.w" = 4 "normal"(1.0e-01)
      loomrt.param "layer.1.w" = 6 "normal"(1.0e-01)
      loomrt.input "x" = 0
      loomrt.input "labels" = 1 {limit = 8 : i64}
      loomrt.output "loss" = 8
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 2] -> [3]
        loomrt.instr "matmul" [3, 4] -> [5] {loom.layer = "layer.0."}
        loomrt.instr "matmul" [5, 6] -> [7] {loom.layer = "layer.1."}
        loomrt.instr "cross_entropy" [7, 1] -> [8]
      }
    }
  }
}

// -----

// Microbatches without stages: one chunk holds everything.
// CHECK-LABEL: loomrt.program "forward"
// CHECK-COUNT-2: loomrt.instr "matmul" {{.*}}{loom.chunk = 0 : i64
// CHECK-NEXT: loomrt.instr "matmul" [5, 6] -> [7] {loom.chunk = 0 : i64, loom.layer = "layer.1."}
// CHECK-NEXT: loomrt.instr "cross_entropy" [7, 1] -> [8] {loom.chunk = 0 : i64}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {microbatches = 2 : i64}} {
  loomrt.bundle "model" "train" batch 4 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<4x8xf32> "input" at 0
      loomrt.buffer 1 "labels" : tensor<4xi32> "input" at 0
      loomrt.buffer 2 "in.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 4 "layer.0.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 5 "layer.0.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 6 "layer.1.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 7 "layer.1.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 8 "loss" : tensor<f32> "output" at 0
      loomrt.param "in.w" = 2 "normal"(1.0e-01)
      loomrt.param "layer.0.w" = 4 "normal"(1.0e-01)
      loomrt.param "layer.1.w" = 6 "normal"(1.0e-01)
      loomrt.input "x" = 0
      loomrt.input "labels" = 1 {limit = 8 : i64}
      loomrt.output "loss" = 8
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 2] -> [3]
        loomrt.instr "matmul" [3, 4] -> [5] {loom.layer = "layer.0."}
        loomrt.instr "matmul" [5, 6] -> [7] {loom.layer = "layer.1."}
        loomrt.instr "cross_entropy" [7, 1] -> [8]
      }
    }
  }
}

// -----

// No pipelining, no microbatches: nothing to do.
// CHECK-LABEL: loomrt.program "forward"
// CHECK-NOT: loom.chunk
// CHECK: loomrt.instr "cross_entropy" [7, 1] -> [8]{{$}}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {pp = 1 : i64}} {
  loomrt.bundle "model" "train" batch 4 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<4x8xf32> "input" at 0
      loomrt.buffer 1 "labels" : tensor<4xi32> "input" at 0
      loomrt.buffer 2 "in.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 4 "layer.0.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 5 "layer.0.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 6 "layer.1.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 7 "layer.1.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 8 "loss" : tensor<f32> "output" at 0
      loomrt.param "in.w" = 2 "normal"(1.0e-01)
      loomrt.param "layer.0.w" = 4 "normal"(1.0e-01)
      loomrt.param "layer.1.w" = 6 "normal"(1.0e-01)
      loomrt.input "x" = 0
      loomrt.input "labels" = 1 {limit = 8 : i64}
      loomrt.output "loss" = 8
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 2] -> [3]
        loomrt.instr "matmul" [3, 4] -> [5] {loom.layer = "layer.0."}
        loomrt.instr "matmul" [5, 6] -> [7] {loom.layer = "layer.1."}
        loomrt.instr "cross_entropy" [7, 1] -> [8]
      }
    }
  }
}

// -----

// expected-error @+1 {{pp x vpp = 8 pipeline chunks, but the model has only 4 units to split}}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {pp = 8 : i64, microbatches = 8 : i64}} {
  loomrt.bundle "model" "train" batch 4 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<4x8xf32> "input" at 0
      loomrt.buffer 1 "labels" : tensor<4xi32> "input" at 0
      loomrt.buffer 2 "in.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 4 "layer.0.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 5 "layer.0.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 6 "layer.1.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 7 "layer.1.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 8 "loss" : tensor<f32> "output" at 0
      loomrt.param "in.w" = 2 "normal"(1.0e-01)
      loomrt.param "layer.0.w" = 4 "normal"(1.0e-01)
      loomrt.param "layer.1.w" = 6 "normal"(1.0e-01)
      loomrt.input "x" = 0
      loomrt.input "labels" = 1 {limit = 8 : i64}
      loomrt.output "loss" = 8
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 2] -> [3]
        loomrt.instr "matmul" [3, 4] -> [5] {loom.layer = "layer.0."}
        loomrt.instr "matmul" [5, 6] -> [7] {loom.layer = "layer.1."}
        loomrt.instr "cross_entropy" [7, 1] -> [8]
      }
    }
  }
}

// -----

// expected-error @+1 {{the plan's stages do not cover the model's 4 units in 2 non-empty chunks}}
module attributes {loom.options = {batch = 4 : i64, train = true}, loom.plan = {pp = 2 : i64, microbatches = 2 : i64, stages = array<i64: 1, 2>}} {
  loomrt.bundle "model" "train" batch 4 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<4x8xf32> "input" at 0
      loomrt.buffer 1 "labels" : tensor<4xi32> "input" at 0
      loomrt.buffer 2 "in.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 3 "h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 4 "layer.0.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 5 "layer.0.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 6 "layer.1.w" : tensor<8x8xf32> "param" at 0
      loomrt.buffer 7 "layer.1.h" : tensor<4x8xf32> "activation" at 0
      loomrt.buffer 8 "loss" : tensor<f32> "output" at 0
      loomrt.param "in.w" = 2 "normal"(1.0e-01)
      loomrt.param "layer.0.w" = 4 "normal"(1.0e-01)
      loomrt.param "layer.1.w" = 6 "normal"(1.0e-01)
      loomrt.input "x" = 0
      loomrt.input "labels" = 1 {limit = 8 : i64}
      loomrt.output "loss" = 8
      loomrt.program "forward" {
        loomrt.instr "matmul" [0, 2] -> [3]
        loomrt.instr "matmul" [3, 4] -> [5] {loom.layer = "layer.0."}
        loomrt.instr "matmul" [5, 6] -> [7] {loom.layer = "layer.1."}
        loomrt.instr "cross_entropy" [7, 1] -> [8]
      }
    }
  }
}

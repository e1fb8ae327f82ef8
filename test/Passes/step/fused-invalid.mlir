// RUN: loom-opt %s --split-input-file -verify-diagnostics | FileCheck %s

// loomrt.fused is a chain of elementwise runtime instructions as a region:
// a block argument per input, loomrt.step ops checked against the runtime's
// instruction table (one output each), and a loomrt.yield per output.

// A well-formed chain verifies and prints back unchanged.
// CHECK: loomrt.fused [0, 1] -> [2] attributes {kernel = "fused_0"} {
// CHECK-NEXT: ^bb0(%[[A:.*]]: bf16, %[[B:.*]]: f32):
// CHECK-NEXT: %[[S:.*]] = loomrt.step "add"(%[[A]], %[[B]]) : bf16, f32
// CHECK-NEXT: %[[G:.*]] = loomrt.step "gelu"(%[[S]]) {approximate = true} : f32
// CHECK-NEXT: loomrt.yield %[[G]] : f32
loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      loomrt.fused [0, 1] -> [2] attributes {kernel = "fused_0"} {
      ^bb0(%a: bf16, %b: f32):
        %0 = loomrt.step "add"(%a, %b) : bf16, f32
        %1 = loomrt.step "gelu"(%0) {approximate = true} : f32
        loomrt.yield %1 : f32
      }
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      // expected-error @below {{has 1 block arguments for 2 inputs}}
      loomrt.fused [0, 1] -> [2] {
      ^bb0(%a: f32):
        %0 = loomrt.step "relu"(%a) : f32
        loomrt.yield %0 : f32
      }
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      // expected-error @below {{yields 1 values for 2 outputs}}
      loomrt.fused [0] -> [1, 2] {
      ^bb0(%a: f32):
        %0 = loomrt.step "relu"(%a) : f32
        loomrt.yield %0 : f32
      }
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      loomrt.fused [0] -> [1] {
      ^bb0(%a: f32):
        // expected-error @below {{'frobnicate' is not a runtime instruction}}
        %0 = loomrt.step "frobnicate"(%a) : f32
        loomrt.yield %0 : f32
      }
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      loomrt.fused [0] -> [1] {
      ^bb0(%a: f32):
        // expected-error @below {{'relu' has no attribute 'bogus' (it takes none)}}
        %0 = loomrt.step "relu"(%a) {bogus = 1 : i64} : f32
        loomrt.yield %0 : f32
      }
    }
  }
}

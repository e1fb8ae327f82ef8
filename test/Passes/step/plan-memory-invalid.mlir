// RUN: loom-opt %s --loom-plan-memory -split-input-file -verify-diagnostics

// loom-plan-memory reads the loomrt ops themselves: a malformed rank is an
// error naming the op, never a crash or a hang.

// A view chain that never reaches a buffer with storage of its own.
module {
  loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      // expected-error @below {{is a view of no buffer with storage of its own (view_of 1)}}
      loomrt.buffer 0 "a" : tensor<4xf32> "activation" at 0 {view_of = 1 : i64}
      loomrt.buffer 1 "b" : tensor<4xf32> "activation" at 0 {view_of = 0 : i64}
    }
  }
}

// -----

// An instruction naming a buffer the rank does not have.
module {
  loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<4xf32> "input" at 0
      loomrt.program "forward" {
        // expected-error @below {{names buffer 7; the rank has 1}}
        loomrt.instr "relu" [0] -> [7]
      }
    }
  }
}

// -----

// Buffer ids out of order.
module {
  loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      // expected-error @below {{malformed buffer}}
      loomrt.buffer 3 "x" : tensor<4xf32> "input" at 0
    }
  }
}

// -----

// Not lowered yet.
// expected-error @below {{loom-plan-memory runs on the lowered step (a loomrt.bundle); run loom-lower-to-step first}}
module {
}

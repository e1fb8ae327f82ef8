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

// A slice view (view_offset) that runs past the end of the buffer it views.
module {
  loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "a" : tensor<4xf32> "activation" at 0
      // expected-error @below {{is a slice of 8 bytes at view_offset 12, outside the 16 bytes of buffer 0}}
      loomrt.buffer 1 "b" : tensor<2xf32> "activation" at 0 {view_of = 0 : i64, view_offset = 12 : i64}
    }
  }
}

// -----

// A view_offset on a buffer that views nothing.
module {
  loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      // expected-error @below {{has view_offset 8 but views no buffer (view_of)}}
      loomrt.buffer 0 "a" : tensor<4xf32> "activation" at 0 {view_offset = 8 : i64}
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

// RUN: loom-opt %s --split-input-file -verify-diagnostics | FileCheck %s

// loomrt.instr checks each instruction against the runtime's instruction
// table (runtime/include/loom/instructions.def), the same one the runtime
// validates manifests with: the op must be one the runtime knows, its
// inputs and outputs must be as many as the table allows, and it may carry
// only the attributes the table lists. `loom.` attributes are the
// compiler's notes and are exempt; a `loom.view` record is no instruction.

// A well-formed step verifies and prints back unchanged.
// CHECK-LABEL: loomrt.program "forward"
// CHECK-NEXT: loomrt.instr "matmul" [0, 1] -> [2] {loom.layer = "layer.0.", transpose_b = true}
// CHECK-NEXT: loomrt.instr "matmul" [0, 1, 3] -> [2] {epilogue = "bias"}
// CHECK-NEXT: loomrt.instr "reshape" [2] -> [4] {loom.view = true}
// CHECK-NEXT: loomrt.instr "all_reduce" [2, 3, 4] -> [2, 3, 4] {async = true, event = 0 : i64, group = "dp"}
// CHECK-NEXT: loomrt.instr "event_wait" [] -> [] {event = 0 : i64}
loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      loomrt.instr "matmul" [0, 1] -> [2] {transpose_b = true, loom.layer = "layer.0."}
      loomrt.instr "matmul" [0, 1, 3] -> [2] {epilogue = "bias"}
      loomrt.instr "reshape" [2] -> [4] {loom.view = true}
      loomrt.instr "all_reduce" [2, 3, 4] -> [2, 3, 4] {async = true, event = 0 : i64, group = "dp"}
      loomrt.instr "event_wait" [] -> [] {event = 0 : i64}
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      // expected-error @below {{'loomrt.instr' op 'frobnicate' is not a runtime instruction}}
      loomrt.instr "frobnicate" [0] -> [1]
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      // expected-error @below {{'matmul' takes 2 to 4 inputs, got 5}}
      loomrt.instr "matmul" [0, 1, 2, 3, 4] -> [5]
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      // expected-error @below {{'layernorm_grad' writes 3 outputs, got 1}}
      loomrt.instr "layernorm_grad" [0, 1, 2] -> [3]
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      // expected-error @below {{'concat' takes at least 1 input, got 0}}
      loomrt.instr "concat" [] -> [0] {axis = 0 : i64}
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      // expected-error @below {{'add' has no attribute 'transpose_a' (it takes none)}}
      loomrt.instr "add" [0, 1] -> [2] {transpose_a = true}
    }
  }
}

// -----

loomrt.bundle "model" "infer" batch 1 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
  loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
    loomrt.program "forward" {
      // expected-error @below {{'send' has no attribute 'group' (it takes peer tag)}}
      loomrt.instr "send" [0] -> [] {peer = 1 : i64, group = "pp"}
    }
  }
}

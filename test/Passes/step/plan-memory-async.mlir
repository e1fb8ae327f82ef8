// RUN: loom-opt %s --loom-plan-memory | FileCheck %s

// An async collective reads its inputs on the communication stream until
// its event is waited for, so loom-plan-memory keeps them live until that
// event_wait; a wait for a later event of the same stream covers the
// earlier collectives too (the stream runs them in order).
//
// g0 and g1 (bf16, 128 bytes) are read by async all-reduces (events 0 and
// 1) at instructions 1 and 3; only event 1 is waited for, at instruction
// 6. So both live to 6 and take their own places: h (live 4-5, after both
// all-reduces were issued) may not reuse either. After the wait, late
// (instruction 7) reuses g0's place.
// Persistent: x [0, 64), m0 [64, 192), m1 [192, 320), y [320, 384):
// activations start at 384.
// CHECK: loomrt.rank 0 "cpu" attributes {arena_bytes = 704 : i64, coords = {}, peak_bytes = 320 : i64}
// CHECK-NEXT: loomrt.buffer 0 "x" : tensor<16xf32> "input" at 0
// CHECK-NEXT: loomrt.buffer 1 "g0" : tensor<64xbf16> "activation" at 384
// CHECK-NEXT: loomrt.buffer 2 "m0" : tensor<32xf32> "state" at 64
// CHECK-NEXT: loomrt.buffer 3 "g1" : tensor<64xbf16> "activation" at 512
// CHECK-NEXT: loomrt.buffer 4 "m1" : tensor<32xf32> "state" at 192
// CHECK-NEXT: loomrt.buffer 5 "h" : tensor<16xf32> "activation" at 640
// CHECK-NEXT: loomrt.buffer 6 "y" : tensor<16xf32> "output" at 320
// CHECK-NEXT: loomrt.buffer 7 "late" : tensor<16xf32> "activation" at 384
module attributes {loom.options = {batch = 2 : i64}} {
  loomrt.bundle "model" "train" batch 2 seed 0 attributes {kernels = "", plan = {}, weights = ""} {
    loomrt.rank 0 "cpu" attributes {arena_bytes = 0 : i64, coords = {}, peak_bytes = 0 : i64} {
      loomrt.buffer 0 "x" : tensor<16xf32> "input" at 0
      loomrt.buffer 1 "g0" : tensor<64xbf16> "activation" at 0
      loomrt.buffer 2 "m0" : tensor<32xf32> "state" at 0
      loomrt.buffer 3 "g1" : tensor<64xbf16> "activation" at 0
      loomrt.buffer 4 "m1" : tensor<32xf32> "state" at 0
      loomrt.buffer 5 "h" : tensor<16xf32> "activation" at 0
      loomrt.buffer 6 "y" : tensor<16xf32> "output" at 0
      loomrt.buffer 7 "late" : tensor<16xf32> "activation" at 0
      loomrt.input "x" = 0
      loomrt.output "y" = 6
      loomrt.program "backward" {
        loomrt.instr "concat" [0, 0, 0, 0] -> [1] {axis = 0 : i64}
        loomrt.instr "all_reduce" [1] -> [2] {async = true, event = 0 : i64, group = "dp", reduction = "mean"}
        loomrt.instr "concat" [0, 0, 0, 0] -> [3] {axis = 0 : i64}
        loomrt.instr "all_reduce" [3] -> [4] {async = true, event = 1 : i64, group = "dp", reduction = "mean"}
        loomrt.instr "relu" [0] -> [5]
        loomrt.instr "relu" [5] -> [6]
      }
      loomrt.program "update" {
        loomrt.instr "event_wait" [] -> [] {event = 1 : i64}
        loomrt.instr "relu" [0] -> [7]
      }
    }
  }
}

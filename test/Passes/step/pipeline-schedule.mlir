// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 pp=2 mb=2 schedule=gpipe until=loom-distribute-ranks" | FileCheck %s --check-prefix=BEFORE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 pp=2 mb=2 schedule=gpipe until=loom-distribute-ranks" | loom-opt --loom-pipeline-schedule | FileCheck %s --check-prefix=GPIPE
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 pp=2 mb=4 schedule=1f1b until=loom-distribute-ranks" | loom-opt --loom-pipeline-schedule | FileCheck %s --check-prefix=1F1B
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 pp=2 mb=4 schedule=zb-h1 until=loom-distribute-ranks" | loom-opt --loom-pipeline-schedule | FileCheck %s --check-prefix=ZBH1
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 pp=2 mb=2 schedule=zb-h1 until=loom-distribute-ranks" | sed -e 's/"unary_grad" \[15, 16, 26\] -> \[28\]/"unary_grad" [15, 16, 26] -> [16]/' -e 's/\[28\] -> \[29\]/[16] -> [29]/' -e 's/\[28, 12\] -> \[31\]/[16, 12] -> [31]/' -e 's/\[11, 28\] -> \[32\]/[11, 16] -> [32]/' | loom-opt --loom-pipeline-schedule | FileCheck %s --check-prefix=ZBWAR
// RUN: loom-opt %models/mlp.mlir --loom-compile="train=true batch=4 until=loom-distribute-ranks" | loom-opt --loom-pipeline-schedule | FileCheck %s --check-prefix=NOPIPE

// loom-pipeline-schedule replaces forward and backward with one `step`
// program per rank: the tasks of the chunks the rank holds, per microbatch
// (a slice of the inputs), in the schedule's order, with recv before a task
// of what the other stage produced and send after it of what it needs;
// parameter gradients are zeroed, then summed over microbatches, and the
// loss is summed and averaged.

// Before: each of the two ranks has the whole forward and backward.
// BEFORE: loomrt.rank 0
// BEFORE: loomrt.program "backward"
// BEFORE: loomrt.program "forward"
// BEFORE: loomrt.rank 1
// BEFORE: loomrt.program "backward"
// BEFORE: loomrt.program "forward"
// BEFORE-NOT: "step"
// BEFORE-NOT: "send"

// GPipe, stage 0 (the input layer and layer.0; the gradients of in.w, in.b,
// layer.0.w, layer.0.b): both forwards, then both backwards.
// GPIPE-LABEL: loomrt.rank 0 "cpu" attributes {{{.*}}coords = {dp = 0 : i64, pp = 0 : i64, tp = 0 : i64}, loom.loss_stage = 1 : i64
// GPIPE: loomrt.param "in.w" = 2 "normal"(3.571430e-02) {grad = [[G0:[0-9]+]] : i64}
// GPIPE: loomrt.param "layer.1.w" = 12 "normal"(6.250000e-02){{$}}
// GPIPE: loomrt.input "input" = [[IN:[0-9]+]]
// GPIPE-NOT: loomrt.program "forward"
// GPIPE-NOT: loomrt.program "backward"
// GPIPE: loomrt.program "step" {
// GPIPE-NEXT: loomrt.instr "fill" [] -> [{{[0-9]+}}] {value = 0.000000e+00 : f64}
// GPIPE-NEXT: loomrt.instr "fill" [] -> [[[G0]]] {value = 0.000000e+00 : f64}
// GPIPE-COUNT-3: loomrt.instr "fill"
// GPIPE-NEXT: loomrt.instr "slice" [[[IN]]] -> [[[MB0:[0-9]+]]] {axis = 0 : i64, size = 2 : i64, start = 0 : i64}
// GPIPE-NEXT: loomrt.instr "matmul" [[[MB0]], 2] -> [{{[0-9]+}}]
// GPIPE: loomrt.instr "send" [{{[0-9]+}}] -> [] {peer = 1 : i64, tag = [[T0:[0-9]+]] : i64}
// GPIPE-NEXT: loomrt.instr "slice" [[[IN]]] -> [{{[0-9]+}}] {axis = 0 : i64, size = 2 : i64, start = 2 : i64}
// GPIPE: loomrt.instr "send" [{{[0-9]+}}] -> [] {peer = 1 : i64, tag = [[T1:[0-9]+]] : i64}
// GPIPE-NEXT: loomrt.instr "recv" [] -> [{{[0-9]+}}] {peer = 1 : i64, tag = [[B0:[0-9]+]] : i64}
// GPIPE-NEXT: loomrt.instr "unary_grad"
// GPIPE: loomrt.instr "add" [[[G0]], {{[0-9]+}}] -> [[[G0]]]
// GPIPE: loomrt.instr "recv" [] -> [{{[0-9]+}}] {peer = 1 : i64, tag = [[B1:[0-9]+]] : i64}
// GPIPE: loomrt.instr "add" [[[G0]], {{[0-9]+}}] -> [[[G0]]]
// GPIPE-NOT: "send"
// GPIPE-NOT: "recv"
// GPIPE: }
// Stage 1 (layer.1 and the head): receives what stage 0 sent, with the same
// tags, computes the loss per microbatch and averages it.
// GPIPE-LABEL: loomrt.rank 1 "cpu" attributes {{{.*}}coords = {dp = 0 : i64, pp = 1 : i64, tp = 0 : i64}
// GPIPE: loomrt.param "in.w" = 2 "normal"(3.571430e-02){{$}}
// GPIPE: loomrt.param "layer.1.w" = 12 "normal"(6.250000e-02) {grad = {{[0-9]+}} : i64}
// GPIPE: loomrt.output "loss" = [[LOSS:[0-9]+]]
// GPIPE: loomrt.program "step" {
// GPIPE-NEXT: loomrt.instr "fill" [] -> [[[LOSS]]] {value = 0.000000e+00 : f64}
// GPIPE: loomrt.instr "recv" [] -> [{{[0-9]+}}] {peer = 0 : i64, tag = [[T0]] : i64}
// GPIPE: loomrt.instr "cross_entropy" [{{[0-9]+}}, {{[0-9]+}}] -> [[[L0:[0-9]+]]]
// GPIPE-NEXT: loomrt.instr "add" [[[LOSS]], [[L0]]] -> [[[LOSS]]]
// GPIPE-NEXT: loomrt.instr "recv" [] -> [{{[0-9]+}}] {peer = 0 : i64, tag = [[T1]] : i64}
// GPIPE: loomrt.instr "cross_entropy"
// The loss gradient's seed is 1 / microbatches.
// GPIPE: loomrt.instr "fill" [] -> [{{[0-9]+}}] {value = 5.000000e-01 : f64}
// GPIPE-NEXT: loomrt.instr "cross_entropy_grad"
// GPIPE: loomrt.instr "send" [{{[0-9]+}}] -> [] {peer = 0 : i64, tag = [[B0]] : i64}
// GPIPE-NEXT: loomrt.instr "fill" [] -> [{{[0-9]+}}] {value = 5.000000e-01 : f64}
// GPIPE: loomrt.instr "send" [{{[0-9]+}}] -> [] {peer = 0 : i64, tag = [[B1]] : i64}
// GPIPE-NEXT: loomrt.instr "scale" [[[LOSS]]] -> [[[LOSS]]] {factor = 5.000000e-01 : f64}
// GPIPE-NEXT: {{^ *}}}

// 1F1B with four microbatches: stage 0 runs one forward ahead, then
// alternates (F0 F1 B0 F2 B1 F3 B2 B3); the last stage runs each
// microbatch's backward right after its forward.
// 1F1B-LABEL: loomrt.rank 0
// 1F1B: loomrt.program "step"
// 1F1B: loomrt.instr "send" {{.*}}peer = 1
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "send" {{.*}}peer = 1
// 1F1B-NOT: "send"
// 1F1B: loomrt.instr "recv" {{.*}}peer = 1
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "send" {{.*}}peer = 1
// 1F1B-NOT: "send"
// 1F1B: loomrt.instr "recv" {{.*}}peer = 1
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "send" {{.*}}peer = 1
// 1F1B-NOT: "send"
// 1F1B: loomrt.instr "recv" {{.*}}peer = 1
// 1F1B-NOT: "send"
// 1F1B: loomrt.instr "recv" {{.*}}peer = 1
// 1F1B-NOT: "send"
// 1F1B-NOT: "recv"
// 1F1B-LABEL: loomrt.rank 1
// 1F1B: loomrt.program "step"
// 1F1B: loomrt.instr "recv" {{.*}}peer = 0
// 1F1B-NOT: "send"
// 1F1B: loomrt.instr "cross_entropy"
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "cross_entropy_grad"
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "send" {{.*}}peer = 0
// 1F1B: loomrt.instr "recv" {{.*}}peer = 0
// 1F1B-NOT: "send"
// 1F1B: loomrt.instr "cross_entropy"
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "cross_entropy_grad"
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "send" {{.*}}peer = 0
// 1F1B: loomrt.instr "recv" {{.*}}peer = 0
// 1F1B-NOT: "send"
// 1F1B: loomrt.instr "cross_entropy"
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "cross_entropy_grad"
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "send" {{.*}}peer = 0
// 1F1B: loomrt.instr "recv" {{.*}}peer = 0
// 1F1B-NOT: "send"
// 1F1B: loomrt.instr "cross_entropy"
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "cross_entropy_grad"
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "send" {{.*}}peer = 0
// 1F1B-NOT: "recv"
// 1F1B: loomrt.instr "scale" [{{[0-9]+}}] -> [{{[0-9]+}}] {factor = 2.500000e-01 : f64}

// ZB-H1 with four microbatches: each backward is split into B, what the
// previous stage waits for (the loss gradient and the input gradients, sent
// as soon as they are done), and W, the weight and bias gradients and their
// accumulation, deferred. The last stage runs F0 B0 F1 B1 W0 F2 B2 W1 F3 B3
// W2 W3. Stage 0 sends nothing back, so its backward is all W, run right
// after each gradient arrives (F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3).
// ZBH1-LABEL: loomrt.rank 0
// ZBH1: loomrt.program "step"
// ZBH1: loomrt.instr "send" {{.*}}peer = 1
// ZBH1-NOT: "recv"
// ZBH1: loomrt.instr "send" {{.*}}peer = 1
// ZBH1-NEXT: loomrt.instr "recv" {{.*}}peer = 1
// ZBH1: loomrt.instr "add" [[[ACC0:[0-9]+]], {{[0-9]+}}] -> [[[ACC0]]]
// ZBH1-NOT: "recv"
// ZBH1: loomrt.instr "send" {{.*}}peer = 1
// ZBH1-LABEL: loomrt.rank 1
// ZBH1: loomrt.program "step"
// F0, then B0: the loss gradient, the input gradients, the send.
// ZBH1: loomrt.instr "cross_entropy"
// ZBH1: loomrt.instr "cross_entropy_grad" {{.*}} -> [[[DL0:[0-9]+]]]
// ZBH1-NEXT: loomrt.instr "matmul" [[[DL0]], {{[0-9]+}}] -> [{{[0-9]+}}] {transpose_b = true}
// ZBH1-NEXT: loomrt.instr "unary_grad" {{.*}} -> [[[DH0:[0-9]+]]]
// ZBH1-NEXT: loomrt.instr "matmul" [[[DH0]], {{[0-9]+}}] -> [{{[0-9]+}}] {transpose_b = true}
// ZBH1-NEXT: loomrt.instr "send" {{.*}}peer = 0
// F1 and B1 before any weight gradient.
// ZBH1-NEXT: loomrt.instr "recv" {{.*}}peer = 0
// ZBH1-NOT: transpose_a
// ZBH1: loomrt.instr "cross_entropy_grad" {{.*}} -> [[[DL1:[0-9]+]]]
// ZBH1-NOT: transpose_a
// ZBH1: loomrt.instr "send" {{.*}}peer = 0
// W0: the bias and weight gradients of microbatch 0, then their adds into
// the accumulators, one run (one launch on the GPU; a run closes once it
// holds 32 MiB of sums, so that a data-parallel bucket can go out before the
// task ends).
// ZBH1-NEXT: loomrt.instr "reduce_sum" [[[DL0]]]
// ZBH1-NEXT: loomrt.instr "matmul" [{{[0-9]+}}, [[DL0]]] -> [[[W1:[0-9]+]]] {transpose_a = true}
// ZBH1-NEXT: loomrt.instr "reduce_sum" [[[DH0]]]
// ZBH1-NEXT: loomrt.instr "matmul" [{{[0-9]+}}, [[DH0]]] -> [[[W2:[0-9]+]]] {transpose_a = true}
// ZBH1-NEXT: loomrt.instr "add" [[[ACC1:[0-9]+]], {{[0-9]+}}] -> [[[ACC1]]]
// ZBH1-NEXT: loomrt.instr "add" [[[ACC2:[0-9]+]], [[W1]]] -> [[[ACC2]]]
// ZBH1-NEXT: loomrt.instr "add"
// ZBH1-NEXT: loomrt.instr "add" [{{[0-9]+}}, [[W2]]]
// F2, B2, W1.
// ZBH1-NEXT: loomrt.instr "recv" {{.*}}peer = 0
// ZBH1: loomrt.instr "cross_entropy_grad" {{.*}} -> [[[DL2:[0-9]+]]]
// ZBH1: loomrt.instr "send" {{.*}}peer = 0
// ZBH1-NEXT: loomrt.instr "reduce_sum" [[[DL1]]]
// F3, B3, then W2 and W3 with nothing left to receive.
// ZBH1: loomrt.instr "recv" {{.*}}peer = 0
// ZBH1: loomrt.instr "cross_entropy_grad" {{.*}} -> [[[DL3:[0-9]+]]]
// ZBH1: loomrt.instr "send" {{.*}}peer = 0
// ZBH1-NEXT: loomrt.instr "reduce_sum" [[[DL2]]]
// ZBH1-NOT: "recv"
// ZBH1: loomrt.instr "reduce_sum" [[[DL3]]]
// ZBH1-NOT: "recv"
// ZBH1-NOT: "send"
// ZBH1: loomrt.instr "scale" [[[LOSS:[0-9]+]]] -> [[[LOSS]]] {factor = 2.500000e-01 : f64}

// ZB-H1 keeps program order where a buffer is reused: with the last stage's
// relu gradient written over the relu output (buffer 16, as sed rewrites it
// above), the head's weight gradient, which reads that output, must run
// before the overwrite, so it stays in B instead of moving to W.
// ZBWAR-LABEL: loomrt.rank 1
// ZBWAR: loomrt.instr "cross_entropy_grad" {{.*}} -> [[[DL:[0-9]+]]]
// ZBWAR-NEXT: loomrt.instr "matmul" [[[DL]], {{[0-9]+}}] -> [{{[0-9]+}}] {transpose_b = true}
// ZBWAR-NEXT: loomrt.instr "matmul" [[[RELU:[0-9]+]], [[DL]]] -> [{{[0-9]+}}] {transpose_a = true}
// ZBWAR-NEXT: loomrt.instr "unary_grad" [{{[0-9]+}}, [[RELU]], {{[0-9]+}}] -> [[[RELU]]]
// ZBWAR-NEXT: loomrt.instr "matmul" [[[RELU]], {{[0-9]+}}] -> [{{[0-9]+}}] {transpose_b = true}
// ZBWAR-NEXT: loomrt.instr "send" {{.*}}peer = 0

// One stage, one microbatch: nothing to schedule.
// NOPIPE-NOT: "step"
// NOPIPE: loomrt.program "backward"
// NOPIPE: loomrt.program "forward"
// NOPIPE-NOT: "step"

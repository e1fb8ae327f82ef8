// RUN: loom-opt %s | loom-opt | FileCheck %s
// RUN: loom-opt %s --mlir-print-op-generic | loom-opt | FileCheck %s
// Every loom op parses, prints and parses again to the same thing.

module attributes {loom.mesh = #loom.mesh<["dp" = 2, "tp" = 4]>} {
  // CHECK: loom.param @w : tensor<8x16xf32> init <normal(0.02)>
  loom.param @w : tensor<8x16xf32> init <normal(0.02)>
  // CHECK: loom.param @g : tensor<16xf32> init <ones>
  loom.param @g : tensor<16xf32> init <ones>
  // CHECK: loom.param @b : tensor<16xf32> init <zeros> {loom.sharding = #loom.sharding<[{"tp"}]>}
  loom.param @b : tensor<16xf32> init <zeros> {loom.sharding = #loom.sharding<[{"tp"}]>}
  // CHECK: loom.param @u : tensor<4xbf16> init <uniform(0.5)>
  loom.param @u : tensor<4xbf16> init <uniform(0.5)>
  // CHECK: loom.param @c : tensor<4xf32> init <constant(-1.5)>
  loom.param @c : tensor<4xf32> init <constant(-1.5)>

  // CHECK-LABEL: loom.block @layer(%{{.*}}: tensor<?x16xf32>) -> tensor<?x16xf32>
  loom.block @layer(%x: tensor<?x16xf32>) -> tensor<?x16xf32> {
    // CHECK: loom.param @lw : tensor<16x16xf32>
    loom.param @lw : tensor<16x16xf32> init <normal(0.1)>
    // CHECK: loom.get @lw : tensor<16x16xf32>
    %w = loom.get @lw : tensor<16x16xf32>
    // CHECK: loom.matmul %{{.*}}, %{{.*}} : tensor<?x16xf32>, tensor<16x16xf32>
    %y = loom.matmul %x, %w : tensor<?x16xf32>, tensor<16x16xf32>
    // CHECK: loom.yield %{{.*}} : tensor<?x16xf32>
    loom.yield %y : tensor<?x16xf32>
  }

  // CHECK-LABEL: func.func @elementwise
  func.func @elementwise(%a: tensor<2x3x16xf32>, %b: tensor<16xf32>) -> tensor<2x3x16xf32> {
    // CHECK: loom.add %{{.*}}, %{{.*}} : tensor<2x3x16xf32>, tensor<16xf32>
    %0 = loom.add %a, %b : tensor<2x3x16xf32>, tensor<16xf32>
    // CHECK: loom.sub
    %1 = loom.sub %0, %a : tensor<2x3x16xf32>, tensor<2x3x16xf32>
    // CHECK: loom.mul
    %2 = loom.mul %1, %b : tensor<2x3x16xf32>, tensor<16xf32>
    // CHECK: loom.div
    %3 = loom.div %2, %a : tensor<2x3x16xf32>, tensor<2x3x16xf32>
    // CHECK: loom.gelu %{{.*}} {approximate} : tensor<2x3x16xf32>
    %4 = loom.gelu %3 {approximate} : tensor<2x3x16xf32>
    // CHECK: loom.relu
    %5 = loom.relu %4 : tensor<2x3x16xf32>
    // CHECK: loom.silu
    %6 = loom.silu %5 : tensor<2x3x16xf32>
    // CHECK: loom.exp
    %7 = loom.exp %6 : tensor<2x3x16xf32>
    // CHECK: loom.tanh
    %8 = loom.tanh %7 : tensor<2x3x16xf32>
    // CHECK: loom.rsqrt
    %9 = loom.rsqrt %8 : tensor<2x3x16xf32>
    // CHECK: loom.neg
    %10 = loom.neg %9 : tensor<2x3x16xf32>
    // CHECK: loom.scale %{{.*}} {factor = 5.000000e-01 : f64}
    %11 = loom.scale %10 {factor = 0.5 : f64} : tensor<2x3x16xf32>
    return %11 : tensor<2x3x16xf32>
  }

  // CHECK-LABEL: func.func @linalg
  func.func @linalg(%a: tensor<4x8x16xf32>, %w: tensor<32x16xf32>) -> (tensor<4x8x32xf32>, tensor<4x16xf32>, tensor<4x1x16xf32>, tensor<4xf32>, tensor<4x8x16xf32>) {
    // CHECK: loom.matmul %{{.*}}, %{{.*}} {transpose_b} : tensor<4x8x16xf32>, tensor<32x16xf32>
    %0 = loom.matmul %a, %w {transpose_b} : tensor<4x8x16xf32>, tensor<32x16xf32>
    // CHECK: loom.matmul %{{.*}}, %{{.*}} {transpose_a} : tensor<4x8x16xf32>, tensor<4x8x16xf32>
    %bmm = loom.matmul %a, %a {transpose_a} : tensor<4x8x16xf32>, tensor<4x8x16xf32>
    // CHECK: loom.reduce_sum %{{.*}} {axes = array<i64: 1>} : tensor<4x8x16xf32>
    %1 = loom.reduce_sum %a {axes = array<i64: 1>} : tensor<4x8x16xf32>
    // CHECK: loom.reduce_max %{{.*}} {axes = array<i64: 1>, keepdim} : tensor<4x8x16xf32>
    %2 = loom.reduce_max %a {axes = array<i64: 1>, keepdim} : tensor<4x8x16xf32>
    // CHECK: loom.reduce_mean %{{.*}} {axes = array<i64: -1, 1>} : tensor<4x8x16xf32>
    %3 = loom.reduce_mean %a {axes = array<i64: -1, 1>} : tensor<4x8x16xf32>
    // CHECK: loom.softmax %{{.*}} {axis = 1 : i64} : tensor<4x8x16xf32>
    %4 = loom.softmax %a {axis = 1} : tensor<4x8x16xf32>
    return %0, %1, %2, %3, %4 : tensor<4x8x32xf32>, tensor<4x16xf32>, tensor<4x1x16xf32>, tensor<4xf32>, tensor<4x8x16xf32>
  }

  // CHECK-LABEL: func.func @transformer
  func.func @transformer(%ids: tensor<2x8xi32>, %table: tensor<100x64xbf16>, %g: tensor<64xbf16>, %k: tensor<2x8x16xbf16>) -> (tensor<f32>, tensor<2x8x64xbf16>) {
    // CHECK: loom.embedding %{{.*}}, %{{.*}} : tensor<100x64xbf16>, tensor<2x8xi32>
    %x = loom.embedding %table, %ids : tensor<100x64xbf16>, tensor<2x8xi32>
    // CHECK: loom.layernorm %{{.*}}, %{{.*}}, %{{.*}} {eps = 9.9999999999999995E-7 : f64}
    %ln = loom.layernorm %x, %g, %g {eps = 1.0e-6 : f64} : tensor<2x8x64xbf16>, tensor<64xbf16>, tensor<64xbf16>
    // CHECK: loom.rmsnorm %{{.*}}, %{{.*}} : tensor<2x8x64xbf16>, tensor<64xbf16>
    %rms = loom.rmsnorm %ln, %g : tensor<2x8x64xbf16>, tensor<64xbf16>
    // CHECK: loom.rotary %{{.*}} {num_heads = 4 : i64} : tensor<2x8x64xbf16>
    %q = loom.rotary %rms {num_heads = 4} : tensor<2x8x64xbf16>
    // CHECK: loom.attention %{{.*}}, %{{.*}}, %{{.*}} {causal, num_heads = 4 : i64, num_kv_heads = 1 : i64}
    %a = loom.attention %q, %k, %k {causal, num_heads = 4, num_kv_heads = 1} : tensor<2x8x64xbf16>, tensor<2x8x16xbf16>, tensor<2x8x16xbf16>
    // CHECK: loom.matmul %{{.*}}, %{{.*}} {transpose_b} : tensor<2x8x64xbf16>, tensor<100x64xbf16>
    %logits = loom.matmul %a, %table {transpose_b} : tensor<2x8x64xbf16>, tensor<100x64xbf16>
    // CHECK: loom.cross_entropy %{{.*}}, %{{.*}} : tensor<2x8x100xbf16>, tensor<2x8xi32>
    %loss = loom.cross_entropy %logits, %ids : tensor<2x8x100xbf16>, tensor<2x8xi32>
    return %loss, %a : tensor<f32>, tensor<2x8x64xbf16>
  }

  // CHECK-LABEL: func.func @shapes
  func.func @shapes(%x: tensor<2x3x4xf32>) -> (tensor<6x4xf32>, tensor<4x2x3xf32>, tensor<2x2x4xf32>, tensor<2x6x4xf32>, tensor<5x2x3x4xf32>, tensor<2x3x4xbf16>) {
    // CHECK: loom.reshape %{{.*}} : tensor<2x3x4xf32> -> tensor<6x4xf32>
    %0 = loom.reshape %x : tensor<2x3x4xf32> -> tensor<6x4xf32>
    // CHECK: loom.transpose %{{.*}} {permutation = array<i64: 2, 0, 1>} : tensor<2x3x4xf32>
    %1 = loom.transpose %x {permutation = array<i64: 2, 0, 1>} : tensor<2x3x4xf32>
    // CHECK: loom.slice %{{.*}} {axis = 1 : i64, size = 2 : i64, start = 1 : i64} : tensor<2x3x4xf32>
    %2 = loom.slice %x {axis = 1, start = 1, size = 2} : tensor<2x3x4xf32>
    // CHECK: loom.concat %{{.*}}, %{{.*}} {axis = 1 : i64} : tensor<2x3x4xf32>, tensor<2x3x4xf32>
    %3 = loom.concat %x, %x {axis = 1} : tensor<2x3x4xf32>, tensor<2x3x4xf32>
    // CHECK: loom.broadcast %{{.*}} : tensor<2x3x4xf32> -> tensor<5x2x3x4xf32>
    %4 = loom.broadcast %x : tensor<2x3x4xf32> -> tensor<5x2x3x4xf32>
    // CHECK: loom.cast %{{.*}} : tensor<2x3x4xf32> -> tensor<2x3x4xbf16>
    %5 = loom.cast %x : tensor<2x3x4xf32> -> tensor<2x3x4xbf16>
    return %0, %1, %2, %3, %4, %5 : tensor<6x4xf32>, tensor<4x2x3xf32>, tensor<2x2x4xf32>, tensor<2x6x4xf32>, tensor<5x2x3x4xf32>, tensor<2x3x4xbf16>
  }

  // CHECK-LABEL: func.func @cnn
  func.func @cnn(%x: tensor<2x3x32x32xf32>, %w: tensor<8x3x3x3xf32>, %g: tensor<8xf32>) -> (tensor<2x8x8x8xf32>, tensor<2x8x16x16xf32>) {
    // CHECK: loom.conv2d %{{.*}}, %{{.*}} {padding = 1 : i64, stride = 2 : i64} : tensor<2x3x32x32xf32>, tensor<8x3x3x3xf32>
    %c = loom.conv2d %x, %w {stride = 2, padding = 1} : tensor<2x3x32x32xf32>, tensor<8x3x3x3xf32>
    // CHECK: loom.batchnorm %{{.*}}, %{{.*}}, %{{.*}} : tensor<2x8x16x16xf32>, tensor<8xf32>, tensor<8xf32>
    %bn = loom.batchnorm %c, %g, %g : tensor<2x8x16x16xf32>, tensor<8xf32>, tensor<8xf32>
    // CHECK: loom.max_pool2d %{{.*}} {kernel = 2 : i64, stride = 2 : i64} : tensor<2x8x16x16xf32>
    %m = loom.max_pool2d %bn {kernel = 2, stride = 2} : tensor<2x8x16x16xf32>
    // CHECK: loom.avg_pool2d %{{.*}} {kernel = 3 : i64, padding = 1 : i64} : tensor<2x8x16x16xf32>
    %p = loom.avg_pool2d %bn {kernel = 3, padding = 1} : tensor<2x8x16x16xf32>
    return %m, %p : tensor<2x8x8x8xf32>, tensor<2x8x16x16xf32>
  }

  // CHECK-LABEL: func.func @forward
  func.func @forward(%x: tensor<?x16xf32>) -> tensor<?x16xf32> {
    // CHECK: loom.repeat 3 @layer(%{{.*}}) : (tensor<?x16xf32>) -> tensor<?x16xf32>
    %y = loom.repeat 3 @layer(%x) : (tensor<?x16xf32>) -> tensor<?x16xf32>
    return %y : tensor<?x16xf32>
  }

  // CHECK-LABEL: func.func @communication
  func.func @communication(%x: tensor<2x8xf32>) -> tensor<2x16xf32> {
    // CHECK: loom.grad_all_reduce %{{.*}} {group = "tp"} : tensor<2x8xf32>
    %0 = loom.grad_all_reduce %x {group = "tp"} : tensor<2x8xf32>
    // CHECK: loom.all_reduce %{{.*}} {group = "tp"} : tensor<2x8xf32>
    %1 = loom.all_reduce %0 {group = "tp"} : tensor<2x8xf32>
    // CHECK: loom.all_reduce %{{.*}} {group = "dp", reduction = "max"} : tensor<2x8xf32>
    %2 = loom.all_reduce %1 {group = "dp", reduction = "max"} : tensor<2x8xf32>
    // CHECK: loom.all_gather %{{.*}} {axis = 1 : i64, group = "tp", parts = 2 : i64} : tensor<2x8xf32>
    %3 = loom.all_gather %2 {axis = 1 : i64, group = "tp", parts = 2 : i64} : tensor<2x8xf32>
    return %3 : tensor<2x16xf32>
  }
}

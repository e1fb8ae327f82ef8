// RUN: loom-opt %s --loom-specialize-batch=batch=8 | FileCheck %s
// RUN: loom-opt %s --loom-specialize-batch=batch=0 -verify-diagnostics -split-input-file

// The dynamic batch becomes 8 everywhere: block signature, entry points,
// calls, repeats and every inferred or explicit result type.

// CHECK-LABEL: loom.block @layer(%{{.*}}: tensor<8x4x16xf32>) -> tensor<8x4x16xf32>
// CHECK: loom.matmul %{{.*}}, %{{.*}} : tensor<8x4x16xf32>, tensor<16x16xf32>
// CHECK: loom.reshape %{{.*}} : tensor<8x4x16xf32> -> tensor<32x16xf32>
// CHECK: loom.cast %{{.*}} : tensor<32x16xf32> -> tensor<32x16xbf16>
// CHECK-LABEL: func.func @loss(%{{.*}}: tensor<8x4xi32>, %{{.*}}: tensor<8x4xi32>) -> tensor<f32>
// CHECK: call @forward(%{{.*}}) : (tensor<8x4xi32>) -> tensor<8x4x16xf32>
// CHECK: loom.cross_entropy %{{.*}}, %{{.*}} : tensor<8x4x16xf32>, tensor<8x4xi32>
// CHECK-LABEL: func.func @forward(%{{.*}}: tensor<8x4xi32>) -> tensor<8x4x16xf32>
// CHECK: loom.repeat 2 @layer(%{{.*}}) : (tensor<8x4x16xf32>) -> tensor<8x4x16xf32>
// expected-error @below {{batch must be at least 1, got 0}}
module {
  loom.param @emb : tensor<16x16xf32> init <normal(0.02)>
  loom.block @layer(%x: tensor<?x4x16xf32>) -> tensor<?x4x16xf32> {
    loom.param @w : tensor<16x16xf32> init <normal(0.02)>
    %w = loom.get @w : tensor<16x16xf32>
    %y = loom.matmul %x, %w : tensor<?x4x16xf32>, tensor<16x16xf32>
    %flat = loom.reshape %y : tensor<?x4x16xf32> -> tensor<?x16xf32>
    %half = loom.cast %flat : tensor<?x16xf32> -> tensor<?x16xbf16>
    %back = loom.cast %half : tensor<?x16xbf16> -> tensor<?x16xf32>
    %z = loom.reshape %back : tensor<?x16xf32> -> tensor<?x4x16xf32>
    loom.yield %z : tensor<?x4x16xf32>
  }
  func.func @loss(%t: tensor<?x4xi32>, %l: tensor<?x4xi32>) -> tensor<f32> {
    %logits = call @forward(%t) : (tensor<?x4xi32>) -> tensor<?x4x16xf32>
    %loss = loom.cross_entropy %logits, %l : tensor<?x4x16xf32>, tensor<?x4xi32>
    return %loss : tensor<f32>
  }
  func.func @forward(%t: tensor<?x4xi32>) -> tensor<?x4x16xf32> {
    %e = loom.get @emb : tensor<16x16xf32>
    %x = loom.embedding %e, %t : tensor<16x16xf32>, tensor<?x4xi32>
    %y = loom.repeat 2 @layer(%x) : (tensor<?x4x16xf32>) -> tensor<?x4x16xf32>
    return %y : tensor<?x4x16xf32>
  }
}

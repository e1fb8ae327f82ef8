// RUN: loom-opt %s --loom-mixed-precision | FileCheck %s
// Parameters stay f32 and are cast to bf16 where they are read; activations,
// block signatures and calls become bf16; the loss stays f32.

// CHECK-LABEL: loom.block @layer(%{{.*}}: tensor<2x8xbf16>) -> tensor<2x8xbf16>
// CHECK: %[[W:.*]] = loom.get @w : tensor<8x8xf32>
// CHECK: %[[C:.*]] = loom.cast %[[W]] : tensor<8x8xf32> -> tensor<8x8xbf16>
// CHECK: loom.matmul %{{.*}}, %[[C]] : tensor<2x8xbf16>, tensor<8x8xbf16>
// CHECK-LABEL: func.func @forward(%{{.*}}: tensor<2x8xf32>) -> tensor<2x8xbf16>
// CHECK: loom.cast %{{.*}} : tensor<2x8xf32> -> tensor<2x8xbf16>
// CHECK: loom.repeat 2 @layer(%{{.*}}) : (tensor<2x8xbf16>) -> tensor<2x8xbf16>
// CHECK-LABEL: func.func @loss
// CHECK: call @forward(%{{.*}}) : (tensor<2x8xf32>) -> tensor<2x8xbf16>
// CHECK: loom.cross_entropy %{{.*}}, %{{.*}} : tensor<2x8xbf16>, tensor<2xi32>
// CHECK: return %{{.*}} : tensor<f32>
module {
  loom.block @layer(%x: tensor<2x8xf32>) -> tensor<2x8xf32> {
    loom.param @w : tensor<8x8xf32> init <normal(0.1)>
    %w = loom.get @w : tensor<8x8xf32>
    %y = loom.matmul %x, %w : tensor<2x8xf32>, tensor<8x8xf32>
    loom.yield %y : tensor<2x8xf32>
  }
  func.func @forward(%x: tensor<2x8xf32>) -> tensor<2x8xf32> {
    %y = loom.repeat 2 @layer(%x) : (tensor<2x8xf32>) -> tensor<2x8xf32>
    return %y : tensor<2x8xf32>
  }
  func.func @loss(%x: tensor<2x8xf32>, %t: tensor<2xi32>) -> tensor<f32> {
    %y = call @forward(%x) : (tensor<2x8xf32>) -> tensor<2x8xf32>
    %l = loom.cross_entropy %y, %t : tensor<2x8xf32>, tensor<2xi32>
    return %l : tensor<f32>
  }
}

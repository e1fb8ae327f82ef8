// RUN: loom-opt %s --loom-nhwc-layout --split-input-file | FileCheck %s

// A conv-bn-relu-pool stem, a repeated residual block and a global average
// pool into a classifier. Every convolution, batch norm and pooling runs in
// NHWC; the conversions put around each cancel pairwise (conv -> bn -> relu
// -> pool -> the block's argument -> its yield), so what is left converts
// the input image once and each filter where it is read. The block's images
// pass in NHWC, and the average pool reduces NHWC's spatial axes directly.

// CHECK-LABEL: loom.block @res(
// CHECK-SAME: %[[X:.*]]: tensor<2x4x4x8xf32>) -> tensor<2x4x4x8xf32>
// CHECK: %[[W:.*]] = loom.get @w : tensor<8x8x3x3xf32>
// CHECK: %[[WT:.*]] = loom.transpose %[[W]] {permutation = array<i64: 0, 2, 3, 1>} : tensor<8x8x3x3xf32>
// CHECK: %[[C:.*]] = loom.conv2d %[[X]], %[[WT]] {layout = "nhwc", padding = 1 : i64} : tensor<2x4x4x8xf32>, tensor<8x3x3x8xf32>
// CHECK: %[[N:.*]] = loom.batchnorm %[[C]], %{{.*}}, %{{.*}} {layout = "nhwc"} : tensor<2x4x4x8xf32>, tensor<8xf32>, tensor<8xf32>
// CHECK: %[[S:.*]] = loom.add %[[N]], %[[X]] : tensor<2x4x4x8xf32>, tensor<2x4x4x8xf32>
// CHECK: %[[Y:.*]] = loom.relu %[[S]] : tensor<2x4x4x8xf32>
// CHECK-NOT: loom.transpose
// CHECK: loom.yield %[[Y]] : tensor<2x4x4x8xf32>

// CHECK-LABEL: func.func @forward(
// CHECK-SAME: %[[IMG:.*]]: tensor<2x3x8x8xf32>) -> tensor<2x10xf32>
// CHECK: %[[SW:.*]] = loom.get @stem.w
// CHECK: %[[IT:.*]] = loom.transpose %[[IMG]] {permutation = array<i64: 0, 2, 3, 1>} : tensor<2x3x8x8xf32>
// CHECK: %[[SWT:.*]] = loom.transpose %[[SW]] {permutation = array<i64: 0, 2, 3, 1>} : tensor<8x3x3x3xf32>
// CHECK: %[[SC:.*]] = loom.conv2d %[[IT]], %[[SWT]] {layout = "nhwc", padding = 1 : i64} : tensor<2x8x8x3xf32>, tensor<8x3x3x3xf32>
// CHECK: %[[SN:.*]] = loom.batchnorm %[[SC]], {{.*}} {layout = "nhwc"} : tensor<2x8x8x8xf32>
// CHECK: %[[SR:.*]] = loom.relu %[[SN]] : tensor<2x8x8x8xf32>
// CHECK: %[[P:.*]] = loom.max_pool2d %[[SR]] {kernel = 3 : i64, layout = "nhwc", padding = 1 : i64, stride = 2 : i64} : tensor<2x8x8x8xf32>
// CHECK: %[[R:.*]] = loom.repeat 2 @res(%[[P]]) : (tensor<2x4x4x8xf32>) -> tensor<2x4x4x8xf32>
// CHECK: %[[M:.*]] = loom.reduce_mean %[[R]] {axes = array<i64: 1, 2>} : tensor<2x4x4x8xf32>
// CHECK: loom.matmul %[[M]], %{{.*}} : tensor<2x8xf32>, tensor<8x10xf32>
// CHECK-NOT: loom.transpose
// CHECK: return
module {
  loom.param @stem.w : tensor<8x3x3x3xf32> init <normal(0.2)>
  loom.param @stem_bn.g : tensor<8xf32> init <ones>
  loom.param @stem_bn.b : tensor<8xf32> init <zeros>
  loom.param @fc.w : tensor<8x10xf32> init <normal(0.1)>
  loom.block @res(%x: tensor<2x8x4x4xf32>) -> tensor<2x8x4x4xf32> {
    loom.param @w : tensor<8x8x3x3xf32> init <normal(0.1)>
    loom.param @g : tensor<8xf32> init <ones>
    loom.param @b : tensor<8xf32> init <zeros>
    %w = loom.get @w : tensor<8x8x3x3xf32>
    %c = loom.conv2d %x, %w {padding = 1} : tensor<2x8x4x4xf32>, tensor<8x8x3x3xf32>
    %g = loom.get @g : tensor<8xf32>
    %b = loom.get @b : tensor<8xf32>
    %n = loom.batchnorm %c, %g, %b : tensor<2x8x4x4xf32>, tensor<8xf32>, tensor<8xf32>
    %s = loom.add %n, %x : tensor<2x8x4x4xf32>, tensor<2x8x4x4xf32>
    %y = loom.relu %s : tensor<2x8x4x4xf32>
    loom.yield %y : tensor<2x8x4x4xf32>
  }
  func.func @forward(%images: tensor<2x3x8x8xf32>) -> tensor<2x10xf32> {
    %w = loom.get @stem.w : tensor<8x3x3x3xf32>
    %c = loom.conv2d %images, %w {padding = 1} : tensor<2x3x8x8xf32>, tensor<8x3x3x3xf32>
    %g = loom.get @stem_bn.g : tensor<8xf32>
    %b = loom.get @stem_bn.b : tensor<8xf32>
    %n = loom.batchnorm %c, %g, %b : tensor<2x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>
    %r = loom.relu %n : tensor<2x8x8x8xf32>
    %p = loom.max_pool2d %r {kernel = 3, padding = 1, stride = 2} : tensor<2x8x8x8xf32>
    %x = loom.repeat 2 @res(%p) : (tensor<2x8x4x4xf32>) -> tensor<2x8x4x4xf32>
    %m = loom.reduce_mean %x {axes = array<i64: 2, 3>} : tensor<2x8x4x4xf32>
    %fw = loom.get @fc.w : tensor<8x10xf32>
    %l = loom.matmul %m, %fw : tensor<2x8xf32>, tensor<8x10xf32>
    return %l : tensor<2x10xf32>
  }
}

// -----

// Where the network flattens instead of pooling, the one conversion back to
// NCHW sits before the reshape (the flattened order is NCHW's). The image is
// converted after its cast to bf16, in half the bytes.

// CHECK-LABEL: func.func @flatten(
// CHECK: %[[H:.*]] = loom.cast %{{.*}} : tensor<2x3x6x6xf32> -> tensor<2x3x6x6xbf16>
// CHECK: %[[T:.*]] = loom.transpose %[[H]] {permutation = array<i64: 0, 2, 3, 1>} : tensor<2x3x6x6xbf16>
// CHECK: %[[C:.*]] = loom.conv2d %[[T]], %{{.*}} {layout = "nhwc"} : tensor<2x6x6x3xbf16>, tensor<4x1x1x3xbf16>
// CHECK: %[[A:.*]] = loom.avg_pool2d %[[C]] {kernel = 2 : i64, layout = "nhwc", stride = 2 : i64} : tensor<2x6x6x4xbf16>
// CHECK: %[[B:.*]] = loom.transpose %[[A]] {permutation = array<i64: 0, 3, 1, 2>} : tensor<2x3x3x4xbf16>
// CHECK: loom.reshape %[[B]] : tensor<2x4x3x3xbf16> -> tensor<2x36xbf16>
module {
  loom.param @w : tensor<4x3x1x1xbf16> init <normal(0.2)>
  func.func @flatten(%images: tensor<2x3x6x6xf32>) -> tensor<2x36xbf16> {
    %h = loom.cast %images : tensor<2x3x6x6xf32> -> tensor<2x3x6x6xbf16>
    %w = loom.get @w : tensor<4x3x1x1xbf16>
    %c = loom.conv2d %h, %w : tensor<2x3x6x6xbf16>, tensor<4x3x1x1xbf16>
    %a = loom.avg_pool2d %c {kernel = 2, stride = 2} : tensor<2x4x6x6xbf16>
    %f = loom.reshape %a : tensor<2x4x3x3xbf16> -> tensor<2x36xbf16>
    return %f : tensor<2x36xbf16>
  }
}

// -----

// A network without convolutions keeps its layout.

// CHECK-LABEL: func.func @no_convolutions(
// CHECK-NOT: layout
// CHECK-NOT: loom.transpose
// CHECK: return
module {
  func.func @no_convolutions(%x: tensor<2x3x4x4xf32>, %g: tensor<3xf32>, %b: tensor<3xf32>) -> tensor<2x3x2x2xf32> {
    %n = loom.batchnorm %x, %g, %b : tensor<2x3x4x4xf32>, tensor<3xf32>, tensor<3xf32>
    %p = loom.max_pool2d %n {kernel = 2, stride = 2} : tensor<2x3x4x4xf32>
    return %p : tensor<2x3x2x2xf32>
  }
}

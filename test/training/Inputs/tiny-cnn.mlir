// A small residual convolution network (ResNet's pieces at toy size) for
// the layout tests: stem conv-bn-relu-maxpool, a repeated basic block, a
// downsampling block with a 1x1 shortcut, global average pool, classifier.
module attributes {loom.family = "resnet"} {
  loom.param @stem.w : tensor<8x3x3x3xf32> init <normal(0.27)>
  loom.param @stem_bn.g : tensor<8xf32> init <ones>
  loom.param @stem_bn.b : tensor<8xf32> init <zeros>
  loom.param @fc.w : tensor<16x10xf32> init <normal(0.1)>
  loom.param @fc.b : tensor<10xf32> init <zeros>

  loom.block @basic(%x: tensor<?x8x8x8xf32>) -> tensor<?x8x8x8xf32> {
    loom.param @conv1.w : tensor<8x8x3x3xf32> init <normal(0.16)>
    loom.param @bn1.g : tensor<8xf32> init <ones>
    loom.param @bn1.b : tensor<8xf32> init <zeros>
    loom.param @conv2.w : tensor<8x8x3x3xf32> init <normal(0.16)>
    loom.param @bn2.g : tensor<8xf32> init <ones>
    loom.param @bn2.b : tensor<8xf32> init <zeros>
    %w1 = loom.get @conv1.w : tensor<8x8x3x3xf32>
    %c1 = loom.conv2d %x, %w1 {padding = 1} : tensor<?x8x8x8xf32>, tensor<8x8x3x3xf32>
    %g1 = loom.get @bn1.g : tensor<8xf32>
    %b1 = loom.get @bn1.b : tensor<8xf32>
    %n1 = loom.batchnorm %c1, %g1, %b1 : tensor<?x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>
    %a1 = loom.relu %n1 : tensor<?x8x8x8xf32>
    %w2 = loom.get @conv2.w : tensor<8x8x3x3xf32>
    %c2 = loom.conv2d %a1, %w2 {padding = 1} : tensor<?x8x8x8xf32>, tensor<8x8x3x3xf32>
    %g2 = loom.get @bn2.g : tensor<8xf32>
    %b2 = loom.get @bn2.b : tensor<8xf32>
    %n2 = loom.batchnorm %c2, %g2, %b2 : tensor<?x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>
    %s = loom.add %n2, %x : tensor<?x8x8x8xf32>, tensor<?x8x8x8xf32>
    %y = loom.relu %s : tensor<?x8x8x8xf32>
    loom.yield %y : tensor<?x8x8x8xf32>
  }

  loom.block @down(%x: tensor<?x8x8x8xf32>) -> tensor<?x16x4x4xf32> {
    loom.param @conv1.w : tensor<16x8x3x3xf32> init <normal(0.16)>
    loom.param @bn1.g : tensor<16xf32> init <ones>
    loom.param @bn1.b : tensor<16xf32> init <zeros>
    loom.param @conv2.w : tensor<16x16x3x3xf32> init <normal(0.12)>
    loom.param @bn2.g : tensor<16xf32> init <ones>
    loom.param @bn2.b : tensor<16xf32> init <zeros>
    loom.param @short.w : tensor<16x8x1x1xf32> init <normal(0.5)>
    loom.param @short_bn.g : tensor<16xf32> init <ones>
    loom.param @short_bn.b : tensor<16xf32> init <zeros>
    %w1 = loom.get @conv1.w : tensor<16x8x3x3xf32>
    %c1 = loom.conv2d %x, %w1 {padding = 1, stride = 2} : tensor<?x8x8x8xf32>, tensor<16x8x3x3xf32>
    %g1 = loom.get @bn1.g : tensor<16xf32>
    %b1 = loom.get @bn1.b : tensor<16xf32>
    %n1 = loom.batchnorm %c1, %g1, %b1 : tensor<?x16x4x4xf32>, tensor<16xf32>, tensor<16xf32>
    %a1 = loom.relu %n1 : tensor<?x16x4x4xf32>
    %w2 = loom.get @conv2.w : tensor<16x16x3x3xf32>
    %c2 = loom.conv2d %a1, %w2 {padding = 1} : tensor<?x16x4x4xf32>, tensor<16x16x3x3xf32>
    %g2 = loom.get @bn2.g : tensor<16xf32>
    %b2 = loom.get @bn2.b : tensor<16xf32>
    %n2 = loom.batchnorm %c2, %g2, %b2 : tensor<?x16x4x4xf32>, tensor<16xf32>, tensor<16xf32>
    %ws = loom.get @short.w : tensor<16x8x1x1xf32>
    %cs = loom.conv2d %x, %ws {stride = 2} : tensor<?x8x8x8xf32>, tensor<16x8x1x1xf32>
    %gs = loom.get @short_bn.g : tensor<16xf32>
    %bs = loom.get @short_bn.b : tensor<16xf32>
    %ns = loom.batchnorm %cs, %gs, %bs : tensor<?x16x4x4xf32>, tensor<16xf32>, tensor<16xf32>
    %s = loom.add %n2, %ns : tensor<?x16x4x4xf32>, tensor<?x16x4x4xf32>
    %y = loom.relu %s : tensor<?x16x4x4xf32>
    loom.yield %y : tensor<?x16x4x4xf32>
  }

  func.func @forward(%images: tensor<?x3x16x16xf32>) -> tensor<?x10xf32> {
    %w = loom.get @stem.w : tensor<8x3x3x3xf32>
    %c = loom.conv2d %images, %w {padding = 1} : tensor<?x3x16x16xf32>, tensor<8x3x3x3xf32>
    %g = loom.get @stem_bn.g : tensor<8xf32>
    %b = loom.get @stem_bn.b : tensor<8xf32>
    %n = loom.batchnorm %c, %g, %b : tensor<?x8x16x16xf32>, tensor<8xf32>, tensor<8xf32>
    %a = loom.relu %n : tensor<?x8x16x16xf32>
    %p = loom.max_pool2d %a {kernel = 3, padding = 1, stride = 2} : tensor<?x8x16x16xf32>
    %x1 = loom.repeat 2 @basic(%p) : (tensor<?x8x8x8xf32>) -> tensor<?x8x8x8xf32>
    %x2 = loom.repeat 1 @down(%x1) : (tensor<?x8x8x8xf32>) -> tensor<?x16x4x4xf32>
    %pooled = loom.reduce_mean %x2 {axes = array<i64: 2, 3>} : tensor<?x16x4x4xf32>
    %fw = loom.get @fc.w : tensor<16x10xf32>
    %fb = loom.get @fc.b : tensor<10xf32>
    %l0 = loom.matmul %pooled, %fw : tensor<?x16xf32>, tensor<16x10xf32>
    %logits = loom.add %l0, %fb : tensor<?x10xf32>, tensor<10xf32>
    return %logits : tensor<?x10xf32>
  }

  func.func @loss(%images: tensor<?x3x16x16xf32>, %labels: tensor<?xi32>) -> tensor<f32> {
    %logits = call @forward(%images) : (tensor<?x3x16x16xf32>) -> tensor<?x10xf32>
    %loss = loom.cross_entropy %logits, %labels : tensor<?x10xf32>, tensor<?xi32>
    return %loss : tensor<f32>
  }
}

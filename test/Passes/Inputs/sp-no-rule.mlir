// A column- then row-parallel pair whose summed output is then mixed across
// the tokens (a softmax over the batch): tensor parallelism splits it, but
// sequence parallelism has no rule for what follows.
module {
  loom.param @w1 : tensor<16x32xf32> init <normal(0.02)>
  loom.param @w2 : tensor<32x16xf32> init <normal(0.02)>
  func.func @loss(%x: tensor<?x8x16xf32>) -> tensor<f32> {
    %w1 = loom.get @w1 : tensor<16x32xf32>
    %h = loom.matmul %x, %w1 : tensor<?x8x16xf32>, tensor<16x32xf32>
    %g = loom.gelu %h : tensor<?x8x32xf32>
    %w2 = loom.get @w2 : tensor<32x16xf32>
    %y = loom.matmul %g, %w2 : tensor<?x8x32xf32>, tensor<32x16xf32>
    %p = loom.softmax %y {axis = 0 : i64} : tensor<?x8x16xf32>
    %l = loom.reduce_mean %p {axes = array<i64: 0, 1, 2>} : tensor<?x8x16xf32>
    return %l : tensor<f32>
  }
}

func.func @forward(%x: tensor<2x8x768xf32>) -> tensor<2x8x2304xf32> {
  %w = loom.get @w : tensor<512x2304xf32>
  %y = loom.matmul %x, %w : tensor<2x8x768xf32>, tensor<512x2304xf32>
  return %y : tensor<2x8x2304xf32>
}

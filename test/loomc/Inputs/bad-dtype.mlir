func.func @forward(%x: tensor<2x8xf32>, %y: tensor<2x8xbf16>) -> tensor<2x8xf32> {
  %z = loom.add %x, %y : tensor<2x8xf32>, tensor<2x8xbf16>
  return %z : tensor<2x8xf32>
}

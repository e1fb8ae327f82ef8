loom.block @layer(%x: tensor<2x8xf32>) -> tensor<2x8xf32> {
  loom.yield %x : tensor<2x8xf32>
}
func.func @forward(%x: tensor<2x8xf32>) -> tensor<2x8xf32> {
  %y = loom.repeat COUNT @layer(%x) : (tensor<2x8xf32>) -> tensor<2x8xf32>
  return %y : tensor<2x8xf32>
}
